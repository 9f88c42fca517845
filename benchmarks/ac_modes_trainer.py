"""Activation checkpointing through the real trainer: tokens/s, MFU and peak memory per AC mode.

Runs `python -m torchtitan.train` once per AC mode with the same config and overrides, reads
each run's metrics.jsonl, drops the warm-up steps, and prints one table (medians over the
remaining steps). Made for one GPU, e.g. Llama 3 1B at seq_len 8192 in bf16:

    python benchmarks/ac_modes_trainer.py --config debug_model.toml --flavor 1B --seq-len 8192 \\
        --steps 8 --warmup 3 [--modes none full "selective 2" "selective op"] [-- EXTRA OVERRIDES]

`--modes` may also name "none + compile", "full + compile" and "selective op + compile"
(`compile.enable`: each block compiled after AC; compiling happens in the warm-up steps), and
"selective op + offload" and "selective op + offload 0-7" (`activation_checkpoint.offload`, on
every block or on blocks 0-7), and "auto at full's peak" and "auto at selective op's peak"
(mode "auto" with `auto_memory_gib` set to that fixed mode's peak in this run, so list the
fixed mode first; on the CPU that peak is the process's whole RSS, so those budgets are loose).

It also runs on the CPU with the debug model (MFU is then n/a: no peak FLOPs are known). A mode
whose run fails, or outlasts `--timeout`, gets a row saying so and the exit code is 1.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_MODE, _OPTION = "--activation_checkpoint.mode", "--activation_checkpoint.selective_ac_option"
MODES = {
    "none": [_MODE, "none"],
    "full": [_MODE, "full"],
    "selective 2": [_MODE, "selective", _OPTION, "2"],
    "selective op": [_MODE, "selective", _OPTION, "op"],
}
# Eager SAC runs each op of the forward and of the recompute through a Python dispatch mode;
# compiled, the policy is applied once, in the graph. Not in the default --modes.
EAGER_MODES = list(MODES)
MODES |= {f"{m} + compile": [*MODES[m], "--compile.enable"] for m in ("none", "full", "selective op")}
# op-SAC with activation offload: every block, or the first eight (early blocks' copies have the
# most compute after them to hide behind). Not in the default --modes.
_OFFLOAD = "--activation_checkpoint.offload"
MODES["selective op + offload"] = [*MODES["selective op"], _OFFLOAD, "saved"]
MODES["selective op + offload 0-7"] = [*MODES["selective op"], _OFFLOAD, "saved", _OFFLOAD + "_blocks", "0-7"]
# op-SAC with the whole logits at once (`training.loss_chunks = 1`); every other mode runs the
# default chunked head. Not in the default --modes.
MODES["selective op, unchunked head"] = [*MODES["selective op"], "--training.loss_chunks", "1"]
# Mode "auto" at the budget of a fixed mode's peak, measured earlier in the same run.
AUTO_AT = {"auto at full's peak": "full", "auto at selective op's peak": "selective op"}
MEMORY_KEYS = ("memory/max_allocated_gib", "memory/max_rss_gib")


def mode_argv(mode: str, peaks: dict[str, float]) -> list[str] | str:
    """The AC overrides of `mode`, or why it cannot run (an auto mode before its fixed mode)."""
    if mode not in AUTO_AT:
        return MODES[mode]
    fixed = AUTO_AT[mode]
    if fixed not in peaks:
        return f"needs the '{fixed}' row earlier in --modes"
    return [_MODE, "auto", "--activation_checkpoint.auto_memory_gib", f"{peaks[fixed]:.4f}"]


def run_mode(cli, mode: str, folder: Path, peaks: dict[str, float]) -> list[dict] | str:
    """The records after warm-up of one mode's run, or why the run gave none."""
    ac = mode_argv(mode, peaks)
    if isinstance(ac, str):
        return ac
    argv = [sys.executable, "-m", "torchtitan.train", "--config", cli.config,
            "--training.steps", str(cli.steps), "--training.seq_len", str(cli.seq_len),
            "--training.local_batch_size", str(cli.batch), "--metrics.log_freq", "1",
            "--job.dump_folder", str(folder), *ac, *cli.extra]  # fmt: skip
    if cli.flavor:
        argv += ["--model.flavor", cli.flavor]
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=os.environ.copy(), timeout=cli.timeout
        )
    except subprocess.TimeoutExpired:
        return f"stopped after its {cli.timeout:.0f} s (--timeout)"
    if proc.returncode != 0:
        print(f"mode {mode} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return f"failed (exit {proc.returncode})"
    with open(folder / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    # Training steps only: a validation pass writes a record of its own (no step time).
    steps = [r for r in records if "step_seconds" in r]
    return steps[cli.warmup :]


def peak_gib(records: list[dict]) -> float:
    memory_key = next(k for k in MEMORY_KEYS if k in records[-1])
    return max(r[memory_key] for r in records)


def row(mode: str, records: list[dict], base_seconds: float) -> str:
    seconds = statistics.median(r["step_seconds"] for r in records)
    tps = statistics.median(r["tps"] for r in records)
    mfu = [r["mfu_pct"] for r in records if r.get("mfu_pct") is not None]
    memory = peak_gib(records)
    mfu_text = f"{statistics.median(mfu):.1f}" if mfu else "n/a"
    cells = [
        f"{tps:,.0f}",
        mfu_text,
        f"{memory:.2f}",
        f"{1000 * seconds:.0f}",
        f"{seconds / base_seconds:.2f}",
    ]
    return f"| {mode} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="debug_model.toml")
    parser.add_argument("--flavor", default=None)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped before the medians")
    parser.add_argument("--modes", nargs="+", default=EAGER_MODES, choices=[*MODES, *AUTO_AT])
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed to each mode's run")
    parser.add_argument("extra", nargs="*", help="more trainer overrides, after --")
    cli = parser.parse_args()
    if cli.steps <= cli.warmup:
        sys.exit(f"--steps {cli.steps} must exceed --warmup {cli.warmup}")
    # Each row is printed as its run ends, so a caller's time limit keeps the rows done so far.
    failed, held, base, peaks = [], [], None, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in cli.modes:
            folder = Path(tmp) / mode.replace(" ", "_").replace("+", "").replace("'", "")
            records = run_mode(cli, mode, folder, peaks)
            if isinstance(records, str):
                failed.append(f"{mode} {records}")
                held.append(f"| {mode} | {records} | | | | |")
            else:
                if base is None:
                    base = statistics.median(r["step_seconds"] for r in records)
                    _print_header(cli, mode, records)
                held.append(row(mode, records, base))
                peaks[mode] = peak_gib(records)
            if base is not None:
                print("\n".join(held), flush=True)
                held = []
    if base is None:
        sys.exit("no mode ran: " + "; ".join(failed))
    if failed:
        sys.exit(1)


def _print_header(cli, first: str, records: list[dict]) -> None:
    memory_name = next(k for k in MEMORY_KEYS if k in records[-1]).split("/")[1]
    print(
        f"{cli.config} flavor {cli.flavor or '(config)'}, batch {cli.batch} x {cli.seq_len}, "
        f"median of steps {cli.warmup + 1}-{cli.steps}; extra: {' '.join(cli.extra) or 'none'}"
    )
    print()
    print(f"| mode | tokens/s | MFU % | peak memory GiB ({memory_name}) | step ms | time vs {first} |")
    print("|---|---|---|---|---|---|")


if __name__ == "__main__":
    main()
