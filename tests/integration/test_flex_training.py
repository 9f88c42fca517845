"""The flex-attention debug configs train on the CPU: 2 processes (FSDP), op-SAC, full AC, and
op-SAC with compile on.

On the CPU flex attention runs its block_causal mask as an exact dense mask through SDPA; these
runs check that path end to end (mask built from each batch's EOS tokens, AC, compile, FSDP) and
that the model learns.
"""

import pytest

from tests.conftest import needs_checkpointed_scalar_capture, read_metrics, run_trainer

pytestmark = pytest.mark.integration

CONFIGS = [
    "debug_model_flex_attn.toml",
    "qwen3_debug_model_flex_attn.toml",
    "deepseek_v3_debug_model_flex_attn.toml",
]
MOE_CONFIGS = {"deepseek_v3_debug_model_flex_attn.toml"}  # its blocks after the first are MoE
OP_SAC = ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"]
AC_MODES = {
    "op-SAC": OP_SAC,
    "full": ["--activation_checkpoint.mode=full"],
    "op-SAC + compile": [*OP_SAC, "--compile.enable"],
}
STEPS = 8
# Short: 8 steps of 2 x 4 sequences of 128 tokens, warmup 2 so that 8 steps are enough to learn
# (the loss is at 0.59-0.69 of the first step's by step 8 under full AC; the bound is 0.8).
SHORT = ["--training.steps", str(STEPS), "--training.seq_len", "128", "--training.local_batch_size", "4",
         "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(config, AC mode) -> (finished process, training records), each run once per module."""
    cache = {}

    def get(config: str, mode: str):
        if (config, mode) not in cache:
            dump = tmp_path_factory.mktemp(config.removesuffix(".toml")) / mode
            argv = ["--config", config, *SHORT, *AC_MODES[mode], "--job.dump_folder", str(dump)]
            proc = run_trainer(argv, nproc=2)
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[config, mode] = proc, read_metrics(dump)
        return cache[config, mode]

    return get


def _cases(modes):
    """(config, mode) params; the MoE config compiled (a minute on 2 cores) is under full_matrix,
    its wrapping rule unit-tested by default in tests/unit/test_activation_checkpoint.py."""
    for config in CONFIGS:
        for mode in modes:
            slow = config in MOE_CONFIGS and mode == "op-SAC + compile"
            yield pytest.param(config, mode, marks=[pytest.mark.full_matrix] if slow else [])


@pytest.mark.parametrize("config, mode", list(_cases(AC_MODES)))
def test_flex_config_trains_on_two_processes_and_loss_falls(config, mode, runs):
    proc, records = runs(config, mode)
    first, last = records[0]["loss"], records[-1]["loss"]
    print(f"{config}, {mode}, FSDP 2, {STEPS} steps: loss {first:.3f} -> {last:.3f}")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert last <= 0.8 * first, (first, last)
    logs = proc.stdout + proc.stderr
    assert "exact dense boolean mask" in logs  # the CPU path says which path it took
    if mode == "op-SAC":
        assert "attention branch full +" in logs  # flex without compile: attention under full AC
    if mode == "op-SAC + compile":
        assert "Compiled each transformer block" in logs and "attention branch full +" not in logs
        # The AC module's rule for MoE blocks: routing splits the block's graph, so attention
        # and MoE are two SAC regions.
        assert ("attention op-SAC + moe op-SAC" in logs) == (config in MOE_CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
def test_op_sac_and_full_ac_train_alike(config, runs):
    op_sac, full = runs(config, "op-SAC")[1], runs(config, "full")[1]
    assert len(op_sac) == len(full) == STEPS
    for a, b in zip(op_sac, full):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)


@pytest.mark.parametrize("config, mode", list(_cases(["op-SAC + compile"])))
def test_compiled_training_equals_eager(config, mode, runs):
    eager, compiled = runs(config, "op-SAC")[1], runs(config, mode)[1]
    assert len(compiled) == len(eager) == STEPS
    for a, b in zip(compiled, eager):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a, b)


# Under full_matrix: the DeepSeek-V3 flex config's compiled run above takes the same rule.
@pytest.mark.full_matrix
@needs_checkpointed_scalar_capture
def test_moe_flex_flavor_with_compile_and_captured_scalars_checkpoints_attention_and_moe_separately(tmp_path):
    """flex + op-SAC + compile on Qwen3 MoE blocks, capture_scalar_outputs on: two SAC regions
    per block (the AC module's rule)."""
    dump = tmp_path / "moe_flex"
    flavor = ["--model.flavor", "debugmodel_moe_flex_attn"]
    compile_all = [*AC_MODES["op-SAC + compile"], "--compile.capture_scalar_outputs"]
    argv = [
        "--config",
        "qwen3_debug_model_moe.toml",
        *flavor,
        *SHORT,
        *compile_all,
        "--job.dump_folder",
        str(dump),
    ]
    proc = run_trainer(argv, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(dump)
    assert "attention op-SAC + moe op-SAC" in proc.stdout + proc.stderr
    assert records[-1]["loss"] <= 0.8 * records[0]["loss"], records
