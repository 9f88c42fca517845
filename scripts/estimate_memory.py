"""Estimate the per-rank peak memory of a training step without allocating it.

Usage:
    python scripts/estimate_memory.py --config NAME_OR_PATH --ngpu N [--all-ac-modes] [--sec.key VALUE ...]
    python scripts/estimate_memory.py --config NAME_OR_PATH --ngpu N --max-seq-len GIB [--all-ac-modes] [...]
    python scripts/estimate_memory.py --config NAME_OR_PATH --ngpu N --plan --budget-gib GIB [--plan-out PATH]
    ./run_memory_estimation.sh --config llama3_8b.toml --ngpu 8 --all-ac-modes

The model is built through its TrainSpec on the meta device in `training.dtype` and parallelized
by the spec's own `parallelize_fn` for a world of `--ngpu` ranks, in this one process (a fake
process group; rank 0 is shown, all ranks hold the same). Then, under FakeTensorMode, it gets
storage and one training step runs as the trainer runs it (forward, the spec's loss in the loss
context, backward, per micro-batch; grad clipping; optimizer step, or with
`optimizer.early_step_in_backward` each parameter's step inside backward) under PyTorch's MemTracker
(FSDPMemTracker when FSDP shards the model). The optimizer state is created beforehand by a
step on zero gradients, so the measured step is a steady-state one. Nothing is allocated and no
weights are initialized.

Output: a Markdown table, in GiB, of what is alive at the moment of the peak, by kind. Under
FSDP "parameters" are this rank's shards (in `training.dtype`) and "gathered parameters" the
unsharded copies, in `training.mixed_precision_param`, that FSDP all-gathers for compute. With
`--all-ac-modes`: one column per activation-checkpointing mode (none, full, selective op,
selective 2). A config mistake prints one message and exits with code 2.

With `--plan --budget-gib GIB` it plans AC mode "auto" instead: per block none, cheap regions,
op-SAC or full AC, and (for a GPU: `activation_checkpoint.auto_offload`) op-SAC or full AC with
offload, the least modelled added time whose peak fits GIB per rank (`plan_to_budget`;
docs/ac_auto.md).

With `--max-seq-len GIB` it searches instead, per AC mode, the longest `training.seq_len` whose
peak fits GIB per rank (`longest_seq_len`). Under context parallelism each rank runs its share of
the sequence and attention's exchange runs on fake tensors.

Under pipeline parallelism each pipeline rank gets a column (a rank's stages differ in what they
hold), each measured in a process of its own, as many at once as there are cores: the rank's
stages take their shapes from an example microbatch instead of from their peers, and torch's
schedule runs its microbatches as in training, so the activations of the microbatches whose
backward is still to come are counted as they fall. Schedules that split backward (zero-bubble,
DualPipeV, CSVs with I/W actions) are refused: MemTracker fails under their `autograd.grad`.

Expert parallelism is estimated with balanced routing by default: every rank sends and receives
an equal share of its routed rows. `--ep-imbalance F` makes the shown rank the busiest one: in
every MoE layer it receives F times its balanced share (1 <= F <= ep; ep means every rank routes
all its rows to it), while it still sends a balanced share. A training run logs F each step as
`moe_ep_imbalance` (the worst layer's busiest EP rank over the mean, counted over all
data-parallel ranks: exact when the EP group spans every data-parallel rank, an approximation
when it spans fewer).

Where the CPU's kernels hold more for backward than a GPU's, the GPU's are modelled: fused
attention for every SDPA and flex call (`gpu_attention_kernels`) and fused RMSNorm
(`gpu_norm_kernel`).

With `activation_checkpoint.offload = "saved"` the offloaded tensors leave the device's peak
(only their copies back, in backward, count), and the table adds the bytes a step sends to the
host and the time that takes each way at `--offload-gbps`.

Not modelled: torch.compile (the step runs eagerly), the caching allocator's rounding,
fragmentation and reserved memory, and CUDA/NCCL context memory; keep some headroom. DDP
(replicas without sharding) is refused: its C++ reducer cannot run on fake tensors.
`measure(cfg, ngpu, fake=False)` runs the same path on real CPU tensors, for validation.
"""

import argparse
import contextlib
import dataclasses
import difflib
import gc
import json
import math
import os
import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

# Import this checkout's torchtitan even when another copy is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from torchtitan.components.ac_auto import DEFAULT_TFLOPS, planned_choices, recompute_rates
from torchtitan.components.loss_head import build_chunked_loss
from torchtitan.components.optimizer import OptimizerInBackward, check_early_step_in_backward
from torchtitan.components.training_step import (
    describe_layout,
    forward_backward,
    gradient_accumulation_steps,
    pipeline_forward_backward,
)
from torchtitan.config import ActivationCheckpoint, ConfigError, JobConfig, parse_args
from torchtitan.config.job_config import model_compile_enabled
from torchtitan.distributed.ac_planner import (
    BlockCost,
    BlockPlan,
    BlockWork,
    RankCosts,
    floor_of,
    plan_of,
    solve,
)  # fmt: skip
from torchtitan.distributed.activation_checkpoint import (
    OFFLOAD_CHOICES,
    fixed_mode,
    format_block_plan,
    in_selective_checkpoint,
    nothing_fits,
)  # fmt: skip
from torchtitan.distributed.activation_offload import ActivationOffloader, HostPool, offloaders_in
from torchtitan.distributed.context_parallel import ContextParallel, sharded_or_whole
from torchtitan.distributed.data_parallel import set_gradient_sync
from torchtitan.distributed.expert_parallel import is_ep_local
from torchtitan.distributed.grad_norm import clip_grad_norm_
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    EMBEDDING,
    Pipeline,
    PipelinePlan,
    describe_pipeline,
    merged_model,
    prune_to_stage,
    splits_backward,
)
from torchtitan.models import attention, get_train_spec
from torchtitan.models.moe import MoE
from torchtitan.preflight import (
    build_meta_model,
    build_parallelized_model,
    build_pipeline_stages,
    fake_world,
    reusing_fake_worlds,
)  # fmt: skip
from torchtitan.protocols.train_spec import import_custom_module
from torchtitan.tools.activation_memory import held_per_block
from torchtitan.tools.op_counter import RecomputeCost

GiB = 2**30

AC_MODES = {
    "none": ActivationCheckpoint(mode="none"),
    "full": ActivationCheckpoint(mode="full"),
    "selective op": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
    "selective 2": ActivationCheckpoint(mode="selective", selective_ac_option="2"),
}

# Report row -> the MemTracker / FSDPMemTracker categories it sums.
ROWS = {
    "parameters": ("Parameter", "Sharded Param"),
    "gathered parameters": ("Unsharded Param",),
    "gradients": ("Gradient", "Sharded Grad", "Unsharded Grad"),
    "optimizer state": ("Optstate", "OptState"),
    "activations": ("Activation",),
    "temporaries": ("Temp",),
    "communication buffers": ("All Gather", "Reduce Scatter"),
    "buffers": ("Buffer",),
    "inputs": ("Inputs", "Other"),
}
TOTAL = "peak total"
# Not part of the peak: the bytes activation offload sends to the host in one step (and back).
OFFLOADED = "offloaded to host per step"
# Not a row: with `probe`, per block the bytes one forward holds for backward and what the step
# runs in it (`probing`).
BLOCKS = "blocks"
# PCIe Gen5 x16's peak per direction; real pinned copies reach somewhat less.
DEFAULT_OFFLOAD_GBPS = 64.0
ALWAYS_SHOWN = ("parameters", "gradients", "optimizer state", "activations")


# ----- command line --------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not > 0")
    return value


def at_least_one(text: str) -> float:
    """argparse type: a number >= 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def parse_cli(argv: list[str]) -> tuple[argparse.Namespace, JobConfig]:
    """The estimator's own options, and the JobConfig from the rest; raises ConfigError."""
    parser = argparse.ArgumentParser(
        description="Estimate per-rank peak training memory (GiB) without allocating it.",
        epilog="Every other option goes to the trainer's config: --config NAME_OR_PATH, --section.key VALUE.",
        allow_abbrev=False,
    )
    parser.add_argument("--ngpu", type=positive_int, required=True, help="number of ranks (GPUs) to simulate")
    parser.add_argument(
        "--all-ac-modes", action="store_true", help="one column per AC mode: " + ", ".join(AC_MODES)
    )
    parser.add_argument(
        "--ep-imbalance",
        type=at_least_one,
        default=1.0,
        metavar="F",
        help="expert parallelism: the shown rank receives F times its balanced share of routed rows "
        "in every MoE layer (default 1, balanced; at most the EP degree). A training run logs it "
        "as moe_ep_imbalance",
    )
    parser.add_argument(
        "--max-seq-len",
        type=positive_float,
        metavar="GIB",
        help="instead of one estimate, search the longest training.seq_len whose peak per rank fits GIB, "
        "per AC mode (under pipeline parallelism, on every pipeline rank)",
    )
    parser.add_argument(
        "--offload-gbps",
        type=positive_float,
        default=DEFAULT_OFFLOAD_GBPS,
        metavar="GBPS",
        help="with activation_checkpoint.offload: host-device bandwidth per direction in GB/s, for the "
        f"copy time of what a step offloads (default {DEFAULT_OFFLOAD_GBPS:g}, PCIe Gen5 x16's peak)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help='instead of one estimate, plan mode "auto": the per-block AC choices with the least added time '
        "whose peak fits --budget-gib (or activation_checkpoint.auto_memory_gib)",
    )
    parser.add_argument(
        "--budget-gib", type=positive_float, metavar="GIB", help="with --plan: the memory per rank"
    )
    parser.add_argument(
        "--tflops",
        type=positive_float,
        metavar="TFLOPS",
        help="with --plan: the math throughput that prices recompute (default: "
        f"activation_checkpoint.auto_tflops, or {DEFAULT_TFLOPS:g}); the other prices are the "
        "activation_checkpoint.auto_* keys",
    )
    parser.add_argument("--plan-out", metavar="PATH", help="with --plan: also write the plan as JSON to PATH")
    args, rest = parser.parse_known_args(argv)
    own = ["--ngpu", "--all-ac-modes", "--ep-imbalance", "--max-seq-len", "--offload-gbps", "--plan",
           "--budget-gib", "--tflops", "--plan-out"]  # fmt: skip
    for arg in rest:
        name = arg.split("=", 1)[0]
        # An option without a section is one of ours misspelled, not a config key.
        if name.startswith("--") and "." not in name and name not in ("--config", "--help"):
            close = difflib.get_close_matches(name, own, n=1)
            if close:
                parser.error(f"unrecognized option {name}; did you mean {close[0]}?")
    return args, parse_args(rest)


def with_ac(cfg: JobConfig, mode: ActivationCheckpoint) -> JobConfig:
    """A copy of `cfg` with the mode and option of `mode` (its other AC keys are kept)."""
    ac = dataclasses.replace(
        cfg.activation_checkpoint, mode=mode.mode, selective_ac_option=mode.selective_ac_option
    )
    return dataclasses.replace(cfg, activation_checkpoint=ac)


def _eager(cfg: JobConfig) -> JobConfig:
    """`cfg` as the estimator runs it: compile off, and so async TP (which needs compile and a
    GPU) off too, estimated as plain TP. Refuses what it cannot run: memory_budget AC, which only
    compile can apply, and CPU offload, which moves memory to a host the estimator has not."""
    if cfg.activation_checkpoint.mode == "memory_budget":
        raise ConfigError(
            "'activation_checkpoint.mode' = 'memory_budget' is decided by torch.compile's partitioner, "
            "which the estimator does not run; estimate another mode (or use --all-ac-modes)."
        )
    if cfg.training.enable_cpu_offload:
        raise ConfigError(
            "'training.enable_cpu_offload' = true keeps the parameter shards, gradients and optimizer "
            "state in host memory, which the estimator does not model; estimate without the key: "
            "with it, a GPU holds about that estimate less its 'parameters', 'gradients' and "
            "'optimizer state' rows."
        )
    parallelism = dataclasses.replace(cfg.parallelism, enable_async_tensor_parallel=False)
    compile_off = dataclasses.replace(cfg.compile, enable=False)
    return dataclasses.replace(cfg, compile=compile_off, parallelism=parallelism)


# ----- building ------------------------------------------------------------------------------


def _refuse_split_backward(cfg: JobConfig) -> None:
    """A schedule that splits backward runs its input-gradient pass with `autograd.grad`, under
    which MemTracker's module hooks fail (pytorch/pytorch#131753)."""
    if splits_backward(cfg):
        p = cfg.parallelism
        what = f"'{p.pipeline_parallel_schedule}'"
        if p.pipeline_parallel_schedule_csv:
            what = f"the CSV '{p.pipeline_parallel_schedule_csv}', whose I and W actions"
        raise ConfigError(
            f"'parallelism.pipeline_parallel_schedule' = {what} splits backward into input- and "
            "weight-gradient passes, which the estimator cannot follow (torch's MemTracker fails under "
            "autograd.grad, pytorch/pytorch#131753). Estimate --parallelism.pipeline_parallel_schedule "
            "Interleaved1F1B (one backward per microbatch; a split backward holds more until its "
            "weight pass), or measure a real run."
        )


def _refuse_ddp(parallel_dims: ParallelDims) -> None:
    """DDP cannot run on fake tensors; say so, and how to estimate it instead."""
    if parallel_dims.ddp_enabled:
        r = parallel_dims.dp_replicate
        raise ConfigError(
            f"'parallelism.data_parallel_replicate_degree' = {r} without sharding is DDP, whose C++ "
            "gradient reducer needs real storage, so it cannot run under FakeTensorMode. A DDP rank "
            "holds what one replica holds plus gradient-sized communication buckets: estimate with "
            f"--parallelism.data_parallel_replicate_degree 1 and --ngpu {parallel_dims.world_size // r}, "
            "then add the gradients once more."
        )


def _refuse_real_expert_parallel(cfg: JobConfig) -> None:
    """A real (`fake=False`) run in one process has no peers to exchange token counts with."""
    if cfg.parallelism.expert_parallel_degree > 1:
        raise ConfigError(
            f"'parallelism.expert_parallel_degree' = {cfg.parallelism.expert_parallel_degree}: a real "
            "one-process measurement cannot run expert parallelism (its all-to-alls need the other "
            "ranks); measure with --parallelism.expert_parallel_degree 1, or estimate (fake=True)."
        )


def _even_split(rows: int, parts: int) -> list[int]:
    return [rows // parts + (part < rows % parts) for part in range(parts)]


def simulated_split_sizes(imbalance: float = 1.0):
    """Split sizes for expert parallelism's dispatch (`apply_expert_parallel`'s `split_sizes`)
    from simulated token counts: this rank sends an equal share of its routed rows to every EP
    rank, and receives `imbalance` times the rows it sends (1: balanced; ep: every rank routes
    all its rows here), an equal number from each source. A real dispatch reads the token counts
    on the host, which fake tensors do not have."""

    def split_sizes(x, counts, counts_recv, ep):
        rows = x.shape[0]
        return _even_split(rows, ep), _even_split(min(round(imbalance * rows), ep * rows), ep)

    return split_sizes


def _refuse_impossible_imbalance(cfg: JobConfig, imbalance: float) -> None:
    """`imbalance` must lie in [1, ep], and means nothing without expert parallelism or with
    forced balanced routing."""
    ep = cfg.parallelism.expert_parallel_degree
    if imbalance != 1.0 and ep <= 1:
        raise ConfigError(
            f"--ep-imbalance {imbalance:g} needs expert parallelism, but "
            f"'parallelism.expert_parallel_degree' = {ep}; without it every rank runs its own rows "
            "through all experts. Drop --ep-imbalance, or set --parallelism.expert_parallel_degree."
        )
    if imbalance != 1.0 and cfg.model.moe_force_load_balance:
        raise ConfigError(
            f"--ep-imbalance {imbalance:g} contradicts 'model.moe_force_load_balance' = true, which "
            "gives every EP rank its balanced share. Drop --ep-imbalance."
        )
    if imbalance > ep:
        raise ConfigError(
            f"--ep-imbalance {imbalance:g} exceeds 'parallelism.expert_parallel_degree' = {ep}: a rank "
            f"receives at most every EP rank's rows, {ep} times its balanced share. Use a value in [1, {ep}]."
        )


@contextlib.contextmanager
def no_warning_for_fake_collective_views():
    """Silence FSDP2's warning that a wrapped module (the FSDP-sharded experts under expert
    parallelism) returned a view: with fake tensors and the fake process group the all-to-all's
    output is a view, where a real one's is not (a gloo run of that layout does not warn)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        yield


@contextlib.contextmanager
def gpu_attention_kernels():
    """Attention holds for backward what a GPU's fused kernels hold, not what the CPU's would.

    - SDPA calls whose values have another head dim than the queries (DeepSeek's MLA: 192 vs
      128) run on values zero-padded to the queries' head dim, and the padding is sliced off.
      The CPU has no fused kernel for unequal head dims and would run SDPA's math kernel, whose
      batch x heads x seq x seq scores and their gradients the estimate would then count; a GPU
      runs a fused kernel that holds none (memory-efficient attention). Padded, the CPU's fused
      kernel holds what that one does, plus the padded output.
    - flex attention (`model.attn_backend = "flex"`) runs on the CPU as SDPA with a dense boolean
      mask, which would hold a float seq x seq copy of the mask per layer and the mask itself; a
      GPU runs flex's kernel, which holds its output and logsumexp, under a BlockMask of a few KB.
      So the mask is built as one element and the call runs the CPU's fused causal kernel, which
      holds what flex's does: which positions a mask allows changes no tensor's size. Under
      context parallelism the masks read at a rank's positions stay one element too.
    """
    sdpa, create_mask = F.scaled_dot_product_attention, attention.create_mask

    def fused(q, k, v, attn_mask=None, *args, **kwargs):
        if attn_mask is not None:
            kwargs["is_causal"] = True
        if v.shape[-1] == q.shape[-1]:
            return sdpa(q, k, v, None, *args, **kwargs)
        out = sdpa(q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1])), None, *args, **kwargs)
        return out[..., : v.shape[-1]]

    def one_element_mask(mask_mod, batch, heads, q_len, kv_len, device=None):
        return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)

    def read_one_element(masks, rows, cols, step):
        mask = one_element_mask(None, 1, 1, 1, 1, device=rows.device)
        return attention.AttentionMasks(masks.mask_type, masks.mask_mod, len(rows), dense_mask=mask,
                                        context_parallel=step)  # fmt: skip

    F.scaled_dot_product_attention, attention.create_mask = fused, one_element_mask
    read_at, attention._read_at = attention._read_at, read_one_element
    attention.clear_mask_cache()  # neither real masks in here nor these masks out of here
    try:
        yield
    finally:
        F.scaled_dot_product_attention, attention.create_mask = sdpa, create_mask
        attention._read_at = read_at
        attention.clear_mask_cache()


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm holding for backward what a GPU's fused kernel (`aten._fused_rms_norm`, which
    `F.rms_norm` calls on CUDA) holds: its input, the per-row rstd in fp32 and the weight. On the
    CPU the same call decomposes, and autograd also holds the input upcast to fp32 and the fp32
    normalized product: 8 more bytes per element per norm."""

    @staticmethod
    def forward(ctx, x, weight, dims, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)
        normed = x.float() * rstd
        out = (normed * weight.float() if weight is not None else normed).to(x.dtype)
        ctx.dims = dims
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad.float() * weight.float() if weight is not None else grad.float()
        grad_x = rstd * (g - normed * (g * normed).mean(ctx.dims, keepdim=True))
        grad_w = None
        if weight is not None and ctx.needs_input_grad[1]:
            leading = tuple(range(grad.dim() - len(ctx.dims)))
            grad_w = (grad.float() * normed).sum(leading).to(weight.dtype)
        return grad_x.to(x.dtype), grad_w, None, None


@contextlib.contextmanager
def gpu_norm_kernel():
    """`F.rms_norm` (every RMSNorm of the models) holds for backward what the GPU's fused kernel
    holds (see `_FusedRMSNorm`). Where the weight's dtype differs from the input's (a bf16
    activation under autocast meeting an fp32 weight), the GPU falls back to the decomposed
    form, and so does this."""
    rms_norm = F.rms_norm

    def fused(input, normalized_shape, weight=None, eps=None):
        if weight is not None and weight.dtype != input.dtype:
            return rms_norm(input, normalized_shape, weight, eps)
        eps = torch.finfo(input.dtype).eps if eps is None else eps
        return _FusedRMSNorm.apply(input, weight, tuple(range(-len(normalized_shape), 0)), eps)

    F.rms_norm = fused
    try:
        yield
    finally:
        F.rms_norm = rms_norm


def _refuse_fp32_moe(cfg: JobConfig, model: torch.nn.Module) -> None:
    """MoE experts need bf16 compute under FakeTensorMode: the grouped matmul's shape function
    accepts bf16 only, and the per-expert loop that serves other dtypes reads the token counts."""
    has_moe = any(isinstance(m, MoE) for m in model.modules())
    if has_moe and cfg.training.mixed_precision_param != "bfloat16":
        raise ConfigError(
            f"'training.mixed_precision_param' = '{cfg.training.mixed_precision_param}': the estimator "
            "can only run MoE experts in bfloat16; pass --training.mixed_precision_param bfloat16."
        )


def parallel_dims_for(cfg: JobConfig, ngpu: int) -> ParallelDims:
    """ParallelDims of `[parallelism]` for `ngpu` ranks; raises ConfigError if they do not fit."""
    return ParallelDims.from_config(cfg.parallelism, ngpu)


def build_model(
    cfg: JobConfig, parallel_dims: ParallelDims, device: torch.device, compiled_run: bool = False,
    ep_imbalance: float | None = None,
) -> torch.nn.Module:  # fmt: skip
    """The spec's model on the meta device, parallelized as the trainer builds it
    (`torchtitan.preflight.build_parallelized_model`), with AC wrapped as the run does, compiled
    or not (the wrapping can depend on compile: op-SAC with flex attention checkpoints attention
    and feed-forward as separate regions only when compile is off, which holds the norms'
    tensors between them; estimated uncompiled, the Llama 3 8B preset with block_causal masks
    held 13.5 GiB more than its compiled run does), and expert parallelism's split sizes
    simulated (`simulated_split_sizes`; None: read from the token counts, as a real run does).
    No storage yet: `to_empty` under FakeTensorMode gives it
    fake storage. (Built outside FakeTensorMode: fake parameters are weakly referenced by the
    fake-tensor cache, and `to_empty` cannot swap those.)"""
    return build_parallelized_model(
        cfg, parallel_dims, device, wrap_as_compiled=compiled_run,
        expert_split_sizes=None if ep_imbalance is None else simulated_split_sizes(ep_imbalance),
    )  # fmt: skip


def _batch(cfg: JobConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    vocab_size = get_train_spec(cfg.model.name).get_flavor(cfg.model.flavor).vocab_size
    shape = (cfg.training.local_batch_size, cfg.training.seq_len)
    return (
        torch.randint(0, vocab_size, shape, device=device),
        torch.randint(0, vocab_size, shape, device=device),
    )


def _prime_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer state, as a first step would, with a step on zero gradients."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ----- tracking ------------------------------------------------------------------------------


class _Pausable:
    """Tracker mixin: while `paused`, ops run untracked. A root module may also run several
    forwards before their backwards (a pipeline stage, once per microbatch), which MemTracker
    would take for a second step and refuse: each counts as a first forward."""

    paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state) -> None:
        # Only the rank's peak is reported: skip MemTracker's per-module peaks, a pass over every
        # module at every op (half the time of a 405B stage's step).
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)

    def _pre_fw_hook(self, module, inputs):
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


class _MemTracker(_Pausable, MemTracker):
    pass


class _FSDPMemTracker(_Pausable, FSDPMemTracker):
    pass


@contextlib.contextmanager
def tracking(tracker: _Pausable):
    """Enter `tracker`, with DTensor's shape propagation and activation offload's host side left
    untracked.

    DTensor derives an op's output shape by running the op on global-shape fake tensors in the
    active fake mode. MemTracker skips those only when that mode differs from its own; under our
    FakeTensorMode it is the same one, so without this they would count as allocations (grad
    clipping alone would "hold" an unsharded fp32 copy of every gradient).

    Offload's host buffers are the host's memory, not the device's. Fake tensors' buffers hold
    nothing anyway; on real CPU tensors (`measure(fake=False)`) they would count as the
    device's, though on a GPU they would not.
    """
    untracked = [
        (ShardingPropagator, "_propagate_tensor_meta_non_cached"),
        (HostPool, "take"),
        (ActivationOffloader, "_to_host"),
    ]
    originals = [getattr(owner, name) for owner, name in untracked]

    def paused(method):
        def run(*args, **kwargs):
            tracker.paused += 1
            try:
                return method(*args, **kwargs)
            finally:
                tracker.paused -= 1

        return run

    for (owner, name), method in zip(untracked, originals):
        setattr(owner, name, paused(method))
    try:
        with tracker:
            yield tracker
    finally:
        for (owner, name), method in zip(untracked, originals):
            setattr(owner, name, method)


def make_tracker(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> MemTracker:
    """FSDPMemTracker for an FSDP model (shards, gathered copies, comm buffers), else MemTracker.

    `model` may also be a plain module over FSDP roots (a rank's pipeline stages): the tracker
    instruments every FSDP module under its root, which it requires to be one itself."""
    fsdp_roots = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if fsdp_roots:
        tracker = _FSDPMemTracker(fsdp_roots[0], optimizer)
        tracker._root_mod = model
        tracker.track_inputs(batch)
        _track_experts_outside_fsdp(tracker, model)
    else:
        tracker = _MemTracker()
        tracker.track_external(model, optimizer, *batch)
    return tracker


def _track_experts_outside_fsdp(tracker: _FSDPMemTracker, model: torch.nn.Module) -> None:
    """Count the expert-parallel weights FSDP leaves alone (no other rank holds the same experts)
    as this rank's parameter shards, and their gradients as gradient shards.

    FSDPMemTracker knows only FSDP's parameters; it would file these under optimizer state, the
    first time the optimizer step touches them.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            continue
        for param in module.parameters(recurse=False):
            if is_ep_local(param):
                tracker._update_and_maybe_create_winfos(param, _FSDPRefType.SHARDED_PARAM)
                param.register_hook(partial(_track_gradient, tracker))


def _track_gradient(tracker: _FSDPMemTracker, grad: torch.Tensor) -> None:
    tracker._update_and_maybe_create_winfos(grad, _FSDPRefType.SHARDED_GRAD)


# ----- one step ------------------------------------------------------------------------------


def context_parallel_of(cfg: JobConfig, parallel_dims: ParallelDims) -> ContextParallel | None:
    """The run's `ContextParallel` (None without CP), as the trainer builds it."""
    model_args = get_train_spec(cfg.model.name).get_flavor(cfg.model.flavor).update_from_config(cfg)
    return ContextParallel.from_config(cfg, parallel_dims, model_args)


def train_step(
    cfg, parallel_dims, model, optimizer, loss_fn, extra_loss_fn, batch, tracker: MemTracker
) -> None:
    """One trainer step: micro-batches (forward, loss, backward in the loss context), clip, step.

    Only the first two micro-batches run: from the second on, each holds the same (the
    gradients accumulated so far plus its own activations).
    """
    accum_steps = gradient_accumulation_steps(cfg, parallel_dims.dp_degree)
    context_parallel = context_parallel_of(cfg, parallel_dims)
    optimizer.zero_grad(set_to_none=True)
    inputs, labels = batch
    for micro_batch in range(min(accum_steps, 2)):
        if micro_batch:
            tracker.reset_mod_stats()  # MemTracker refuses a second forward of the root otherwise
        forward_backward(
            model, loss_fn, inputs, labels, accum_steps, parallel_dims, cfg, extra_loss_fn=extra_loss_fn,
            context_parallel=context_parallel,
        )  # fmt: skip
    if isinstance(optimizer, OptimizerInBackward):
        return  # each parameter stepped, and its gradient was freed, during backward
    clip_grad_norm_(model.parameters(), cfg.training.max_norm)
    optimizer.step()


def tracked_step(
    cfg: JobConfig,
    model,
    parallel_dims: ParallelDims,
    device: torch.device,
    prepare: Callable[[torch.nn.Module], None] | None = None,
    probe: bool = False,
) -> dict:
    """Give `model` storage, build its optimizer, run one tracked step; the peak snapshot.

    `prepare(model)` runs once the model has storage, before the optimizer exists: a real
    (not fake) run's weight init, for example. `probe`: also measure each block (`probing`).
    """
    spec = get_train_spec(cfg.model.name)
    model.to_empty(device=device).train()
    if prepare is not None:
        prepare(model)
    optimizer = spec.build_optimizer_fn(model, cfg, device)
    _prime_optimizer(model, optimizer)
    batch = _batch(cfg, device)
    tracker = make_tracker(model, optimizer, batch)
    with tracking(tracker), probing(model, cfg, parallel_dims, probe) as blocks:
        loss_fn = build_chunked_loss(cfg, spec.build_loss_fn, parallel_dims)
        train_step(cfg, parallel_dims, model, optimizer, loss_fn, spec.extra_loss_fn, batch, tracker)
    snapshot = tracker.get_tracker_snapshot("peak").get(device, {})
    return _with_offloaded(snapshot, model, cfg, parallel_dims) | ({BLOCKS: blocks} if probe else {})


def _with_offloaded(snapshot: dict, model, cfg: JobConfig, parallel_dims: ParallelDims) -> dict:
    """`snapshot` and the bytes activation offload sends to the host in a whole step: what the
    measured micro-batches (at most 2) sent, scaled to the step's micro-batches."""
    accum_steps = gradient_accumulation_steps(cfg, parallel_dims.dp_degree)
    sent = sum(offloader.bytes_total for offloader in offloaders_in(model))
    return {**snapshot, OFFLOADED: sent * accum_steps // min(accum_steps, 2)}


@contextlib.contextmanager
def probing(model: torch.nn.Module, cfg: JobConfig, parallel_dims: ParallelDims, enabled: bool):
    """With `enabled`, measure every block of `model.layers` over the step: yields a dict, filled
    on exit, block index (a string, as JSON keys are) -> {"held": the bytes one forward holds for
    backward (`held_per_block`), "offloaded": the bytes one forward offloads
    (`ActivationOffloader.bytes_by_block`), "work": what the step runs in the block
    (`RecomputeCost.work_per_block`: FLOPs, element-wise bytes, host ops, region reruns,
    recomputed FLOPs, then the bytes offloaded), the counts scaled from the measured micro-batches
    to all of the step's}. What the mode "auto" planner needs (`BlockCost`, `BlockWork`)."""
    if not enabled:
        yield None
        return
    blocks = {int(name): block for name, block in model.layers.named_children()}
    measured: dict[str, dict] = {}
    with held_per_block(blocks) as held, RecomputeCost(blocks, in_selective_checkpoint) as recompute:
        yield measured
    accum_steps = gradient_accumulation_steps(cfg, parallel_dims.dp_degree)
    offloaders = offloaders_in(model)
    for index, work in recompute.work_per_block().items():
        per_forward = sum(offloader.bytes_by_block.get(index, 0) for offloader in offloaders)
        offloaded = sum(offloader.bytes_total_by_block.get(index, 0) for offloader in offloaders)
        per_step = [n * accum_steps // min(accum_steps, 2) for n in (*work, offloaded)]
        measured[str(index)] = {"held": held.get(index, 0), "offloaded": per_forward, "work": per_step}


def breakdown(snapshot: dict) -> dict[str, int]:
    """Bytes per report row, plus TOTAL, from one device's MemTracker snapshot."""
    by_name = {getattr(kind, "value", kind): n for kind, n in snapshot.items()}
    rows = {row: sum(by_name.get(name, 0) for name in names) for row, names in ROWS.items()}
    rows[TOTAL] = by_name.get("Total", 0)
    rows[OFFLOADED] = snapshot.get(OFFLOADED, 0)
    if BLOCKS in snapshot:
        rows[BLOCKS] = snapshot[BLOCKS]
    return rows


def measure(
    cfg: JobConfig, ngpu: int, fake: bool = True, ep_imbalance: float = 1.0, pp_rank: int = 0,
    probe: bool = False,
) -> dict[str, int]:  # fmt: skip
    """Peak bytes on one rank of `ngpu` during one steady-state training step, by report row:
    rank 0, or under pipeline parallelism the first rank of pipeline rank `pp_rank`.

    `fake=False` runs the same path on real CPU tensors (with the GPU's RMSNorm kernel, which
    computes what the CPU's does), allocating one rank's memory; under pipeline parallelism the
    tensors it receives from other stages are uninitialized. Needs a process without a process
    group. `ep_imbalance`: under expert parallelism, the rank receives this many times its
    balanced share of routed rows (see `simulated_split_sizes`).
    `probe`: add `BLOCKS`, each block's measurements (`probing`).
    Raises ConfigError for a layout the config cannot have.
    """
    compiled_run = model_compile_enabled(cfg)
    cfg = _eager(cfg)
    _refuse_impossible_imbalance(cfg, ep_imbalance)
    _refuse_split_backward(cfg)
    device = torch.device("cpu")
    gc.collect()
    rank = pp_rank * (ngpu // cfg.parallelism.pipeline_parallel_degree)
    with fake_world(ngpu, rank):
        parallel_dims = parallel_dims_for(cfg, ngpu)
        # Refuse a bad batch, or steps in backward that cannot be, before building.
        accum_steps = gradient_accumulation_steps(cfg, parallel_dims.dp_degree)
        check_early_step_in_backward(cfg, parallel_dims, accum_steps)
        if fake:
            _refuse_ddp(parallel_dims)
        else:
            _refuse_real_expert_parallel(cfg)
        parallel_dims.build_mesh(device.type)
        options = dict(
            wrap_as_compiled=compiled_run,
            expert_split_sizes=simulated_split_sizes(ep_imbalance) if fake else None,
        )
        if parallel_dims.pp_enabled:
            plan, stages = build_pipeline_stages(cfg, parallel_dims, device, **options)
            embedding = build_embedding(cfg, parallel_dims, device, **options)
            model = merged_model(stages)
        else:
            model = build_model(cfg, parallel_dims, device, compiled_run, ep_imbalance if fake else None)
        if fake:
            _refuse_fp32_moe(cfg, model)
        with (
            FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(),
            gpu_attention_kernels() if fake else contextlib.nullcontext(),
            gpu_norm_kernel(),
            no_warning_for_fake_collective_views() if fake else contextlib.nullcontext(),
        ):
            if parallel_dims.pp_enabled:
                return breakdown(
                    tracked_pipeline_step(cfg, plan, stages, parallel_dims, device, embedding, probe=probe)
                )
            return breakdown(tracked_step(cfg, model, parallel_dims, device, probe=probe))


def estimate(
    cfg: JobConfig, ngpu: int, modes: Iterable[str] | None = None, ep_imbalance: float = 1.0
) -> dict[str, dict[str, int]]:
    """Fake-mode `measure` per AC mode named in `modes` (default: the config's own mode).

    Under pipeline parallelism, per AC mode and pipeline rank, keyed "MODE, pp RANK"; each rank
    is measured in a process of its own (`measure_in_subprocess`), as many at once as there
    are CPU cores."""
    configs = {mode_label(cfg.activation_checkpoint): cfg} if modes is None else {
        name: with_ac(cfg, AC_MODES[name]) for name in modes
    }  # fmt: skip
    return estimate_configs(configs, ngpu, ep_imbalance)


def estimate_configs(
    configs: dict[str, JobConfig], ngpu: int, ep_imbalance: float = 1.0, probe: bool = False
) -> dict[str, dict[str, int]]:  # fmt: skip
    """`estimate` of each named config (they share one layout), keyed by name, or under pipeline
    parallelism by "NAME, pp RANK"."""
    cfg = next(iter(configs.values()))
    pp = cfg.parallelism.pipeline_parallel_degree
    _refuse_split_backward(cfg)  # here, not once per rank's process
    if pp == 1:
        return {name: measure(c, ngpu, ep_imbalance=ep_imbalance, probe=probe) for name, c in configs.items()}
    jobs = {
        f"{name}, pp {r}": (c, ngpu, True, ep_imbalance, r, probe)
        for name, c in configs.items()
        for r in range(pp)
    }
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = dict(zip(jobs, pool.map(lambda job: measure_in_subprocess(*job), jobs.values())))
    return results


_CHILD = """
import json, pickle, runpy, sys
estimator = runpy.run_path(sys.argv[1])
try:
    print(json.dumps(estimator["measure"](*pickle.load(sys.stdin.buffer))))
except estimator["ConfigError"] as e:
    print(json.dumps({"error": str(e)}))
"""


def measure_in_subprocess(*args) -> dict[str, int]:
    """`measure(*args)` in a new Python process.

    Why: DTensor caches its sharding decisions by device mesh, and meshes of two fake worlds
    compare equal though each holds its own world's process groups; measured after another
    rank in the same process, a rank would run collectives on groups of the earlier world.
    Raises ConfigError as `measure` does.
    """
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, __file__], input=pickle.dumps(args), capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"estimating pipeline rank {args[4]} failed:\n{done.stderr.decode()[-3000:]}")
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    if "error" in result:
        raise ConfigError(result["error"])
    return result


# ----- pipeline parallelism ------------------------------------------------------------------


def build_embedding(cfg: JobConfig, parallel_dims: ParallelDims, device: torch.device, **options):
    """The model's embedding alone, parallelized as the run's first stage holds it: its output
    is what every stage sends the next (the blocks keep its shape, dtype and layout)."""
    _, model = build_meta_model(cfg, parallel_dims, device)
    part = prune_to_stage(model, EMBEDDING)
    return get_train_spec(cfg.model.name).parallelize_fn(part, parallel_dims, cfg, device, **options)


def stage_io(cfg: JobConfig, plan, embedding: torch.nn.Module, tokens: torch.Tensor, device) -> list[tuple]:
    """Per stage of this rank, an example (input, output) of one microbatch: what the real run's
    stages learn from their peers at the first step, which a simulated rank has none of."""
    embedding.to_empty(device=device)
    microbatch = tokens[: cfg.parallelism.pipeline_parallel_microbatch_size]
    with torch.no_grad():
        hidden = embedding(microbatch).detach().requires_grad_()
    return [(microbatch if stage_id == 0 else hidden, hidden) for stage_id in plan.stage_ids]


def tracked_pipeline_step(
    cfg: JobConfig, plan, stages, parallel_dims: ParallelDims, device, embedding=None, prepare=None,
    probe=False,
) -> dict:  # fmt: skip
    """`tracked_step` for this rank's pipeline stages: the schedule runs its microbatches as the
    trainer runs them, so what it keeps in flight (the activations of the microbatches whose
    backward is still to come, and the buffers it receives into) is counted as it falls.

    `embedding` (`build_embedding`) gives the stages their shapes, for a rank without peers;
    None: they exchange them with their peers at the first step, as in a real run. `prepare`
    runs on each stage once it has storage, as in `tracked_step`.
    """
    spec = get_train_spec(cfg.model.name)
    for stage in stages:
        stage.to_empty(device=device).train()
        if prepare is not None:
            prepare(stage)
    model = merged_model(stages)
    optimizer = spec.build_optimizer_fn(model, cfg, device)
    _prime_optimizer(model, optimizer)
    batch = _batch(cfg, device)
    accum_steps = gradient_accumulation_steps(cfg, parallel_dims.dp_degree)
    loss_fn = build_chunked_loss(cfg, spec.build_loss_fn, parallel_dims)
    context_parallel = context_parallel_of(cfg, parallel_dims)
    # Under CP a stage's microbatch is this rank's share of each sequence.
    with sharded_or_whole(context_parallel, *batch) as (first_inputs, _):
        io = None if embedding is None else stage_io(cfg, plan, embedding, first_inputs, device)
    pipeline = Pipeline(
        plan, stages, loss_fn, parallel_dims.submesh("pp").get_group(), device,
        plan.n_microbatches * accum_steps, cfg.parallelism.pipeline_parallel_schedule_csv,
        stage_io=io, context_parallel=context_parallel,
    )  # fmt: skip
    tracker = make_tracker(model, optimizer, batch)
    with tracking(tracker), probing(model, cfg, parallel_dims, probe) as blocks:
        optimizer.zero_grad(set_to_none=True)
        # From the second micro-batch on, each holds the same (see `train_step`).
        for micro_batch in range(min(accum_steps, 2)):
            for part in stages:
                set_gradient_sync(part, parallel_dims, sync=micro_batch == accum_steps - 1)
            pipeline_forward_backward(pipeline, *batch, parallel_dims, cfg)
        clip_grad_norm_(model.parameters(), cfg.training.max_norm, pipeline.pp_group)
        optimizer.step()
    snapshot = tracker.get_tracker_snapshot("peak").get(device, {})
    return _with_offloaded(snapshot, model, cfg, parallel_dims) | ({BLOCKS: blocks} if probe else {})


# ----- the longest sequence -------------------------------------------------------------------

# The longest seq_len searched: 4M tokens.
SEQ_LEN_CAP = 2**22


def seq_len_step(cfg: JobConfig) -> int:
    """The seq_len granule of the search: 1024 tokens, or a multiple of it that every layout
    rule divides (context parallelism's 2 x cp chunks, sequence parallelism's tp shards)."""
    p = cfg.parallelism
    return math.lcm(1024, 2 * p.context_parallel_degree, p.tensor_parallel_degree)


def peak_at(cfg: JobConfig, ngpu: int, seq_len: int, mode: str | None, ep_imbalance: float) -> int | None:
    """The largest peak total over the estimate's columns with `training.seq_len` = `seq_len`
    and AC `mode` (None: the config's); None for a seq_len the config refuses."""
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, seq_len=seq_len))
    try:
        results = estimate(cfg, ngpu, None if mode is None else [mode], ep_imbalance)
    except ConfigError:
        return None
    return max(rows[TOTAL] for rows in results.values())


def longest_seq_len(
    cfg: JobConfig, ngpu: int, budget: int, mode: str | None = None, ep_imbalance: float = 1.0
) -> tuple[int, int]:  # fmt: skip
    """The longest seq_len (a multiple of `seq_len_step`, at most `SEQ_LEN_CAP`) whose peak fits
    `budget` bytes, and that peak: doubling until a length does not fit, then bisecting.

    Raises:
        ConfigError: when not even one step's worth of tokens fits, or the config refuses it.
    """
    step = seq_len_step(cfg)
    first = peak_at(cfg, ngpu, step, mode, ep_imbalance)
    if first is None or first > budget:
        measured = "is refused" if first is None else f"needs {first / GiB:.2f} GiB"
        raise ConfigError(
            f"--max-seq-len {budget / GiB:g}: the shortest sequence searched, {step} tokens, {measured}; "
            "give more memory, or a layout that holds less per rank."
        )
    fits, fitting_peak, units = 1, first, 2
    while units * step <= SEQ_LEN_CAP:
        peak = peak_at(cfg, ngpu, units * step, mode, ep_imbalance)
        if peak is None or peak > budget:
            break
        fits, fitting_peak, units = units, peak, units * 2
    too_long = units
    while too_long - fits > 1:
        middle = (fits + too_long) // 2
        peak = peak_at(cfg, ngpu, middle * step, mode, ep_imbalance)
        if peak is not None and peak <= budget:
            fits, fitting_peak = middle, peak
        else:
            too_long = middle
    return min(fits * step, SEQ_LEN_CAP), fitting_peak


def longest_seq_len_table(
    cfg: JobConfig, ngpu: int, gib: float, modes: list[str] | None, ep_imbalance: float
) -> str:  # fmt: skip
    """A title and a Markdown table: per AC mode (`modes`, or the config's), the longest seq_len
    whose peak fits `gib` GiB per rank, and that peak."""
    budget = round(gib * GiB)
    lines = [f"| AC mode | longest seq_len within {gib:g} GiB | peak GiB |", "|---|---|---|"]
    for mode in modes or [None]:
        seq_len, peak = longest_seq_len(cfg, ngpu, budget, mode, ep_imbalance)
        lines.append(f"| {mode or mode_label(cfg.activation_checkpoint)} | {seq_len} | {peak / GiB:.3f} |")
    layout = describe_layout(cfg, parallel_dims_for(cfg, ngpu))
    title = f"{cfg.model.name} {cfg.model.flavor}, local batch {cfg.training.local_batch_size}, on {layout}"
    return f"Longest sequence per AC mode: {title}\n\n" + "\n".join(lines)


# ----- mode "auto": the per-block plan --------------------------------------------------------

# How many times a plan is measured and re-solved with a tighter target before giving up.
PLAN_ROUNDS = 4


def _pp_labels(cfg: JobConfig) -> list[str]:
    pp = cfg.parallelism.pipeline_parallel_degree
    return [""] if pp == 1 else [f"pp {r}" for r in range(pp)]


def _column(name: str, label: str) -> str:
    return f"{name}, {label}" if label else name


def rank_costs(
    cfg: JobConfig, ngpu: int, ep_imbalance: float = 1.0, budget: int | None = None
) -> list[RankCosts]:  # fmt: skip
    """The planner's measurements (`RankCosts`), one per pipeline rank (one without pipelining),
    from probed fake-mode steps (`probing`) with every block at each of the layout's choices
    (`planned_choices`), full AC first. Their work is priced at the config's `auto_*` rates
    (`recompute_rates`).

    With a `budget` that full AC fits on every rank, full AC with offload is left out: it costs
    full AC's recompute and more, and pays only where full AC cannot reach the budget. That
    spares one estimate (about 20 s for Llama 3 70B on 64 ranks).

    Raises:
        NothingFits: with a `budget` that full AC's peak, and full AC with offload's where
            measured, exceed on some rank (checked before the other choices are measured).
    """
    ac = cfg.activation_checkpoint
    choices = planned_choices(cfg)
    configs = {c: dataclasses.replace(cfg, activation_checkpoint=fixed_mode(ac, c)) for c in choices}
    probed = estimate_configs({"full": configs["full"]}, ngpu, ep_imbalance, probe=True)
    full_fits = budget is not None and all(
        probed[_column("full", r)][TOTAL] <= budget for r in _pp_labels(cfg)
    )
    if full_fits:
        choices = tuple(c for c in choices if c != "full_offload")
    elif "full_offload" in choices:
        probed |= estimate_configs({"full_offload": configs["full_offload"]}, ngpu, ep_imbalance, probe=True)
    least = [c for c in ("full", "full_offload") if c in choices]
    for label in _pp_labels(cfg):
        floor = floor_of({c: probed[_column(c, label)][TOTAL] for c in least})
        needed = probed[_column(floor, label)][TOTAL]
        if budget is not None and needed > budget:
            raise nothing_fits(budget, needed, label, offload=floor in OFFLOAD_CHOICES)
    others = {c: configs[c] for c in choices if c not in least}
    probed |= estimate_configs(others, ngpu, ep_imbalance, probe=True)
    rates = recompute_rates(ac)
    costs = []
    for label in _pp_labels(cfg):
        runs = {choice: probed[_column(choice, label)] for choice in choices}
        blocks = tuple(
            BlockCost(
                int(index),
                held={c: runs[c][BLOCKS][index]["held"] for c in choices},
                work={c: BlockWork(*runs[c][BLOCKS][index]["work"]) for c in choices},
                offloaded={c: runs[c][BLOCKS][index]["offloaded"] for c in choices},
            )
            for index in sorted(runs["none"][BLOCKS], key=int)
        )
        peaks = {c: runs[c][TOTAL] for c in choices}
        costs.append(RankCosts(label, peaks, blocks, rates))
    return costs


def with_block_plan(cfg: JobConfig, choices: dict[int, str]) -> JobConfig:
    """A copy of `cfg` running mode "auto" with `choices` as its plan."""
    ac = dataclasses.replace(cfg.activation_checkpoint, mode="auto", auto_plan=format_block_plan(choices))
    return dataclasses.replace(cfg, activation_checkpoint=ac)


def plan_to_budget(
    cfg: JobConfig, ngpu: int, budget: int, ep_imbalance: float = 1.0, costs: list[RankCosts] | None = None
) -> BlockPlan:  # fmt: skip
    """The mode "auto" plan for `cfg` on `ngpu` ranks within `budget` bytes per rank; `costs`:
    `rank_costs`'s measurements, when already made for this config (they do not depend on the
    budget).

    Each pipeline rank's blocks are solved against its own measured peaks (`solve`). The plan
    is then measured as a whole; where a rank's measured peak exceeds the budget (the solver's
    model is linear, the step's peak is not), that rank is solved again with its target lowered
    by the excess, at most `PLAN_ROUNDS` times. A rank whose target falls below its full-AC
    peak, though full AC fits the budget, takes full AC on every block.

    Raises:
        NothingFits: when full AC on every block of some rank does not fit, or no round fits.
    """
    costs = costs or rank_costs(cfg, ngpu, ep_imbalance, budget)
    targets = {c.label: budget for c in costs}
    for _ in range(PLAN_ROUNDS):
        choices = {}
        for c in costs:
            if targets[c.label] < c.peak[c.floor] <= budget:
                choices |= {block.index: c.floor for block in c.blocks}
            else:
                choices |= solve(c, targets[c.label])
        results = estimate_configs({"auto": with_block_plan(cfg, choices)}, ngpu, ep_imbalance)
        measured = {label: results[_column("auto", label)][TOTAL] for label in targets}
        over = {label: peak - budget for label, peak in measured.items() if peak > budget}
        if not over:
            break
        for label, excess in over.items():
            targets[label] -= excess
    else:
        worst = max(over, key=over.get)
        raise nothing_fits(budget, measured[worst], worst, measured=True)
    return plan_of(costs, choices, budget, measured)


def plan_command(cfg: JobConfig, args: argparse.Namespace) -> str:
    """`--plan`: the plan's report; with `--plan-out`, the plan also goes there as JSON."""
    gib = args.budget_gib or cfg.activation_checkpoint.auto_memory_gib
    if not gib:
        raise ConfigError(
            "--plan needs the memory per rank: give --budget-gib GIB (or "
            "activation_checkpoint.auto_memory_gib)."
        )
    if args.tflops:
        ac = dataclasses.replace(cfg.activation_checkpoint, auto_tflops=args.tflops)
        cfg = dataclasses.replace(cfg, activation_checkpoint=ac)
    plan = plan_to_budget(cfg, args.ngpu, round(gib * GiB), args.ep_imbalance)
    if args.plan_out:
        Path(args.plan_out).write_text(plan.to_json())
    return plan_report(cfg, args.ngpu, plan, args.ep_imbalance)


def plan_report(cfg: JobConfig, ngpu: int, plan: BlockPlan, ep_imbalance: float = 1.0) -> str:
    """The title, the plan's `auto_plan` string and its table."""
    return (
        f"Activation checkpointing plan (mode auto) within {plan.budget / GiB:g} GiB per rank: "
        f'{describe(cfg, ngpu, ep_imbalance)}\n\nauto_plan = "{plan.spec}"\n\n{plan.table()}'
    )


# ----- output --------------------------------------------------------------------------------


def mode_label(ac: ActivationCheckpoint) -> str:
    """'none', 'full', 'selective op', 'selective 2', ..."""
    return f"{ac.mode} {ac.selective_ac_option}" if ac.mode == "selective" else ac.mode


def format_table(results: dict[str, dict[str, int]], offload_gbps: float = DEFAULT_OFFLOAD_GBPS) -> str:
    """Markdown table in GiB: a row per kind of memory (minor kinds left out when zero), a column
    per mode; with activation offload, what a step sends to the host and the copy time that
    takes each way at `offload_gbps` GB/s (hidden when it overlaps compute)."""
    lines = ["| GiB per rank | " + " | ".join(results) + " |", "|---" * (len(results) + 1) + "|"]
    for row in [*ROWS, TOTAL]:
        values = [results[mode][row] / GiB for mode in results]
        if row == TOTAL:
            lines.append(f"| **{row}** | " + " | ".join(f"**{v:.3f}**" for v in values) + " |")
        elif any(values) or row in ALWAYS_SHOWN:
            lines.append(f"| {row} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    sent = [results[mode].get(OFFLOADED, 0) for mode in results]
    if any(sent):
        lines.append(f"| {OFFLOADED} | " + " | ".join(f"{n / GiB:.3f}" for n in sent) + " |")
        times = [f"{1000 * n / (offload_gbps * 1e9):.1f}" for n in sent]
        lines.append(f"| copy time each way at {offload_gbps:g} GB/s, ms | " + " | ".join(times) + " |")
    return "\n".join(lines)


def describe(cfg: JobConfig, ngpu: int, ep_imbalance: float = 1.0) -> str:
    """One line naming the model, layout, batch and dtypes that were estimated."""
    t, dims = cfg.training, parallel_dims_for(cfg, ngpu)
    routing = ""
    if cfg.parallelism.expert_parallel_degree > 1:
        routing = "; balanced expert routing"
        if ep_imbalance != 1.0:
            routing = f"; this rank receives {ep_imbalance:g}x its balanced share of routed rows"
    early = "; the optimizer steps in backward" if cfg.optimizer.early_step_in_backward else ""
    return (
        f"{cfg.model.name} {cfg.model.flavor}, local batch {t.local_batch_size} x {t.seq_len} tokens, "
        f"on {describe_layout(cfg, dims)}{routing}{early}"
    )


def describe_stages(cfg: JobConfig) -> list[str]:
    """Under pipeline parallelism, one line per pipeline rank naming its stages and modules."""
    n_layers = get_train_spec(cfg.model.name).get_flavor(cfg.model.flavor).update_from_config(cfg).n_layers
    pp = cfg.parallelism.pipeline_parallel_degree
    return [describe_pipeline(PipelinePlan.from_config(cfg, n_layers, pp, r), r) for r in range(pp)]


def main(argv: list[str] | None = None) -> None:
    """Print the estimate as Markdown; on a config mistake print it and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    with reusing_fake_worlds():
        _main(argv)


def _main(argv: list[str]) -> None:
    try:
        args, cfg = parse_cli(argv)
        import_custom_module(cfg.job.custom_import)
        modes = list(AC_MODES) if args.all_ac_modes else None
        title = describe(cfg, args.ngpu, args.ep_imbalance)
        if args.plan and (args.max_seq_len is not None or args.all_ac_modes):
            raise ConfigError("--plan plans one config: drop --max-seq-len and --all-ac-modes.")
        if not args.plan and (args.budget_gib or args.tflops or args.plan_out):
            raise ConfigError("--budget-gib, --tflops and --plan-out go with --plan; add --plan.")
        if args.max_seq_len is not None:
            print(longest_seq_len_table(cfg, args.ngpu, args.max_seq_len, modes, args.ep_imbalance))
            return
        if args.plan:
            print(plan_command(cfg, args))
            return
        results = estimate(cfg, args.ngpu, modes, ep_imbalance=args.ep_imbalance)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if cfg.compile.enable:
        print("note: torch.compile is not simulated; this is the eager step's memory.", file=sys.stderr)
    if cfg.parallelism.enable_async_tensor_parallel:
        print(
            "note: async tensor parallelism is estimated as plain tensor parallelism (without its "
            "symmetric-memory buffers).",
            file=sys.stderr,
        )
    if cfg.parallelism.expert_parallel_degree > 1 and args.ep_imbalance == 1.0:
        print(
            "note: expert parallelism is estimated with balanced routing; an imbalanced step holds "
            "more on the ranks that receive the most tokens (see --ep-imbalance).",
            file=sys.stderr,
        )
    print(f"Estimated peak memory per rank: {title}\n\n{format_table(results, args.offload_gbps)}")
    if cfg.parallelism.pipeline_parallel_degree > 1:
        print("\n" + "\n".join(describe_stages(cfg)))


if __name__ == "__main__":
    main()
