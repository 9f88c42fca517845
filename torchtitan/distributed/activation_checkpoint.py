"""The one place that plans and applies activation checkpointing (AC).

`[activation_checkpoint]` and the facts of the run it needs (`ACFacts`: compile, flex attention,
TP and EP degrees, MoE blocks, torch version, the model's op save list) become, in one step, a
typed plan (`plan_activation_checkpointing`): one small class per mode. Every refusal about AC
is raised there, once. `plan.apply(model)` wraps the blocks of `model.layers`;
`plan.describe()` is the log line. `parallelize_decoder` builds and applies it after TP and
EP, before per-block compile and FSDP. The module knows no model by name: it asks each block
(a `DecoderBlock`) for its parts (`is_moe`, `mlp_name`, `end_linears`, `routed_experts`).

Modes (`[activation_checkpoint].mode`):
    none (`NoAC`): nothing is wrapped.
    full (`FullAC`): every block recomputes its whole forward in backward. A block with an MoE
        still saves the routing (`ROUTING_OPS`), the split-size exchange and its device-to-host
        copy; `full_ac_all_to_all` says whether the token all-to-alls are re-issued in
        recompute ("reissue") or saved and replayed ("replay").
    selective, option "N" (`EveryNthBlockAC`): blocks 0, N, 2N, ... get full AC.
    selective, option "op" (`OpSAC`): every block saves the outputs of the ops in the save list
        and recomputes the rest, except that every second matmul is recomputed, and so are the
        matmuls of the Linears `per_op_sac_force_recompute_mm_shapes_by_fqns` names.
    memory_budget (`MemoryBudgetAC`): no wrapping; torch.compile's partitioner chooses what to
        save so that activations stay within `memory_budget` of what saving everything costs.
    auto (`PerBlockAC`): each block as `auto_plan` names it: none, "regions" (its cheap
        regions checkpointed one by one, `CheapRegionsAC`), "op" (op-SAC), "op_all_mm" (op-SAC
        recomputing every matmul, `OpSACEveryMatmul`), full, or "op_offload" / "full_offload"
        (op-SAC or full AC with what the block keeps offloaded); the trainer fills the plan at
        startup to fit `auto_memory_gib` (`ac_planner.py`).

Wherever a recompute replays the expert-parallel combine all-to-all from its cache (op-SAC,
full AC with "replay"), it skips the matmul that makes that all-to-all's input (see
`all_to_all_input`).

Blocks that offload (eager blocks only: with `offload = "saved"` under modes none, full and
selective, those `offload_blocks` names; under mode auto, those whose choice ends in
"_offload") run their forward under the plan's `ActivationOffloader` (`activation_offload.py`):
what autograd saves there (for a checkpoint, its inputs) and what SAC's cache keeps
(`_OffloadingSACCache`) wait in host memory until backward.
"""

import contextlib
import dataclasses
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch._higher_order_ops.flex_attention import flex_attention as _flex_attention_op
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as ptd_checkpoint_wrapper,
)
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import _CONSUMED as _SAC_CONSUMED
from torch.utils.checkpoint import _RECOMPUTE as _SAC_RECOMPUTE
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    _sac_storage_key,
    _VersionWrapper,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed.activation_offload import ActivationOffloader, OffloadedTensor, attach
from torchtitan.tools.fqn import clean_fqn
from torchtitan.tools.torch_version import release

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

# What op-SAC saves unless a model says otherwise. Matmuls and attention are the expensive
# ops to recompute; the sequence-parallel reduce-scatter and the expert all-to-all would
# communicate again (and the all-to-all must replay the forward's routing); amax feeds
# low-precision scales; topk and the scatter_add token counts are MoE routing, which must not
# change between forward and recompute. torchao's Float8Linear matmuls reach op-SAC as `mm` on
# its float8 tensors (eager and compiled alike), so they are saved and alternated like any
# other; `_scaled_mm` is listed for code that calls it directly. Composite ops (`linear`, SDPA's
# math path) never reach the policy, which sees what they decompose into: `mm`, and for the
# math path the seq x seq scores and their softmax, which are recomputed rather than held.
DEFAULT_SAVE_LIST: frozenset = frozenset(
    {
        _aten.mm.default,
        _aten._scaled_mm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _flex_attention_op,
        _aten.max.default,
        _c10d.reduce_scatter_tensor.default,
        _c10d.all_to_all_single.default,
        _aten.topk.default,
        _aten.scatter_add.default,
    }
)

# The sequence-parallel all-gathers, which op-SAC recomputes by default (as upstream torchtitan
# does): each output is a full-sequence norm activation, tp times the size of its input, two
# per block. Keeping them spares two all-gathers per block in backward for that memory (see
# benchmarks/op_sac_tp_all_gather.py); a model can opt in with `save_list(add=...)`.
TP_ALL_GATHER_OPS: frozenset = frozenset({_c10d.all_gather_into_tensor.default})

# Ops a dense model never runs: MoE routing and the expert-parallel all-to-all.
MOE_ONLY_OPS: frozenset = frozenset(
    {_aten.topk.default, _aten.scatter_add.default, _c10d.all_to_all_single.default}
)

# What full AC still saves in a block that has an MoE: the routing (expert choice and tokens per
# expert), so recompute can neither route differently nor hit a shape mismatch.
ROUTING_OPS: frozenset = frozenset({_aten.topk.default, _aten.scatter_add.default})

# The torch.compile backends whose partitioner (min-cut rematerialization) applies
# `activation_memory_budget`; others, "eager" first, save what they always save.
MEMORY_BUDGET_BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition")
FORCE_RECOMPUTE_KEY = "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns"
# Before this release inductor fails on a checkpointed MoE block traced with
# capture_scalar_outputs (unbacked-symbol errors under full, op-SAC and memory_budget AC);
# checked on 2.11, fixed in 2.12.
FIRST_TORCH_TO_COMPILE_CHECKPOINTED_SCALARS = (2, 12)
# From this release the partitioner leaves opaque inputs (the TP DeviceMesh) out of the tensors
# saved for backward, so compiled blocks under full AC and TP run again; checked on 2.14.1 (2.14.0
# was not run, so it stays refused).
FIRST_TORCH_TO_RECOMPUTE_WITH_MESH_INPUTS = (2, 14, 1)


def save_list(add=(), drop=()) -> frozenset:
    """A model's op save list: `DEFAULT_SAVE_LIST` plus `add`, minus `drop`."""
    return (DEFAULT_SAVE_LIST | frozenset(add)) - frozenset(drop)


def compiles_checkpointed_scalars(torch_version: str = torch.__version__) -> bool:
    """Whether this torch compiles checkpointed MoE blocks with capture_scalar_outputs."""
    return release(torch_version)[:2] >= FIRST_TORCH_TO_COMPILE_CHECKPOINTED_SCALARS


def compile_sees_device_meshes() -> bool:
    """Whether this torch registers DeviceMesh as an opaque type, so that a mesh a module's
    hook holds becomes an input of the compiled graph."""
    import torch.distributed.device_mesh

    return hasattr(torch.distributed.device_mesh, "_register_distributed_opaque_types")


@dataclass(frozen=True)
class ACFacts:
    """What the AC plan needs to know of the run besides `[activation_checkpoint]`.

    Attributes:
        compile_enabled: the blocks are compiled after AC (it changes how op-SAC wraps flex
            attention, and memory_budget needs it).
        compiles: the blocks really compile in this process. False for an eager estimate of a
            compiled run (the memory estimator), which takes the compiled run's wrapping but
            not the refusals of what only fails inside torch's compiler.
        compile_backend, capture_scalar_outputs: `[compile]`'s.
        flex_attention: attention runs flex_attention.
        split_backward: a pipeline schedule runs each stage's backward in two passes, input
            gradients then weight gradients (the zero-bubble schedules); both passes recompute,
            so SAC keeps what it saved for the second (see `_KeptSACCache`).
        tensor_parallel, expert_parallel: the degrees.
        context_parallel_group: the name of the context-parallel process group ("" without
            CP): op-SAC saves its collectives' outputs (`context_parallel_collective`).
        has_moe: some block has an MoE.
        save_list: the ops whose outputs op-SAC saves (the model's own list).
        dump_folder: where memory_budget's pareto plot goes.
        torch_version: the torch the rules are checked for.
    """

    compile_enabled: bool = False
    compiles: bool = True
    compile_backend: str = "inductor"
    capture_scalar_outputs: bool = False
    flex_attention: bool = False
    split_backward: bool = False
    tensor_parallel: int = 1
    expert_parallel: int = 1
    context_parallel_group: str = ""
    has_moe: bool = False
    save_list: frozenset = DEFAULT_SAVE_LIST
    dump_folder: str = ""
    torch_version: str = field(default=torch.__version__)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


# ----- the plan ---------------------------------------------------------------------------


class ACPlan:
    """How AC wraps the blocks of a model; built by `plan_activation_checkpointing`.

    Pitfall: apply before torch.compile and FSDP, after TP and EP, so that the checkpoint sees
    the collectives TP and EP add and FSDP's hooks stay outside it.
    """

    mode_label = ""

    def __init__(self, config: ActivationCheckpoint, facts: ACFacts):
        self.config, self.facts = config, facts
        self._wrapped: dict[str, list[str]] = defaultdict(list)
        self._block_count = 0
        self._offload_blocks = (
            parse_offload_blocks(config.offload_blocks) if config.offload == "saved" else None
        )
        # Set by `apply` when blocks offload; tests and the benchmark read its pool and log.
        self.offloader: ActivationOffloader | None = None

    def offloads_any(self) -> bool:
        """Whether some block offloads what it holds for backward."""
        return self._offload_blocks is not None

    def apply(self, model: nn.Module) -> None:
        """Wrap `model.layers` (a ModuleDict or ModuleList of blocks) in place, and log
        `describe()`. Every plan resets torch's process-wide partitioner budget, which a
        previous model's memory_budget plan may have set (see `MemoryBudgetAC`)."""
        torch._functorch.config.activation_memory_budget = 1.0
        if self.offloads_any():
            self.offloader = ActivationOffloader(self.config.offload_min_bytes)
            attach(model, self.offloader)
        self.prepare(model)
        blocks = list(model.layers.named_children())
        self._block_count = len(blocks)
        for name, block in blocks:
            # The block's index in the whole model (its key), so that a pipeline stage, holding
            # some of the blocks, wraps the ones one process would.
            wrapped, kind = self.wrap_block(int(name), block, model)
            if kind is not None:
                model.layers.register_module(name, wrapped)
                self._wrapped[kind].append(name)
            if self._offloads(int(name)):
                _offload_in_forward(wrapped, self.offloader, int(name))
                at_least = _format_bytes(self.config.offload_min_bytes)
                self._wrapped[f"offload of saved tensors of {at_least} or more"].append(name)
        logger.info(self.describe())

    def prepare(self, model: nn.Module) -> None:
        """What the plan learns of the whole model before it wraps a block (nothing here)."""

    def _offloads(self, index: int) -> bool:
        """Whether block `index` offloads what it holds for backward."""
        return self._offload_blocks is not None and (
            not self._offload_blocks or index in self._offload_blocks
        )

    def _offloader_of(self, index: int) -> ActivationOffloader | None:
        """The offloader that block `index`'s SAC cache hands its saved outputs to, if any."""
        return self.offloader if self._offloads(index) else None

    def wrap_block(self, index: int, block: nn.Module, model: nn.Module) -> tuple[nn.Module, str | None]:
        """(the block, wrapped or not, and what was done to it; None when left as is)."""
        return block, None

    def describe(self) -> str:
        """The log line: the mode, and which blocks got what."""
        c = self.config
        line = f"Activation checkpointing: mode {c.mode}"
        if c.mode == "selective":
            line += f" ({c.selective_ac_option})"
        line += "".join(
            f", {kind} on {len(names)}/{self._block_count} blocks: {', '.join(names)}"
            for kind, names in self._wrapped.items()
        )
        if c.determinism_check == "none":
            line += ", recompute check off"
        if c.debug:
            line += ", debug traces on (slower)"
        return line

    def _checkpoint_options(self, context_fn=None) -> dict:
        c = self.config
        options = {"preserve_rng_state": c.preserve_rng_state, "early_stop": c.early_stop,
                   "determinism_check": c.determinism_check, "debug": c.debug}  # fmt: skip
        return options | ({"context_fn": context_fn} if context_fn is not None else {})

    def _checkpoint(self, module: nn.Module, context_fn=None) -> nn.Module:
        return ptd_checkpoint_wrapper(module, **self._checkpoint_options(context_fn))

    def _checkpoint_branch(self, block: nn.Module, name: str, context_fn=None) -> None:
        """Make `block`'s method `name` (a residual branch, see `DecoderBlock`, or a cheap
        region's `forward`) one checkpointed region. The method is shadowed on this module only;
        its modules stay where they are, so parameter names (state-dict keys) do not change."""
        branch = getattr(block, name)
        options = self._checkpoint_options(context_fn)

        def checkpointed(*args, **kwargs):
            return checkpoint(branch, *args, use_reentrant=False, **options, **kwargs)

        setattr(block, name, checkpointed)

    def _skips_all_to_all_inputs(self, block: nn.Module) -> bool:
        """Whether a recompute of `block` may skip the matmul whose output only the replayed
        expert-parallel combine reads (`all_to_all_input`): an MoE block under EP, not
        compiled (a compiled graph drops that matmul by itself)."""
        return self.facts.expert_parallel > 1 and block.is_moe and not self.facts.compile_enabled


class NoAC(ACPlan):
    """mode = "none": nothing is wrapped (and nothing logged), unless blocks offload."""

    def apply(self, model):
        if self.offloads_any():
            super().apply(model)
            return
        torch._functorch.config.activation_memory_budget = 1.0


class FullAC(ACPlan):
    """mode = "full": every block (`every` = 1), or one block in `every`, recomputes its whole
    forward in backward; an MoE block keeps its routing (see the module's docstring)."""

    every = 1

    def wrap_block(self, index, block, model):
        if index % self.every:
            return block, None
        kind = "full AC" if self.every == 1 else f"full AC on one block in {self.every}"
        if not block.is_moe:
            return self._checkpoint(block), kind
        replay = self.config.full_ac_all_to_all == "replay"
        skip = replay and self._skips_all_to_all_inputs(block)
        policy = lambda: _full_ac_moe_policy(replay, self.facts.context_parallel_group)  # noqa: E731
        context_fn = _selective_context_fn(
            policy, skip, keep=self.facts.split_backward, offloader=self._offloader_of(index)
        )
        kind += f" (MoE: routing saved, all-to-alls {self.config.full_ac_all_to_all})"
        return self._checkpoint(block, context_fn), kind


class EveryNthBlockAC(FullAC):
    """mode = "selective" with option "N": blocks 0, N, 2N, ... get full AC."""

    def __init__(self, config, facts):
        super().__init__(config, facts)
        self.every = int(config.selective_ac_option)


class OpSAC(ACPlan):
    """mode = "selective" with option "op": per-op selective AC (see `op_sac_context_fn`),
    recomputing every second matmul."""

    mm_recompute_every = 2

    def prepare(self, model):
        self.forced = forced_recompute_linears(
            model, self.config.per_op_sac_force_recompute_mm_shapes_by_fqns
        )

    def wrap_block(self, index, block, model):
        roles = _LinearRoles.of_block(block, self.forced, track_end=self.config.early_stop)
        context_fn = op_sac_context_fn(
            self.facts.save_list, roles, self._skips_all_to_all_inputs(block), keep=self.facts.split_backward,
            context_parallel_group=self.facts.context_parallel_group, offloader=self._offloader_of(index),
            mm_recompute_every=self.mm_recompute_every,
        )  # fmt: skip
        sac = lambda m: self._checkpoint(m, context_fn)  # noqa: E731
        if self.facts.flex_attention and not self.facts.compile_enabled:
            _warn_once(
                "flex_attention with per-op SAC and compile off: the attention branch (its norm "
                f"included) gets full AC and the {block.mlp_name} branch gets SAC, so that SAC does "
                "not discard flex_attention's compile. Enable compile to keep attention under SAC."
            )
            self._checkpoint_branch(block, "attention_branch")
            self._checkpoint_branch(block, "mlp_branch", context_fn)
            return block, f"attention branch full + {block.mlp_name} branch op-SAC (norms inside)"
        if self.facts.flex_attention and self.facts.compile_enabled and block.is_moe:
            _warn_once(
                "flex_attention with per-op SAC, compile on and MoE blocks: attention and moe "
                "are checkpointed as separate SAC regions, since routing splits the block's graph."
            )
            block.register_module("attention", sac(block.attention))
            block.register_module(block.mlp_name, sac(block.mlp))
            return block, f"attention op-SAC + {block.mlp_name} op-SAC"
        return sac(block), "op-SAC"


class OpSACEveryMatmul(OpSAC):
    """A choice of mode "auto" ("op_all_mm"): op-SAC that recomputes every matmul and keeps
    what else its save list holds (attention's output, the collectives'). Between op-SAC and
    full AC: it spares attention's recompute, which at long sequences costs the most."""

    mm_recompute_every = 1


class MemoryBudgetAC(ACPlan):
    """mode = "memory_budget": no block is wrapped; torch.compile's partitioner keeps what fits.

    Pitfall: torch's budget (`activation_memory_budget`) is process-wide and read when a block
    compiles (its first step): build and compile one model before planning another."""

    def apply(self, model):
        c = self.config
        torch._functorch.config.activation_memory_budget = c.memory_budget
        # Under tensor parallelism the compiled graphs take the DeviceMesh as an input (an
        # opaque object on recent torch), and the budgeted partitioner refuses to size it
        # ("Cannot compute the size of FakeScriptObject"). A mesh holds no tensor memory.
        if hasattr(torch._functorch.config, "unsafe_treat_script_objects_as_zero_size"):
            torch._functorch.config.unsafe_treat_script_objects_as_zero_size = True
        if c.visualize_memory_budget_pareto:
            torch._functorch.config.visualize_memory_budget_pareto = True
            torch._functorch.config.memory_budget_pareto_dir = self.facts.dump_folder or "."
        logger.info(self.describe())

    def describe(self):
        return (
            f"Activation checkpointing: mode memory_budget ({self.config.memory_budget}) through "
            "torch.compile's partitioner; no block is wrapped"
        )


class CheapRegionsAC(ACPlan):
    """A choice of mode "auto" ("regions"): each of a block's cheap regions (its norms, RoPE
    and SwiGLU gates, `DecoderBlock.cheap_regions`) is a plain checkpoint of its own, so
    backward keeps their inputs and recomputes their element-wise work, without the per-op
    dispatch of SAC. The matmuls and attention keep what they keep without AC.

    Pitfall: a region's output is usually held anyway (a matmul's input), so it saves only what
    the region holds inside: on a GPU, the SwiGLU gate's silu output and RoPE's fp32 copy of
    its input (the fused RMSNorm holds nothing more than its input)."""

    def wrap_block(self, index, block, model):
        regions = block.cheap_regions()
        for region in regions:
            self._checkpoint_branch(region, "forward")
        return block, f"{len(regions)} cheap regions recomputed"


class PerBlockAC(ACPlan):
    """mode = "auto": each block gets the choice its plan (`auto_plan`) names: "none",
    "regions" (`CheapRegionsAC`), "op" (`OpSAC`'s wrapping), "op_all_mm" (`OpSACEveryMatmul`'s),
    "full" (`FullAC`'s), or "op_offload" / "full_offload" (op-SAC's or full AC's, with what the
    block keeps for backward offloaded to host memory, as `offload = "saved"` does). The planner
    (`ac_planner.py`) writes the plan; this class only applies it, so a plan given by hand runs
    the same way.

    Pitfall: a block the plan does not name is refused when the plan is applied, not guessed."""

    def __init__(self, config, facts):
        super().__init__(config, facts)
        self.choices = parse_block_plan(config.auto_plan)
        self.plans: dict[str, ACPlan] = {
            "none": ACPlan(config, facts),
            "regions": CheapRegionsAC(config, facts),
            "op": OpSAC(fixed_mode(config, "op"), facts),
            "op_all_mm": OpSACEveryMatmul(fixed_mode(config, "op"), facts),
            "full": FullAC(fixed_mode(config, "full"), facts),
            "op_offload": OpSAC(fixed_mode(config, "op_offload"), facts),
            "full_offload": FullAC(fixed_mode(config, "full_offload"), facts),
        }

    def offloads_any(self):
        return any(choice in OFFLOAD_CHOICES for choice in self.choices.values())

    def _offloads(self, index):
        return self.choices.get(index) in OFFLOAD_CHOICES

    def prepare(self, model):
        for plan in self.plans.values():
            # One offloader per model: the offloading choices' SAC caches hand it their outputs.
            plan.offloader = self.offloader
            plan.prepare(model)

    def wrap_block(self, index, block, model):
        if index not in self.choices:
            raise ConfigError(
                f"'activation_checkpoint.auto_plan' = '{self.config.auto_plan}' names no choice for block "
                f"{index}; name every block once, or leave auto_plan empty to plan at startup."
            )
        choice = self.choices[index]
        wrapped, kind = self.plans[choice].wrap_block(index, block, model)
        return wrapped, kind or "no AC"


# ----- building the plan: every AC refusal --------------------------------------------------


def plan_activation_checkpointing(config: ActivationCheckpoint, facts: ACFacts) -> ACPlan:
    """The plan of `[activation_checkpoint]` = `config` for a run with `facts`.

    Raises:
        ConfigError: for a setting that is invalid, or that the rest of the run cannot
            support; it names the key, its value and the fix.
    """
    modes = ("none", "full", "selective", "memory_budget", "auto")
    if config.mode not in modes:
        raise ConfigError(
            f"'activation_checkpoint.mode' = '{config.mode}' is unknown; use one of {', '.join(modes)}."
        )
    if config.mode == "selective":
        _check_selective_option(config.selective_ac_option)
    if config.mode == "memory_budget":
        _check_memory_budget(config, facts)
    if config.mode == "auto":
        _check_auto(config, facts)
    if config.offload != "none":
        check_offload(config, facts)
    if config.debug and config.mode != "none":
        _check_debug(config, facts)
    if facts.compile_enabled and facts.compiles and config.mode != "none":
        _refuse_what_torchs_compiler_fails(config, facts)
    if config.mode == "none":
        return NoAC(config, facts)
    if facts.split_backward:
        _warn_once(
            f"activation_checkpoint.mode = '{config.mode}' under a zero-bubble pipeline schedule: its "
            "weight-gradient pass runs one backward per parameter group, and each recomputes the "
            "checkpointed blocks (ZBVZeroBubble with full AC took 3.4x the step time of 1F1B on the debug "
            "model, docs/pipeline_parallel.md). Prefer mode = 'none' there, or 1F1B / Interleaved1F1B."
        )
    if config.mode == "full":
        return FullAC(config, facts)
    if config.mode == "memory_budget":
        return MemoryBudgetAC(config, facts)
    if config.mode == "auto":
        return PerBlockAC(config, facts)
    if config.selective_ac_option == "op":
        return OpSAC(config, facts)
    return EveryNthBlockAC(config, facts)


def _check_selective_option(option: str) -> None:
    every_nth = option.isascii() and option.isdigit() and int(option) > 0
    if option != "op" and not every_nth:
        raise ConfigError(
            f"'activation_checkpoint.selective_ac_option' = '{option}' is invalid: use \"op\" "
            'for per-op selective AC or a positive integer N (as a string, e.g. "2").'
        )


def _check_memory_budget(config: ActivationCheckpoint, facts: ACFacts) -> None:
    if not 0.0 <= config.memory_budget <= 1.0:
        raise ConfigError(
            f"'activation_checkpoint.memory_budget' = {config.memory_budget} is outside [0, 1]: "
            "0 recomputes everything, 1 saves everything."
        )
    if not facts.compile_enabled:
        raise ConfigError(
            "'activation_checkpoint.mode' = 'memory_budget' works through torch.compile's "
            'partitioner: set compile.enable = true with "model" in compile.components.'
        )
    if facts.compile_backend not in MEMORY_BUDGET_BACKENDS:
        raise ConfigError(
            f"'activation_checkpoint.mode' = 'memory_budget' has no effect with 'compile.backend' = "
            f"'{facts.compile_backend}', which does not apply the budget; use one of "
            f"{', '.join(MEMORY_BUDGET_BACKENDS)}, or another AC mode."
        )


def _check_auto(config: ActivationCheckpoint, facts: ACFacts) -> None:
    """mode "auto" needs its plan by the time blocks are wrapped; the trainer and the memory
    estimator fill `auto_plan` before (see `ac_planner.py`)."""
    if not config.auto_plan.strip():
        raise ConfigError(
            "'activation_checkpoint.mode' = 'auto' reached the model without a plan: the trainer plans "
            "at startup (torchtitan.train), and scripts/estimate_memory.py --plan prints one; outside "
            "them, set 'activation_checkpoint.auto_plan' (e.g. \"op:0-15\") or use another mode."
        )
    plan = parse_block_plan(config.auto_plan)
    if config.offload != "none":
        raise ConfigError(
            "'activation_checkpoint.offload' = 'saved' with mode = 'auto': mode auto chooses offload per "
            'block itself (the choices "op_offload" and "full_offload", see auto_offload). Set offload = '
            '"none" with mode "auto", or use offload with a fixed mode.'
        )
    if any(choice in OFFLOAD_CHOICES for choice in plan.values()):
        what = (
            f"'activation_checkpoint.auto_plan' = '{config.auto_plan}' (its {' and '.join(OFFLOAD_CHOICES)})"
        )
        undo = f"a plan without {' and '.join(OFFLOAD_CHOICES)}"
        check_offload(dataclasses.replace(config, offload="saved"), facts, what, undo)


class NothingFits(ConfigError):
    """Mode "auto": the budget is below what full AC on every block of some device needs."""


def auto_budget(config: ActivationCheckpoint, capacity: int | None) -> int:
    """Mode "auto"'s budget in bytes: `auto_memory_gib`, or `capacity` (the device's memory;
    None where unknown: the CPU, accelerators other than CUDA's) less `auto_headroom_gib`.

    Raises:
        ConfigError: without a budget on the CPU, or when the headroom leaves nothing.
    """
    if config.auto_memory_gib > 0:
        return round(config.auto_memory_gib * 2**30)
    if capacity is None:
        raise ConfigError(
            "'activation_checkpoint.mode' = 'auto' on the CPU needs a budget: set "
            "'activation_checkpoint.auto_memory_gib' to the memory per rank, in GiB."
        )
    budget = capacity - round(config.auto_headroom_gib * 2**30)
    if budget <= 0:
        raise ConfigError(
            f"'activation_checkpoint.auto_headroom_gib' = {config.auto_headroom_gib} leaves nothing of the "
            f"device's {capacity / 2**30:.1f} GiB; lower it, or set auto_memory_gib."
        )
    return budget


def nothing_fits(
    budget: int, needed: int, where: str = "", measured: bool = False, offload: bool = False
) -> NothingFits:  # fmt: skip
    """The refusal of a mode "auto" budget: full AC on every block (with its input offloaded,
    with `offload`) needs `needed` bytes on device `where` (a pipeline rank's label, or "");
    `measured`: the last plan tried needed it."""
    on = f" on {where}" if where else ""
    full = "full AC with offload" if offload else "full AC"
    what = "the last plan tried measured" if measured else f"{full} on every block needs"
    return NothingFits(
        f"mode 'auto' cannot fit its budget of {budget / 2**30:.2f} GiB per device "
        f"('activation_checkpoint.auto_memory_gib'): {what} {needed / 2**30:.2f} GiB per device{on} "
        "(estimated). Give more memory, or hold less per device: a larger tensor_parallel_degree, "
        "pipeline_parallel_degree or context_parallel_degree, more FSDP ranks, or a smaller "
        "training.local_batch_size."
    )


def no_planner(estimator: str) -> ConfigError:
    """The refusal of mode "auto" without a plan where the estimator that makes one is missing."""
    return ConfigError(
        f"'activation_checkpoint.mode' = 'auto' plans with {estimator}, which this install lacks. Run "
        "scripts/estimate_memory.py --plan from a torchtitan checkout and set "
        "'activation_checkpoint.auto_plan' to the plan it prints, or use another mode."
    )


def check_offload(
    config: ActivationCheckpoint, facts: ACFacts, what: str = "", undo: str = 'offload = "none"'
) -> None:  # fmt: skip
    """Refuse offload (`config.offload = "saved"`) where it cannot run: it works in eager blocks,
    through autograd's saved-tensor hooks and SAC's cache. The planner of mode auto asks it too.

    Args:
        what: the setting that offloads, as the refusal names it (default: the offload key).
        undo: how to turn it off, as the refusal says.

    Raises:
        ConfigError: for an unknown value, bad `offload_blocks`, memory_budget, compiled blocks or
            a zero-bubble schedule.
    """
    offloads = ("none", "saved")
    if config.offload not in offloads:
        raise ConfigError(
            f"'activation_checkpoint.offload' = '{config.offload}' is unknown; use one of "
            f"{', '.join(offloads)}."
        )
    parse_offload_blocks(config.offload_blocks)
    what = what or "'activation_checkpoint.offload' = 'saved'"
    if config.mode == "memory_budget":
        raise ConfigError(
            f"{what} with mode = 'memory_budget': the compiled partitioner decides what is saved inside "
            'its graph, where offload cannot reach. Use mode "none", "full" or "selective" with '
            f"offload, or {undo}."
        )
    if facts.compile_enabled:
        raise ConfigError(
            f'{what} with compile.enable ("model" in compile.components): a compiled block keeps its '
            "saved tensors inside its graph, where offload cannot reach. Set compile.enable = false "
            f'(or drop "model" from compile.components), or {undo}.'
        )
    if facts.split_backward:
        raise ConfigError(
            f"{what} under a zero-bubble pipeline schedule (its two backward passes read the saved "
            "tensors twice, out of block order) is not supported. Use "
            f'parallelism.pipeline_parallel_schedule = "1F1B" or "Interleaved1F1B", or {undo}.'
        )


def _check_debug(config: ActivationCheckpoint, facts: ACFacts) -> None:
    """torch's checkpoint debug mode replaces a checkpoint's `context_fn` with its own tracer,
    refuses one that is set (op-SAC, full AC of MoE blocks), and fails inside compile."""
    conflict = None
    if facts.compile_enabled:
        conflict = 'compiled blocks (compile.enable with "model" in compile.components)'
    elif config.mode == "auto" or (config.mode == "selective" and config.selective_ac_option == "op"):
        conflict = (
            'per-op selective AC (selective_ac_option = "op", or mode "auto"), which checkpoints by a policy'
        )
    elif facts.has_moe:
        conflict = "MoE blocks, whose full AC saves the routing by a policy"
    if conflict:
        raise ConfigError(
            f"'activation_checkpoint.debug' = true cannot trace {conflict}: torch's checkpoint "
            'debug mode only wraps blocks checkpointed without a policy. Trace with mode "full" (or '
            "selective N) on a dense model with compile off, or set debug = false."
        )


def _refuse_what_torchs_compiler_fails(config: ActivationCheckpoint, facts: ACFacts) -> None:
    """Compiled AC combinations this torch is known to get wrong.

    Full AC (or selective N) of compiled blocks under TP fails in the first step where torch
    passes the TP DeviceMesh into compiled graphs as an opaque object and does not yet keep it
    out of the saved tensors (torch 2.13 here; 2.11, which passes no mesh, and 2.14.1 run it):
    the recomputed attention kernel, tagged random for its dropout, gets its RNG state saved
    after the mesh, where AOTAutograd expects only tensors. A checkpointed MoE block traced with
    capture_scalar_outputs fails inside inductor before 2.12.
    """
    version = facts.torch_version
    if facts.capture_scalar_outputs and facts.has_moe and not compiles_checkpointed_scalars(version):
        need = ".".join(map(str, FIRST_TORCH_TO_COMPILE_CHECKPOINTED_SCALARS))
        raise ConfigError(
            f"'compile.capture_scalar_outputs' = true with 'activation_checkpoint.mode' = '{config.mode}' "
            f"on MoE blocks fails inside inductor in torch {version}. Set "
            f"compile.capture_scalar_outputs = false (the MoE blocks then fall back where they read "
            f"counts on the host), or use torch >= {need}."
        )
    wraps_whole_blocks = (
        config.mode == "full"
        or (config.mode == "selective" and config.selective_ac_option != "op")
        or (config.mode == "auto" and "full" in parse_block_plan(config.auto_plan).values())
    )
    fixed = release(version) >= FIRST_TORCH_TO_RECOMPUTE_WITH_MESH_INPUTS
    if not (wraps_whole_blocks and facts.tensor_parallel > 1 and compile_sees_device_meshes()) or fixed:
        return
    mode = f"'{config.mode}'"
    if config.mode == "selective":
        mode += f" with 'activation_checkpoint.selective_ac_option' = '{config.selective_ac_option}'"
    raise ConfigError(
        f"'activation_checkpoint.mode' = {mode} with compile.enable and "
        f"'parallelism.tensor_parallel_degree' = {facts.tensor_parallel} fails in torch {version}'s "
        "compiler (it saves the tensor-parallel DeviceMesh among the tensors for backward when it "
        'recomputes attention). Set mode = "selective" and selective_ac_option = "op" (both: the '
        'option\'s default is "2"), or mode = "memory_budget", or compile.enable = false; torch '
        "2.11 and torch >= 2.14.1 run this combination."
    )


def apply_ac(
    model: nn.Module,
    ac_config: ActivationCheckpoint,
    *,
    model_compile_enabled: bool = False,
    use_flex_attn: bool = False,
    op_sac_save_list: frozenset | set | None = None,
    base_folder: str = "",
    compile_backend: str = "inductor",
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
) -> ACPlan:
    """Plan `[activation_checkpoint]` for `model` (its blocks tell whether it has MoE) with
    these facts, apply the plan, and return it; see `ACFacts` for the arguments.

    Raises:
        ConfigError: see `plan_activation_checkpointing`.
    """
    facts = ACFacts(
        compile_enabled=model_compile_enabled,
        compile_backend=compile_backend,
        flex_attention=use_flex_attn,
        tensor_parallel=tensor_parallel,
        expert_parallel=expert_parallel,
        has_moe=any(block.is_moe for block in model.layers.children()),
        save_list=DEFAULT_SAVE_LIST if op_sac_save_list is None else frozenset(op_sac_save_list),
        dump_folder=base_folder,
    )
    plan = plan_activation_checkpointing(ac_config, facts)
    plan.apply(model)
    return plan


def recompute_in_backward(fn, *args):
    """`fn(*args)`, saving only its inputs: backward runs `fn` again for what it needs.

    The chunked output head (`components.loss_head.ChunkedLoss`) runs each chunk's projection
    and loss this way, outside the blocks and whatever `[activation_checkpoint]` says: its
    logits are worth more memory than any block's activations and cost one matmul to redo.
    `fn` must draw no random numbers (the RNG state is not restored for the recompute).
    """
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


# ----- forced recompute, by module -------------------------------------------------------


def forced_recompute_linears(model: nn.Module, entries: list[str]) -> set[nn.Module]:
    """The nn.Linear modules inside the blocks (`model.layers`) whose FQN contains an entry of
    `per_op_sac_force_recompute_mm_shapes_by_fqns`: op-SAC recomputes exactly their matmuls.

    An entry that matches nothing is skipped when it is a default one (they name modules only
    some models have) and refused when the user wrote it.

    Raises:
        ConfigError: an entry is empty (it would match every module), matches a non-Linear
            module, or matches no Linear inside the blocks AC wraps.
    """
    defaults = ActivationCheckpoint().per_op_sac_force_recompute_mm_shapes_by_fqns
    named = [(clean_fqn(name), module) for name, module in model.named_modules()]
    forced = set()
    for pattern in entries:
        if not pattern.strip():
            raise ConfigError(
                f"'{FORCE_RECOMPUTE_KEY}' has an empty entry, which would match every module; remove it."
            )
        matches = [(n, m) for n, m in named if pattern in n]
        if not matches and pattern in defaults:
            continue
        non_linear = [(n, m) for n, m in matches if not isinstance(m, nn.Linear)]
        if non_linear:
            name, module = non_linear[0]
            raise ConfigError(
                f"'{FORCE_RECOMPUTE_KEY}' entry '{pattern}' matches {name} ({type(module).__name__}), not an "
                "nn.Linear; name Linear modules only (e.g. 'attention.wo', not 'attention')."
            )
        if not matches:
            raise ConfigError(
                f"'{FORCE_RECOMPUTE_KEY}' entry '{pattern}' matches no module of the model; give a "
                "substring of an nn.Linear's name inside a block (e.g. 'moe.router.gate')."
            )
        in_blocks = [m for n, m in matches if n.startswith("layers.")]
        if not in_blocks:
            outside = ", ".join(n for n, _ in matches[:3])
            raise ConfigError(
                f"'{FORCE_RECOMPUTE_KEY}' entry '{pattern}' matches only {outside}, "
                "outside the transformer blocks AC wraps (model.layers), so it would force nothing; "
                "give a substring of a Linear inside a block (e.g. 'moe.router.gate')."
            )
        forced.update(in_blocks)
    return forced


class _LinearRoles:
    """Which Linear of one block runs each matmul op-SAC's policy sees, and its role: forced
    to recompute, or one of the block's `end_linears` (after whose matmul the block's last
    sequence-parallel reduce-scatter comes).

    Eager, a forward pre-hook on each of the block's Linears notes the one running (and its
    forward hook clears it), in forward and in recompute alike. Compiled, the policy runs while
    torch traces the block, where hooks have run already; there the traced op's module path
    (its `nn_module_stack`) names the Linear.
    """

    _running = threading.local()

    def __init__(self, forced: dict[str, nn.Module], end: dict[str, nn.Module]):
        self.forced_names, self.end_names = set(forced), set(end)
        self.forced_modules = set(forced.values())
        self.end_modules = set(end.values())

    @classmethod
    def of_block(cls, block: nn.Module, forced: set[nn.Module], track_end: bool) -> "_LinearRoles":
        linears = {clean_fqn(n): m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
        end = set(block.end_linears()) if track_end else set()
        roles = cls(
            {n: m for n, m in linears.items() if m in forced}, {n: m for n, m in linears.items() if m in end}
        )
        if roles.forced_modules or roles.end_modules:
            for module in linears.values():
                module.register_forward_pre_hook(_note_running_linear)
                module.register_forward_hook(_clear_running_linear)
        return roles

    def role(self) -> tuple[bool, bool]:
        """(forced, ends the block) of the Linear whose matmul the policy sees now."""
        if fx_traceback.has_preserved_node_meta():
            stack = fx_traceback.get_current_meta().get("nn_module_stack")
            if stack:
                path = _module_path(next(reversed(stack.values()))[0])
                return _ends_with_any(path, self.forced_names), _ends_with_any(path, self.end_names)
        module = getattr(self._running, "module", None)
        return module in self.forced_modules, module in self.end_modules


def _note_running_linear(module, args) -> None:
    if not torch.compiler.is_compiling():
        _LinearRoles._running.module = module


def _clear_running_linear(module, args, output) -> None:
    if not torch.compiler.is_compiling():
        _LinearRoles._running.module = None


def _module_path(source: str) -> str:
    """A traced module's source ("L['self']._checkpoint_wrapped_module.moe.router.gate", or
    "L['self'].layers['0'].attention.wq") as a clean dotted path ("moe.router.gate")."""
    path = source.replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
    path = path.replace(".__dict__._modules", "")  # how dynamo names a submodule it reached by attribute
    return clean_fqn(path.split(".", 1)[1] if "." in path else "")


def _ends_with_any(path: str, names: set[str]) -> bool:
    return any(path == name or path.endswith("." + name) for name in names)


# ----- the policies -------------------------------------------------------------------------


def _is_device_to_host_copy(func, args, kwargs) -> bool:
    return (
        func == _aten._to_copy.default
        and args[0].device.type != "cpu"
        and kwargs.get("device") == torch.device("cpu")
    )


def _is_looped_expert_mm(func, args) -> bool:
    """A routed expert's matmul run in a loop (where grouped mm cannot run): its weight is a
    view of the experts' stacked 3-D weights."""
    if func != _aten.mm.default:
        return False
    base = args[1]._base
    return base is not None and base.dim() == 3


def context_parallel_collective(func, args, kwargs, group_name: str) -> bool:
    """Whether an op is one of context parallelism's exchanges (the keys' and values'
    all-gather, Ulysses' all-to-alls): a functional collective on the CP group. op-SAC saves
    them, so that backward never exchanges again; full AC re-issues them."""
    if not group_name or func not in (_c10d.all_gather_into_tensor.default, _c10d.all_to_all_single.default):
        return False
    return kwargs.get("group_name", args[-1]) == group_name


def in_selective_checkpoint() -> bool:
    """Whether the forward of a selective checkpoint (SAC: op-SAC, or full AC of an MoE block)
    runs now, its dispatch mode seeing each op. For measurements (`op_counter.RecomputeCost`);
    call it outside a dispatch mode's handler, which hides the modes above it."""
    return any(isinstance(mode, _CachingTorchDispatchMode) for mode in _get_current_dispatch_mode_stack())


def _op_sac_policy(
    save_ops: frozenset, roles: _LinearRoles | None, counts: dict, context_parallel_group: str = "",
    mm_recompute_every: int = 2,
):  # fmt: skip
    def policy(ctx, func, *args, **kwargs):
        if _is_device_to_host_copy(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if context_parallel_collective(func, args, kwargs, context_parallel_group):
            return CheckpointPolicy.MUST_SAVE
        phase = "recompute" if ctx.is_recompute else "forward"
        if _is_looped_expert_mm(func, args):
            # Recomputed like grouped experts' matmuls, and kept out of the every-second-matmul
            # rule and of the block-end reduce-scatter's detection.
            return CheckpointPolicy.PREFER_RECOMPUTE
        if func == _aten.mm.default:
            forced, ends_block = roles.role() if roles is not None else (False, False)
            counts[phase, "after block-end mm"] = ends_block
            if forced:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[phase] += 1
            # By default every second matmul: half their memory for half their time.
            if counts[phase] % mm_recompute_every == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func == _c10d.reduce_scatter_tensor.default and counts[phase, "after block-end mm"]:
            # The block's last sequence-parallel reduce-scatter (of its feed-forward or MoE
            # output) feeds only the residual add: backward never reads it, so early stop never
            # re-issues it, and saving it would hold b x s/tp x dim per block. (Not so after
            # wo: the next norm's input is recomputed from it.)
            return CheckpointPolicy.PREFER_RECOMPUTE
        if func in save_ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _full_ac_moe_policy(replay_all_to_all: bool, context_parallel_group: str = ""):
    def policy(ctx, func, *args, **kwargs):
        if func in ROUTING_OPS or _is_device_to_host_copy(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if context_parallel_collective(func, args, kwargs, context_parallel_group):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if func == _c10d.all_to_all_single.default:
            # Integer inputs are the split-size exchange: tiny, and it would sync again.
            if replay_all_to_all or not args[0].is_floating_point():
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def full_ac_moe_context_fn(replay_all_to_all: bool, skip_all_to_all_inputs: bool = False):
    """A `context_fn` for full AC of an MoE block: recompute everything but the routing, the
    split sizes and, with `replay_all_to_all`, the token all-to-alls. `skip_all_to_all_inputs`
    (only with `replay_all_to_all`): see `all_to_all_input`."""
    return _selective_context_fn(
        lambda: _full_ac_moe_policy(replay_all_to_all), skip_all_to_all_inputs and replay_all_to_all
    )


def op_sac_context_fn(
    save_ops: frozenset,
    roles: _LinearRoles | None = None,
    skip_all_to_all_inputs: bool = False,
    keep: bool = False,
    context_parallel_group: str = "",
    offloader: ActivationOffloader | None = None,
    mm_recompute_every: int = 2,
):
    """A `context_fn` for op-SAC; each checkpointed call gets fresh matmul counters, shared
    by its forward and its recompute so that both make the same choices: every
    `mm_recompute_every`-th matmul is recomputed (1: every one), the others are saved. `roles` tells the
    block's forced Linears (always recomputed) and its end Linears: the reduce-scatter right
    after one of their matmuls is not saved, which holds only under `early_stop` (that never
    recomputes it). `skip_all_to_all_inputs` (only when `save_ops` holds the all-to-all): see
    `all_to_all_input`. `keep`: see `_KeptSACCache`. `context_parallel_group`: see
    `context_parallel_collective`. `offloader`: the saved outputs go to host memory (see
    `_OffloadingSACCache`)."""

    def new_policy():
        return _op_sac_policy(save_ops, roles, defaultdict(int), context_parallel_group, mm_recompute_every)

    skip = skip_all_to_all_inputs and _c10d.all_to_all_single.default in save_ops
    return _selective_context_fn(new_policy, skip, keep, offloader)


def _selective_context_fn(
    new_policy, skip_all_to_all_inputs: bool, keep: bool = False, offloader: ActivationOffloader | None = None
):
    def context_fn():
        forward, recompute = create_selective_checkpoint_contexts(new_policy())
        if offloader is not None:
            forward = _OffloadingSACCache(forward.policy_fn, forward.storage, offloader)
        if keep:
            recompute = _KeptSACCache(None, forward.storage, recompute.allow_cache_entry_mutation)
        if skip_all_to_all_inputs:
            recompute = _skipping_all_to_all_inputs(recompute)
        return forward, recompute

    return context_fn


class _KeptSACCache(_CachedTorchDispatchMode):
    """The recompute side of SAC, reading the saved outputs without using them up.

    Why: torch's cache hands each saved output out once, and refuses a second recompute of the
    region ("Trying to backward an extra time"). A zero-bubble pipeline schedule runs a stage's
    backward in two passes (input gradients, then weight gradients), and each pass recomputes
    the checkpointed region. Kept, the saved outputs live until the region's graph is freed,
    after the weight-gradient pass: what that schedule holds anyway.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        key = _sac_storage_key(func, args)
        entries, index = self.storage.get(key), self.func_counter[key]
        kept = entries.get(index) if entries else None
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if kept is not None and entries.get(index) is _SAC_CONSUMED:
            entries[index] = kept
        return out


class _OffloadingSACCache(_CachingTorchDispatchMode):
    """The forward side of SAC, handing each output it saves to the offloader: the cache then
    holds a handle (`_OffloadedEntry`), and the recompute reads the tensor back from it."""

    def __init__(self, policy_fn, storage, offloader: ActivationOffloader):
        super().__init__(policy_fn, storage)
        self.offloader = offloader

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in SAC_IGNORED_OPS:
            return out
        key = _sac_storage_key(func, args)
        entries, index = self.storage[key], self.func_counter[key] - 1
        if entries[index] is not _SAC_RECOMPUTE:
            # A functional collective's output holds its data only after the block waits for it.
            later = func.namespace.startswith("_c10d_functional")
            entries[index] = tree_map(lambda saved: self._offloaded(saved, later), entries[index])
        return out

    def _offloaded(self, saved, when_block_ends: bool):
        if isinstance(saved, _VersionWrapper) and self.offloader.offloads(saved.val):
            return _OffloadedEntry(self.offloader.offload(saved.val, when_block_ends), self.offloader)
        return saved


class _OffloadedEntry:
    """A SAC cache entry in host memory, read like torch's `_VersionWrapper`."""

    def __init__(self, handle: OffloadedTensor, offloader: ActivationOffloader):
        self.handle, self.offloader = handle, offloader

    def get_val(self, allow_cache_entry_mutation):
        return self.offloader.restore(self.handle)


def _offload_in_forward(block: nn.Module, offloader: ActivationOffloader, index: int) -> None:
    """Run `block`'s forward as block `index` of `offloader`, with its saved-tensor hooks: what
    autograd saves (with a checkpoint: the checkpoint's inputs) goes to host memory. The method
    is shadowed on this module only, so parameter names do not change."""
    forward = block.forward

    def offloading_forward(*args, **kwargs):
        with offloader.block(index), offloader.saved_tensors_hooks():
            return forward(*args, **kwargs)

    block.forward = offloading_forward


def _format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} bytes"


def parse_offload_blocks(spec: str) -> frozenset[int]:
    """The block indices `[activation_checkpoint] offload_blocks` names: "all" (empty: every
    block) or comma-separated indices and ranges, e.g. "0-3,8".

    Raises:
        ConfigError: naming the value and the syntax.
    """
    if spec.strip() == "all":
        return frozenset()
    indices: set[int] = set()
    try:
        for part in spec.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if low < 0 or high < low:
                raise ValueError
            indices.update(range(low, high + 1))
    except ValueError:
        raise ConfigError(
            f"'activation_checkpoint.offload_blocks' = '{spec}' is invalid: use \"all\" or block indices "
            'and ranges separated by commas, e.g. "0-3,8".'
        ) from None
    return frozenset(indices)


# What mode "auto" gives a block, from the least memory saved to the most.
AUTO_PLAN_CHOICES = ("none", "regions", "op", "op_all_mm", "op_offload", "full", "full_offload")
# The choices that offload what the block keeps (`ActivationOffloader`), and the choice whose
# wrapping each offloads from.
OFFLOAD_CHOICES = {"op_offload": "op", "full_offload": "full"}


# A block range that covers every model's blocks (a plan's blocks past the last are ignored).
EVERY_BLOCK = f"0-{2**16 - 1}"


def fixed_mode(config: ActivationCheckpoint, choice: str) -> ActivationCheckpoint:
    """`config` as the mode that wraps every block as mode "auto"'s `choice` wraps one: the fixed
    mode ("none", "op", "full", with `offload = "saved"` on every block for the "_offload"
    choices), or for a choice without one ("regions", "op_all_mm"), mode "auto" with that choice
    on every block. What the planner measures and the preflight builds for that choice."""
    offload = {"offload": "saved", "offload_blocks": "all"}
    modes = {"none": {"mode": "none", "auto_plan": ""},
             "regions": {"mode": "auto", "auto_plan": f"regions:{EVERY_BLOCK}"},
             "op": {"mode": "selective", "selective_ac_option": "op", "auto_plan": ""},
             "op_all_mm": {"mode": "auto", "auto_plan": f"op_all_mm:{EVERY_BLOCK}"},
             "op_offload": {"mode": "selective", "selective_ac_option": "op", "auto_plan": ""} | offload,
             "full": {"mode": "full", "auto_plan": ""},
             "full_offload": {"mode": "full", "auto_plan": ""} | offload}  # fmt: skip
    return dataclasses.replace(config, **modes[choice])


def parse_block_plan(spec: str) -> dict[int, str]:
    """Block index -> choice, from `auto_plan`: "CHOICE:BLOCKS" groups separated by ";", with
    BLOCKS as in `offload_blocks` (indices and ranges), e.g. "none:0-3; op:4-27; full:28-31".

    Raises:
        ConfigError: for an unknown choice, a malformed group, or a block named twice.
    """
    plan: dict[int, str] = {}
    for group in filter(None, (g.strip() for g in spec.split(";"))):
        choice, colon, blocks = (part.strip() for part in group.partition(":"))
        if choice not in AUTO_PLAN_CHOICES or not colon or blocks == "all":
            raise ConfigError(
                f"'activation_checkpoint.auto_plan' = '{spec}' is invalid at '{group}': write groups "
                f"CHOICE:BLOCKS separated by ';', CHOICE one of {', '.join(AUTO_PLAN_CHOICES)}, e.g. "
                '"none:0-3; op:4-27; full:28-31".'
            )
        try:
            indices = parse_offload_blocks(blocks)
        except ConfigError:
            raise ConfigError(
                f"'activation_checkpoint.auto_plan' = '{spec}' has bad block indices in '{group}': use "
                'indices and ranges separated by commas, e.g. "op:4-27,30".'
            ) from None
        if twice := sorted(indices & plan.keys()):
            raise ConfigError(
                f"'activation_checkpoint.auto_plan' = '{spec}' names block {twice[0]} twice; name each once."
            )
        plan.update(dict.fromkeys(indices, choice))
    return plan


def format_block_plan(choices: dict[int, str]) -> str:
    """The `auto_plan` string of `choices` (block index -> choice), with runs as ranges."""
    groups = []
    for choice in AUTO_PLAN_CHOICES:
        indices = sorted(i for i, c in choices.items() if c == choice)
        runs = []
        for i in indices:
            if runs and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        if runs:
            groups.append(f"{choice}:" + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs))
    return "; ".join(groups)


# ----- the recompute that skips the all-to-all's input ----------------------------------------

# The matmuls `all_to_all_input` may mark; other ops in its region run as usual.
_SKIPPABLE_MATMULS = (_aten.mm.default, _aten._grouped_mm.default)
_all_to_all_input = threading.local()


@contextlib.contextmanager
def all_to_all_input():
    """Mark the matmuls run inside as making the input of an expert-parallel all-to-all (the
    routed experts' last projection, which the combine sends back).

    A recompute (of op-SAC, or of full AC with `full_ac_all_to_all = "replay"`) takes that
    all-to-all's output from the checkpoint's cache, so it never reads the matmul's output; it
    only has to get past it to reach what backward needs further on (the combined output that
    weights the routing scores). Inside this region such a recompute runs no kernel for `mm`
    and `_grouped_mm`: it hands on an uninitialized tensor of the output's shape. Autograd still
    records each matmul and saves its inputs, so backward is unchanged; a third of the routed
    experts' recompute is saved.

    Everywhere else (the forward, a recompute that re-issues the all-to-all, a block without
    expert parallelism, a compiled block, whose graph drops the unused matmul by itself) it
    does nothing. The plan turns it on for the MoE blocks of an expert-parallel run.

    Pitfalls: mark only matmuls whose output reaches nothing but that all-to-all (through
    reindexing at most); anything else reading it in a recompute would read garbage
    (`tests/unit/test_moe.py` fills the skipped outputs with NaN to prove that nothing does).
    The recompute of such a block passes each op through one more Python dispatch mode, a few
    microseconds each (less than the skipped matmul saves even on the debug models' experts:
    see `benchmarks/moe_expert_parallel.py`).
    """
    _all_to_all_input.depth = getattr(_all_to_all_input, "depth", 0) + 1
    try:
        yield
    finally:
        _all_to_all_input.depth -= 1


def _matmul_output(func, args, kwargs):
    """An uninitialized output for `mm` or 2-D x 3-D `_grouped_mm`; None for other layouts."""
    a, b = args[0], args[1]
    if func == _aten.mm.default:
        return a.new_empty((a.shape[0], b.shape[1]))
    if a.dim() == 2 and b.dim() == 3:
        out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None)
        return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype or a.dtype)
    return None


class _SkipAllToAllInputs(TorchDispatchMode):
    """Recompute-side mode: the matmuls inside `all_to_all_input` return uninitialized outputs
    (below autograd, which still records them)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_all_to_all_input, "depth", 0) and func in _SKIPPABLE_MATMULS:
            out = _matmul_output(func, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def _skipping_all_to_all_inputs(recompute_context):
    # Entered before (under) the SAC cache, which must see every op of the recompute in the
    # forward's order: the ops it runs reach this mode, and what this mode creates bypasses it.
    with _SkipAllToAllInputs(), recompute_context:
        yield
