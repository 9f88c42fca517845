"""The one place that applies activation checkpointing (AC) to a model.

Every model's `parallelize.py` calls `apply_ac` after tensor parallelism and before per-block
compile and FSDP. The module knows no model by name: it sees blocks through `model.layers`
(a ModuleDict or ModuleList) and, for the flex-attention rules, the block's `attention` and
`feed_forward` or `moe` submodules. A model passes its own op save list, built from
`DEFAULT_SAVE_LIST` with `save_list(add=..., drop=...)`.

Modes (`[activation_checkpoint].mode`):
    none: nothing is wrapped.
    full: every block recomputes its whole forward in backward.
    selective, option "N": every Nth block of this model (0, N, 2N, ...) is fully checkpointed.
    Full AC of a block with an MoE (`block.moe`) still saves the routing (`ROUTING_OPS`), the
    split-size exchange and its device-to-host copy; `full_ac_all_to_all` says whether the
    token all-to-alls are re-issued in recompute ("reissue") or saved and replayed ("replay").
    selective, option "op": every block saves the outputs of the ops in the save list and
        recomputes the rest, except that every second matmul is recomputed.
    memory_budget: no wrapping; torch.compile's partitioner chooses what to save so that
        activations stay within `memory_budget` of what saving everything costs.

Wherever a recompute replays the expert-parallel combine all-to-all from its cache (op-SAC,
full AC with "replay"), it skips the matmul that makes that all-to-all's input (see
`all_to_all_input`).
"""

import contextlib
import logging
import threading
from collections import defaultdict

import torch
import torch.nn as nn
from torch._higher_order_ops.flex_attention import flex_attention as _flex_attention_op
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as ptd_checkpoint_wrapper,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.config.validation import ac_debug_conflict, check_activation_checkpoint

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

# The part of a block that ends it: under sequence parallelism its output is reduce-scattered,
# and that reduce-scatter's output feeds only the residual add.
BLOCK_END_PARTS = ("feed_forward", "moe")


def save_list(add=(), drop=()) -> frozenset:
    """A model's op save list: `DEFAULT_SAVE_LIST` plus `add`, minus `drop`."""
    return (DEFAULT_SAVE_LIST | frozenset(add)) - frozenset(drop)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _refuse_debug_with_moe_blocks(ac_config: ActivationCheckpoint, model: nn.Module) -> None:
    """Full AC of an MoE block saves the routing by a policy, which torch's checkpoint debug
    mode refuses; the conflicts that need no model are `check_activation_checkpoint`'s."""
    if ac_config.debug and ac_config.mode != "none":
        if any(hasattr(block, "moe") for block in model.layers.children()):
            raise ac_debug_conflict("MoE blocks, whose full AC saves the routing by a policy")


def _checkpoint_options(ac_config: ActivationCheckpoint, context_fn=None) -> dict:
    options = {
        "preserve_rng_state": ac_config.preserve_rng_state,
        "early_stop": ac_config.early_stop,
        "determinism_check": ac_config.determinism_check,
        "debug": ac_config.debug,
    }
    return options | ({"context_fn": context_fn} if context_fn is not None else {})


def _checkpoint(module: nn.Module, ac_config: ActivationCheckpoint, context_fn=None) -> nn.Module:
    return ptd_checkpoint_wrapper(module, **_checkpoint_options(ac_config, context_fn))


def _checkpoint_branch(block: nn.Module, name: str, ac_config: ActivationCheckpoint, context_fn=None) -> None:
    """Make `block`'s method `name` (a residual branch, see `DecoderBlock`) one checkpointed
    region. The method is shadowed on this block only; its modules stay where they are, so
    parameter names (state-dict keys) do not change."""
    branch = getattr(block, name)
    options = _checkpoint_options(ac_config, context_fn)

    def checkpointed(*args, **kwargs):
        return checkpoint(branch, *args, use_reentrant=False, **options, **kwargs)

    setattr(block, name, checkpointed)


def _forced_recompute_mm_shapes(model: nn.Module, fqns: list[str]) -> set[tuple[int, int]]:
    """The (in, out) weight shapes of the nn.Linear modules whose FQN contains an entry of `fqns`.

    The policy sees a matmul's weight shape, not its module, so an entry forces every matmul of
    its Linears' shapes: a user's entry whose shapes other Linears share is warned about, and a
    default entry (which names modules only some models have) leaves such shapes out (the
    DeepSeek debug model's square shared experts).

    Raises:
        ConfigError: an entry is empty (it would match every module), matches a non-Linear
            module, or matches no Linear inside the blocks AC wraps (`model.layers`); a default
            entry may match nothing.
    """
    default_fqns = ActivationCheckpoint().per_op_sac_force_recompute_mm_shapes_by_fqns
    key = "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns"
    names_by_shape = defaultdict(set)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            names_by_shape[module.in_features, module.out_features].add(name)
    shapes = set()
    for pattern in fqns:
        if not pattern.strip():
            raise ConfigError(f"'{key}' has an empty entry, which would match every module; remove it.")
        matches = [(n, m) for n, m in model.named_modules() if pattern in n]
        if not matches and pattern in default_fqns:
            continue
        non_linear = [(n, m) for n, m in matches if not isinstance(m, nn.Linear)]
        if non_linear:
            name, module = non_linear[0]
            raise ConfigError(
                f"'{key}' entry '{pattern}' matches {name} ({type(module).__name__}), not an "
                "nn.Linear; name Linear modules only (e.g. 'attention.wo', not 'attention')."
            )
        if not matches:
            raise ConfigError(
                f"'{key}' entry '{pattern}' matches no module of the model; give a substring of "
                "an nn.Linear's name inside a block (e.g. 'moe.router.gate')."
            )
        if not any(n.startswith("layers.") for n, _ in matches):
            raise ConfigError(
                f"'{key}' entry '{pattern}' matches only {', '.join(n for n, _ in matches[:3])}, "
                "outside the transformer blocks AC wraps (model.layers), so it would force nothing; "
                "give a substring of a Linear inside a block (e.g. 'moe.router.gate')."
            )
        matched = {n for n, _ in matches}
        named = {(m.in_features, m.out_features) for _, m in matches}
        if pattern in default_fqns:
            named = {shape for shape in named if names_by_shape[shape] <= matched}
        else:
            _warn_about_shared_shapes(key, pattern, named, names_by_shape, matched)
        shapes |= named
    return shapes


def _warn_about_shared_shapes(key, pattern, shapes, names_by_shape, matched) -> None:
    for shape in sorted(shapes):
        others = sorted(names_by_shape[shape] - matched)
        if others:
            _warn_once(
                f"'{key}' entry '{pattern}' forces every matmul of weight shape {shape}, so also "
                f"{len(others)} Linear(s) it does not name, e.g. {', '.join(others[:3])}: op-SAC "
                "tells matmuls apart by weight shape only."
            )


def _block_end_mm_shapes(model: nn.Module) -> frozenset:
    """The (in, out) weight shapes of the Linears in the blocks' last parts (`BLOCK_END_PARTS`)
    that no other Linear in the blocks has. A reduce-scatter that follows a matmul of one of
    these, with no other matmul between, is the sequence-parallel one that ends the block:
    after a dense feed-forward's w2, an MoE's shared experts' w2, or (routed experts run as
    grouped mm) an MoE router's gate. A shape that attention shares is left out, so its
    reduce-scatter, which the next norm's recompute reads, is never taken for the block's end."""
    end_part, elsewhere = set(), set()
    for name, module in model.layers.named_modules():
        if isinstance(module, nn.Linear):
            in_end_part = any(part in name.split(".") for part in BLOCK_END_PARTS)
            (end_part if in_end_part else elsewhere).add((module.in_features, module.out_features))
    return frozenset(end_part - elsewhere)


def _is_device_to_host_copy(func, args, kwargs) -> bool:
    return (
        func == _aten._to_copy.default
        and args[0].device.type != "cpu"
        and kwargs.get("device") == torch.device("cpu")
    )


def _mm_weight_shape(func, args) -> tuple[int, int] | None:
    """(in, out) of the weight of an mm (x @ W^T: an nn.Linear's matmul), else None."""
    if func == _aten.mm.default:
        return tuple(args[1].shape)
    return None


def _is_looped_expert_mm(func, args) -> bool:
    """A routed expert's matmul run in a loop (where grouped mm cannot run): its weight is a
    view of the experts' stacked 3-D weights."""
    if func != _aten.mm.default:
        return False
    base = args[1]._base
    return base is not None and base.dim() == 3


def _op_sac_policy(
    save_ops: frozenset, forced_mm_shapes: set, counts: dict, block_end_mm_shapes: set = frozenset()
):
    def policy(ctx, func, *args, **kwargs):
        if _is_device_to_host_copy(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        phase = "recompute" if ctx.is_recompute else "forward"
        if _is_looped_expert_mm(func, args):
            # Recomputed like grouped experts' matmuls, and kept out of the every-second-matmul
            # rule and of the block-end reduce-scatter's detection.
            return CheckpointPolicy.PREFER_RECOMPUTE
        weight_shape = _mm_weight_shape(func, args)
        if weight_shape is not None:
            counts[phase, "after block-end mm"] = weight_shape in block_end_mm_shapes
            if weight_shape in forced_mm_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[phase] += 1
            # Recomputing every second matmul halves their memory for half their time.
            if counts[phase] % 2 == 0:
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


def _full_ac_moe_policy(replay_all_to_all: bool):
    def policy(ctx, func, *args, **kwargs):
        if func in ROUTING_OPS or _is_device_to_host_copy(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
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
    policy = _full_ac_moe_policy(replay_all_to_all)
    return _selective_context_fn(lambda: policy, skip_all_to_all_inputs and replay_all_to_all)


def op_sac_context_fn(
    save_ops: frozenset,
    forced_mm_shapes: set = frozenset(),
    block_end_mm_shapes: set = frozenset(),
    skip_all_to_all_inputs: bool = False,
):
    """A `context_fn` for op-SAC; each checkpointed call gets fresh matmul counters, shared
    by its forward and its recompute so that both make the same choices. The reduce-scatter
    right after a matmul of `block_end_mm_shapes` is not saved: give them only under
    `early_stop` (the checkpoint's), which never recomputes it; without, recompute would
    re-issue it. `skip_all_to_all_inputs` (only when `save_ops` holds the all-to-all): see
    `all_to_all_input`."""

    def new_policy():
        return _op_sac_policy(save_ops, forced_mm_shapes, defaultdict(int), block_end_mm_shapes)

    skip = skip_all_to_all_inputs and _c10d.all_to_all_single.default in save_ops
    return _selective_context_fn(new_policy, skip)


def _selective_context_fn(new_policy, skip_all_to_all_inputs: bool):
    def context_fn():
        forward, recompute = create_selective_checkpoint_contexts(new_policy())
        if skip_all_to_all_inputs:
            recompute = _skipping_all_to_all_inputs(recompute)
        return forward, recompute

    return context_fn


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
    does nothing. `apply_ac` turns it on per block only when a module of the block sets
    `output_feeds_all_to_all` (as `apply_expert_parallel` does for the routed experts).

    Pitfalls: mark only matmuls whose output reaches nothing but that all-to-all (through
    reindexing at most); anything else reading it in a recompute would read garbage. The
    recompute of such a block passes each op through one more Python dispatch mode, a few
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


def _output_feeds_all_to_all(block: nn.Module) -> bool:
    return any(getattr(m, "output_feeds_all_to_all", False) for m in block.modules())


def _wrap_child(block: nn.Module, name: str, wrap) -> str:
    child = getattr(block, name)
    block.register_module(name, wrap(child))
    return name


def _apply_op_sac_to_block(block, ac_config, context_fn, use_flex_attn, model_compile_enabled):
    """Wrap one block for op-SAC; returns what was wrapped, for the log.

    flex_attention is itself a compiled higher-order op. Under SAC without compile its
    saved outputs would be recomputed eagerly, so the attention branch gets full AC and only
    the feed-forward/MoE branch gets SAC, each branch with its norm (`DecoderBlock`'s
    `attention_branch` and `mlp_branch`), so that no norm tensor is held between the regions.
    With compile on, an MoE block's data-dependent routing breaks the block's graph, so its
    attention and MoE are wrapped as separate regions.
    """
    sac = lambda m: _checkpoint(m, ac_config, context_fn)  # noqa: E731
    ffn_name = "moe" if hasattr(block, "moe") else "feed_forward"
    if use_flex_attn and not model_compile_enabled:
        _warn_once(
            "flex_attention with per-op SAC and compile off: the attention branch (its norm "
            f"included) gets full AC and the {ffn_name} branch gets SAC, so that SAC does not "
            "discard flex_attention's compile. Enable compile to keep attention under SAC."
        )
        _checkpoint_branch(block, "attention_branch", ac_config)
        _checkpoint_branch(block, "mlp_branch", ac_config, context_fn)
        return block, f"attention branch full + {ffn_name} branch op-SAC (norms inside)"
    if use_flex_attn and model_compile_enabled and hasattr(block, "moe"):
        _warn_once(
            "flex_attention with per-op SAC, compile on and MoE blocks: attention and moe "
            "are checkpointed as separate SAC regions, since routing splits the block's graph."
        )
        _wrap_child(block, "attention", sac)
        _wrap_child(block, "moe", sac)
        return block, "attention op-SAC + moe op-SAC"
    return sac(block), "op-SAC"


def apply_ac(
    model: nn.Module,
    ac_config: ActivationCheckpoint,
    *,
    model_compile_enabled: bool = False,
    use_flex_attn: bool = False,
    op_sac_save_list: frozenset | set | None = None,
    base_folder: str = "",
    compile_backend: str = "inductor",
) -> None:
    """Apply `[activation_checkpoint]` to every block in `model.layers`, in place.

    Args:
        model: has `layers`, a ModuleDict or ModuleList of transformer blocks.
        ac_config: the `[activation_checkpoint]` section (`ActivationCheckpoint`).
        model_compile_enabled: whether blocks will be compiled; memory_budget requires it,
            and it changes how op-SAC treats flex-attention blocks.
        use_flex_attn: whether attention runs flex_attention.
        op_sac_save_list: ops whose outputs op-SAC saves; default `DEFAULT_SAVE_LIST`.
        base_folder: where memory_budget writes its pareto plot (the dump folder).
        compile_backend: the torch.compile backend of the blocks; memory_budget needs one of
            `torchtitan.config.validation.MEMORY_BUDGET_BACKENDS`.

    Pitfalls: call after tensor parallelism and before torch.compile and FSDP, so that the
    checkpoint sees the collectives TP adds and FSDP's hooks stay outside it. Models with
    dropout need `preserve_rng_state = true`, or recompute draws different masks. Every mode
    sets torch's process-wide partitioner budget (`activation_memory_budget`, 1.0 = none
    outside memory_budget), which compiles read when they happen: build and compile (first
    step) one model before applying AC to another with a different budget.

    Raises:
        ConfigError: for an invalid setting or one the rest of the config cannot support.
    """
    check_activation_checkpoint(ac_config, model_compile_enabled, compile_backend)
    _refuse_debug_with_moe_blocks(ac_config, model)
    if ac_config.mode == "memory_budget":
        _apply_memory_budget(ac_config, base_folder)
        return
    # The partitioner's budget is process-wide and read when a block compiles: left at a
    # previous model's memory_budget, it would override this model's policy (at 0, compiled
    # op-SAC recomputes everything).
    torch._functorch.config.activation_memory_budget = 1.0
    if ac_config.mode == "none":
        return
    is_op_sac = ac_config.mode == "selective" and ac_config.selective_ac_option == "op"
    every = int(ac_config.selective_ac_option) if ac_config.mode == "selective" and not is_op_sac else 1
    if is_op_sac:
        fqns = ac_config.per_op_sac_force_recompute_mm_shapes_by_fqns
        shapes = _forced_recompute_mm_shapes(model, fqns)
        block_end_shapes = _block_end_mm_shapes(model) if ac_config.early_stop else frozenset()
        save_ops = DEFAULT_SAVE_LIST if op_sac_save_list is None else frozenset(op_sac_save_list)
        context_fn = op_sac_context_fn(save_ops, shapes, block_end_shapes)
        skipping_context_fn = op_sac_context_fn(save_ops, shapes, block_end_shapes, not model_compile_enabled)
    full_kind = "full AC" if every == 1 else f"full AC on one block in {every}"
    blocks_by_kind: dict[str, list[str]] = defaultdict(list)
    for index, (name, block) in enumerate(list(model.layers.named_children())):
        if index % every:
            continue
        feeds_all_to_all = _output_feeds_all_to_all(block)
        if is_op_sac:
            block, kind = _apply_op_sac_to_block(
                block,
                ac_config,
                skipping_context_fn if feeds_all_to_all else context_fn,
                use_flex_attn,
                model_compile_enabled,
            )
        elif hasattr(block, "moe"):
            replay = ac_config.full_ac_all_to_all == "replay"
            skip = feeds_all_to_all and not model_compile_enabled
            block = _checkpoint(block, ac_config, full_ac_moe_context_fn(replay, skip))
            kind = f"{full_kind} (MoE: routing saved, all-to-alls {ac_config.full_ac_all_to_all})"
        else:
            block, kind = _checkpoint(block, ac_config), full_kind
        model.layers.register_module(name, block)
        blocks_by_kind[kind].append(name)
    described = "; ".join(
        f"{kind} on {len(names)}/{len(model.layers)} blocks: {', '.join(names)}"
        for kind, names in blocks_by_kind.items()
    )
    logger.info(
        f"Activation checkpointing: mode {ac_config.mode}"
        + (f" ({ac_config.selective_ac_option})" if ac_config.mode == "selective" else "")
        + f", {described}"
        + (", recompute check off" if ac_config.determinism_check == "none" else "")
        + (", debug traces on (slower)" if ac_config.debug else "")
    )


def _apply_memory_budget(ac_config: ActivationCheckpoint, base_folder: str) -> None:
    torch._functorch.config.activation_memory_budget = ac_config.memory_budget
    # Under tensor parallelism the compiled graphs take the DeviceMesh as an input (an opaque
    # object on recent torch), and the budgeted partitioner refuses to size it ("Cannot compute
    # the size of FakeScriptObject"). A mesh holds no tensor memory, so zero is its size.
    if hasattr(torch._functorch.config, "unsafe_treat_script_objects_as_zero_size"):
        torch._functorch.config.unsafe_treat_script_objects_as_zero_size = True
    if ac_config.visualize_memory_budget_pareto:
        torch._functorch.config.visualize_memory_budget_pareto = True
        torch._functorch.config.memory_budget_pareto_dir = base_folder or "."
    logger.info(
        f"Activation checkpointing: mode memory_budget ({ac_config.memory_budget}) through "
        "torch.compile's partitioner; no block is wrapped"
    )
