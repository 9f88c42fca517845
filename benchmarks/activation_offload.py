"""Activation offload (`[activation_checkpoint] offload = "saved"`): step time and the device bytes
held for backward, per AC mode with and without offload, side by side in one run.

    python benchmarks/activation_offload.py [--flavor debugmodel] [--batch 4] [--seq-len 512]
        [--dtype float32] [--rounds 5] [--steps-per-round 3] [--min-bytes 1048576]

A Llama 3 model (FLAVOR, on the accelerator when there is one, else the CPU) runs forward and
backward on random tokens; the settings take turns round by round, so that drift in the machine's
speed falls on all of them alike (median round). Per setting:

- step ms: forward + backward, waiting for the device at the end of each step.
- held for backward: the device bytes the forward leaves alive for backward
  (`bytes_held_for_backward`, measured, with the offloader's host buffers left out).
- offloaded: the bytes one step sends to the host (and back).
- copy ms: what copying those bytes out and back takes alone, measured on this machine with
  the same copies outside a step; "exposed" is the step's time over the same AC mode without
  offload, "hidden" is copy ms less exposed (the part that overlapped compute). On the CPU the
  copies are synchronous, so nothing can hide; the columns are meant for a GPU.
"""

import argparse
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from torchtitan.config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.device import local_device
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import LLAMA3_SAVE_LIST
from torchtitan.tools.activation_memory import bytes_held_for_backward

MODES = {
    "none": ActivationCheckpoint(mode="none"),
    "full": ActivationCheckpoint(mode="full"),
    "op-SAC": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
}
MIB = 2**20


def _synchronize() -> None:
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


class Setting:
    """One AC mode, with or without offload: its model, and the offloader when it has one."""

    def __init__(self, cli, ac: ActivationCheckpoint, device: torch.device):
        args = replace(llama3_flavors[cli.flavor], max_seq_len=cli.seq_len)
        with torch.device("meta"):
            self.model = Transformer(args)
        plan = apply_ac(self.model, ac, op_sac_save_list=LLAMA3_SAVE_LIST)
        self.model.to_empty(device=device)
        torch.manual_seed(0)
        self.model.init_weights()
        self.model.to(getattr(torch, cli.dtype))
        self.offloader = plan.offloader
        self.tokens = torch.randint(0, args.vocab_size, (cli.batch, cli.seq_len + 1), device=device)

    def step(self) -> None:
        logits = self.model(self.tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), self.tokens[:, 1:].flatten()).backward()
        self.model.zero_grad(set_to_none=True)

    def held_for_backward(self) -> int:
        host = self.offloader.pool.free_buffer_tensors() if self.offloader else []
        return bytes_held_for_backward(self.model, self.tokens[:, :-1], elsewhere=host)

    def offloaded_per_step(self) -> int:
        return sum(self.offloader.bytes_by_block.values()) if self.offloader else 0


def copy_seconds(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Median time to copy `nbytes` to host memory and back (pinned on an accelerator)."""
    if nbytes == 0:
        return 0.0
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type != "cpu")
    times = []
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        host.copy_(on_device, non_blocking=True)
        on_device.copy_(host, non_blocking=True)
        _synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--min-bytes", type=int, default=MIB)
    cli = parser.parse_args()
    device = local_device()
    settings = {}
    for name, ac in MODES.items():
        settings[name] = Setting(cli, ac, device)
        offloading = replace(ac, offload="saved", offload_min_bytes=cli.min_bytes)
        settings[f"{name} + offload"] = Setting(cli, offloading, device)
    times: dict[str, list[float]] = {name: [] for name in settings}
    for round_ in range(cli.rounds + 1):
        for name, setting in settings.items():
            _synchronize()
            start = time.perf_counter()
            for _ in range(cli.steps_per_round):
                setting.step()
            _synchronize()
            if round_:  # the first round warms up (and fills the offload pools)
                times[name].append((time.perf_counter() - start) / cli.steps_per_round)
    print(
        f"\nLlama 3 {cli.flavor}, batch {cli.batch} x {cli.seq_len}, {cli.dtype}, {device.type}, "
        f"offload of tensors of {cli.min_bytes} bytes or more, torch {torch.__version__}\n"
    )
    columns = ["step ms", "vs none", "held for backward MiB", "offloaded MiB"]
    columns += ["copy ms", "exposed ms", "hidden ms"]
    print("| setting | " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|")
    base = statistics.median(times["none"])
    for name, setting in settings.items():
        step = statistics.median(times[name])
        held = setting.held_for_backward() / MIB
        sent = setting.offloaded_per_step()
        cells = [f"{1000 * step:.1f}", f"{step / base:.3f}", f"{held:.1f}", f"{sent / MIB:.1f}"]
        if sent:
            copy = copy_seconds(sent, device)
            exposed = max(0.0, step - statistics.median(times[name.removesuffix(" + offload")]))
            cells += [f"{1000 * copy:.1f}", f"{1000 * exposed:.1f}", f"{1000 * max(0.0, copy - exposed):.1f}"]
        else:
            cells += ["", "", ""]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
