"""The one check that a layout trains as one process does, gradient by gradient.

`train_for_parity` runs the real trainer (`tests/integration/parity_worker.py`: the `Trainer` a
user's run builds from the same arguments, stepped from outside) on some ranks and returns what
it read: per-step losses and gradient norms, every gradient after step 1 and every parameter
after the last step, as full tensors keyed by their unsharded names. `reference` is the same
run in one process without AC. `assert_parity` compares a layout's run with it.

The tolerance, derived once (fp32 throughout: weights, compute and reductions; u = 2^-24):
a layout computes the same sums as one process in another order and grouping: data-parallel
ranks split the tokens each weight gradient sums over, tensor parallelism splits the inner
products of the row-wise Linears and sums the partial results, FSDP and the all-reduces add
the ranks' partial gradients. Reordering a sum of n terms moves it by at most (n - 1) u times
the sum of the terms' magnitudes, and the rounding errors of independent reorderings add up like
a random walk, ~sqrt(n) u relative. The longest reductions in the debug models are the weight
gradients' sums over the batch's tokens (B x S = 256) and the feed-forward's inner dim (768 for
Qwen3, 1024 at most), so one op is off by ~sqrt(1024) u = 2e-6 at worst-typical. The error then
passes through the backward of each block (8 at most, one matmul per step of the chain) and
the softmax, each of which may grow it by its condition, a small factor here: about 4 ops
deep, 2e-6 x 4 = 8e-6. So a correct layout stays below `FP32_RTOL` = 1e-5 per tensor,
‖a - b‖ / ‖b‖; a bug confined to one tensor (an unreduced partial sum, swapped expert rows,
a shard scaled by 1 + 1e-3) moves that tensor by far more. Measured, the worst tensor of every
layout in the default run is below 7e-7 (docs/testing.md).

Parameters after the last step are compared with `PARAM_RTOL`, wider: Adam's first update is
lr x sign(g) per element (m / sqrt(v) = g / |g|), so an element whose gradient is zero up to
rounding may step either way in the two runs: 2 lr for that element.
"""

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.conftest import PROJECT_ROOT, launch_ranks

FP32_RTOL = 1e-5
PARAM_RTOL = 1e-4
WORKER = PROJECT_ROOT / "tests" / "integration" / "parity_worker.py"
_AC = "--activation_checkpoint."
NO_AC = [_AC + "mode", "none"]
# The AC modes the parity tests run, as command-line overrides.
AC_ARGV = {
    "none": NO_AC,
    "full": [_AC + "mode", "full"],
    "full replay": [_AC + "mode", "full", _AC + "full_ac_all_to_all", "replay"],
    "selective 2": [_AC + "mode", "selective", _AC + "selective_ac_option", "2"],
    "op-SAC": [_AC + "mode", "selective", _AC + "selective_ac_option", "op"],
    # Mode "auto" with its plan given: each choice on blocks of its own, as far as the model has
    # blocks (the debug Llama 3's 6 end before "full", which the other rows run); the offloading
    # ones move every tensor of 4 KiB and more.
    "auto plan": [
        _AC + "mode",
        "auto",
        _AC + "offload_min_bytes",
        "4096",
        _AC + "auto_plan",
        "none:0; regions:1; op:2; op_all_mm:3; op_offload:4; full_offload:5; full:6-63",
    ],
}


@dataclass
class ParityRun:
    """What `train_for_parity` read from one run."""

    losses: list[float]
    grad_norms: list[float]
    grads: dict[str, torch.Tensor]  # after step 1, as the optimizer saw them (clipped)
    params: dict[str, torch.Tensor]  # after the last step
    step_metrics: list[dict[str, float]]  # the model's own, per step (an MoE model's balance)


def train_for_parity(argv: list[str], nproc: int, steps: int = 2, plant: str = "none", env=None) -> ParityRun:
    """Train `steps` steps of the trainer with `argv` on `nproc` ranks (see the worker for
    `plant`); returns what the worker read."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "parity.pt"
        args = [str(out), str(steps), plant, *argv, "--job.dump_folder", str(Path(folder) / "dump")]
        proc = launch_ranks(("script", str(WORKER)), args, nproc, env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        record = torch.load(out)
    return ParityRun(
        record["losses"], record["grad_norms"], record["grads"], record["params"], record["step_metrics"]
    )


def reference(argv: list[str], steps: int = 2) -> ParityRun:
    """`argv` in one process without AC: what every layout of it is compared with."""
    return train_for_parity([*argv, *NO_AC], nproc=1, steps=steps)


def relative_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    """‖a - b‖ / ‖b‖ per tensor (the absolute ‖a - b‖ where ‖b‖ is 0); NaN where a is not finite."""
    assert got.keys() == want.keys(), (sorted(got.keys() ^ want.keys()), "tensors in one run only")
    errors = {}
    for name, b in want.items():
        a = got[name]
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if not torch.isfinite(a).all():
            errors[name] = math.nan
            continue
        difference = (a.double() - b.double()).norm().item()
        scale = b.double().norm().item()
        errors[name] = difference / scale if scale else difference
    return errors


def _check(what: str, errors: dict[str, float], rtol: float) -> float:
    bad = {name: e for name, e in errors.items() if math.isnan(e) or e > rtol}
    if bad:
        listed = ", ".join(f"{name} {e:.2e}" for name, e in _worst_first(errors)[:5])
        raise AssertionError(f"{len(bad)} {what} off by more than {rtol:.0e}; the worst: {listed}")
    return max(errors.values(), default=0.0)


def _worst_first(errors: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(errors.items(), key=lambda item: math.inf if math.isnan(item[1]) else item[1], reverse=True)


def assert_parity(
    got: ParityRun, want: ParityRun, rtol: float = FP32_RTOL, param_rtol: float = PARAM_RTOL
) -> float:
    """`got` trains as `want` does: every step-1 gradient within `rtol` (relative, per tensor),
    every final parameter within `param_rtol`, each step's loss within `rtol`.

    Raises:
        AssertionError: naming the five worst tensors with their errors.

    Returns:
        The worst step-1 gradient error, for the record.
    """
    worst_grad = _check("gradients after step 1", relative_errors(got.grads, want.grads), rtol)
    _check("parameters after the last step", relative_errors(got.params, want.params), param_rtol)
    losses = {
        f"loss at step {i + 1}": abs(a - b) / abs(b) for i, (a, b) in enumerate(zip(got.losses, want.losses))
    }
    assert len(got.losses) == len(want.losses)
    _check("losses", losses, rtol)
    return worst_grad
