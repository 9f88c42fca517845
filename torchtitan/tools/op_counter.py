"""Count the ops a forward and backward dispatch, split by phase: the instrument behind the
tests' and benchmarks' claims about recompute and communication (which collectives backward
issues, which kernels a recompute reruns).

Pitfalls, which is why every counter goes through this one class:
- Enter `OpCounter` before the forward and call `start_backward()` before `backward()`: a
  dispatch mode entered only for backward can break selective-AC recompute (FlopCounterMode
  does on torch 2.13).
- It cannot see inside torch.compile'd code, whose kernels run without dispatching.
- Under selective AC a saved op is not dispatched again in backward, so it is not counted
  there; that is what lets a test tell a saved op from a recomputed one.
"""

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

FORWARD, BACKWARD = "forward", "backward"

Selector = Callable[[torch._ops.OpOverload, tuple], bool]


@dataclass(frozen=True)
class OpCall:
    """One recorded op call. `numel`/`nbytes` are its first tensor argument's (0 if none)."""

    name: str  # the op packet's name, say "all_reduce" or "_grouped_mm", or its selector's label
    phase: str
    grad_enabled: bool  # on in forward and in a recompute, off for the gradients' own ops
    numel: int
    nbytes: int


def every_op(func, args) -> bool:
    return True


def collectives(func, args) -> bool:
    """The functional collectives (all-reduce, reduce-scatter, all-gather, all-to-all...),
    without the `wait_tensor` that completes each."""
    return func.namespace == "_c10d_functional" and func.overloadpacket.__name__ != "wait_tensor"


def ops(*overloads: torch._ops.OpOverload) -> Selector:
    """A selector of exactly `overloads`."""
    wanted = frozenset(overloads)
    return lambda func, args: func in wanted


class OpCounter(TorchDispatchMode):
    """Records each op that `select(func, args)` picks, with its phase and grad mode.

    Args:
        select: which ops to record (default: all), or a dict of labels to selectors, in
            which case each call is recorded under the first label whose selector picks it.
            Keep it narrow for long runs: every recorded call is kept.

    Example::

        with OpCounter(collectives) as counter:
            loss = model(tokens).sum()
            counter.start_backward()
            loss.backward()
        counter.count("all_reduce", phase=BACKWARD)
    """

    def __init__(self, select: Selector | dict[str, Selector] = every_op):
        super().__init__()
        self.labelled = select if isinstance(select, dict) else None
        self.select, self.phase, self.calls = select, FORWARD, []

    def start_backward(self) -> None:
        """Tag the ops dispatched from now on as backward's."""
        self.phase = BACKWARD

    def _name(self, func, args) -> str | None:
        if self.labelled is None:
            return func.overloadpacket.__name__ if self.select(func, args) else None
        return next((label for label, select in self.labelled.items() if select(func, args)), None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = self._name(func, args)
        if name is not None:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            numel = 0 if first is None else first.numel()
            nbytes = 0 if first is None else numel * first.element_size()
            self.calls.append(OpCall(name, self.phase, torch.is_grad_enabled(), numel, nbytes))
        return func(*args, **(kwargs or {}))

    def matching(self, name: str | None = None, *, phase: str | None = None,
                 grad_enabled: bool | None = None) -> list[OpCall]:  # fmt: skip
        """The recorded calls of op `name` (any if None) in `phase` (any if None) with grad
        mode `grad_enabled` (either if None)."""
        return [
            call
            for call in self.calls
            if (name is None or call.name == name)
            and (phase is None or call.phase == phase)
            and (grad_enabled is None or call.grad_enabled == grad_enabled)
        ]

    def count(self, name: str | None = None, *, phase: str | None = None,
              grad_enabled: bool | None = None) -> int:  # fmt: skip
        """How many recorded calls match (see `matching`)."""
        return len(self.matching(name, phase=phase, grad_enabled=grad_enabled))

    def counts_by_name(self, *, phase: str | None = None) -> dict[str, int]:
        """Recorded calls per op name, in `phase` (any if None)."""
        counts: dict[str, int] = {}
        for call in self.matching(phase=phase):
            counts[call.name] = counts.get(call.name, 0) + 1
        return counts


# Where `RecomputeCost` tags a block's autograd nodes with the block's index.
_BLOCK_KEY = "torchtitan.recompute_cost.block"
# Marks a node under which a recompute ran.
_RERAN = "torchtitan.recompute_cost.reran"


class RecomputeCost(TorchDispatchMode):
    """Per block, what activation checkpointing costs it in one step.

    An op is a recompute when it runs inside backward (an autograd graph task) with grad mode
    on (the gradients' own ops run with it off). It counts for the block whose forward made
    the autograd node backward is running: every node a block's forward makes is tagged with
    the block's index, so a recompute is found whether the checkpoint reruns whole modules
    (full AC, op-SAC) or a bare function (a cheap region's `forward`). What SAC replays from
    its cache is not dispatched again, so it does not count.

    Per block index, once backward ran:
        flops: FLOPs recomputed, by torch's formulas (`torch.utils.flop_counter`), at the
            shapes of this rank's shards for a DTensor op.
        memory_bytes: bytes written by recomputed ops that have no FLOP formula and are neither
            views nor collectives (element-wise work and copies: their time is the memory's,
            not the math units').
        ops: ops recomputed.
        step_flops, step_memory_bytes, step_ops: the same for everything the block runs in the
            step: its forward, its backward and its recompute (what AC adds to, and what can
            hide a host cost).
        runs: checkpointed regions rerun, each counted at the autograd node that first asked
            for what the region saved.
        sac_ops: ops that pass through SAC's Python dispatch mode, in forward and in its
            recompute (twice the forward's ops of a block run under SAC), each paying the
            policy's host cost whether saved or not.

    Args:
        blocks: block index -> module.
        in_sac: tells whether the forward runs under SAC now (the AC module's
            `in_selective_checkpoint`, which this layer cannot import); without it no op counts
            as SAC's.

    Pitfall: enter it before the forward, as `OpCounter` (a dispatch mode entered only for
    backward breaks selective-AC recompute).
    """

    def __init__(self, blocks: dict[int, torch.nn.Module], in_sac: Callable[[], bool] = lambda: False):
        super().__init__()
        self.in_sac = in_sac
        self.top = {block: index for index, block in blocks.items()}
        self.owner = {module: index for index, block in blocks.items() for module in block.modules()}
        self.running: list[int] = []
        self.under_sac: set[int] = set()
        self.flops: dict[int, int] = defaultdict(int)
        self.memory_bytes: dict[int, int] = defaultdict(int)
        self.ops: dict[int, int] = defaultdict(int)
        self.step_flops: dict[int, int] = defaultdict(int)
        self.step_memory_bytes: dict[int, int] = defaultdict(int)
        self.step_ops: dict[int, int] = defaultdict(int)
        self.runs: dict[int, int] = defaultdict(int)
        self.sac_ops: dict[int, int] = defaultdict(int)

    def __enter__(self):
        self._hooks = [
            register_module_forward_pre_hook(self._enter_module),
            register_module_forward_hook(self._leave_module, always_call=True),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def _in_backward(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def _enter_module(self, module, args) -> None:
        if module not in self.owner or self._in_backward():
            return
        index = self.owner[module]
        if module in self.top:
            self.running.append(index)
        if self.in_sac():
            self.under_sac.add(index)

    def _leave_module(self, module, args, output) -> None:
        # Called also when a forward raised, so that the stack stays balanced.
        if module not in self.top or self._in_backward() or not self.running:
            return
        index = self.running.pop()
        _tag_graph(output, index)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._in_backward():
            if self.running:
                index = self.running[-1]
                self._tally(index, func, args, kwargs, out, recomputed=False)
                if index in self.under_sac and torch.is_grad_enabled():
                    self.sac_ops[index] += 2
            return out
        node = torch._C._current_autograd_node()
        index = None if node is None else node.metadata.get(_BLOCK_KEY)
        if index is None:
            return out
        recomputed = torch.is_grad_enabled()
        if recomputed and _RERAN not in node.metadata:
            # A checkpoint reruns its region when a node first unpacks what it saved.
            node.metadata[_RERAN] = True
            self.runs[index] += 1
        self._tally(index, func, args, kwargs, out, recomputed)
        return out

    def work_per_block(self) -> dict[int, tuple[int, int, int, int, int]]:
        """Per block, every block included: (step FLOPs, step element-wise bytes, host ops: the
        step's ops plus SAC's, region reruns, recomputed FLOPs); the fields of the planner's
        `BlockWork`."""
        return {
            index: (self.step_flops[index], self.step_memory_bytes[index],
                    self.step_ops[index] + self.sac_ops[index], self.runs[index], self.flops[index])
            for index in self.top.values()
        }  # fmt: skip

    def _tally(self, index: int, func, args, kwargs, out, recomputed: bool) -> None:
        formula = _flop_formula(func)
        flops = memory_bytes = 0
        if formula is not None:
            local_args, local_kwargs, local_out = tree_map(_local, (args, kwargs, out))
            flops = formula(*local_args, **local_kwargs, out_val=local_out)
        elif not func.is_view and func.namespace not in _COLLECTIVE_NAMESPACES:
            local = [_local(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            memory_bytes = sum(t.numel() * t.element_size() for t in local)
        self.step_flops[index] += flops
        self.step_memory_bytes[index] += memory_bytes
        self.step_ops[index] += 1
        if recomputed:
            self.flops[index] += flops
            self.memory_bytes[index] += memory_bytes
            self.ops[index] += 1


# Communication, not memory-bound work.
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "_dtensor")


# The CPU's fused attention has no FLOP formula in torch; it does the work of the GPU's flash
# kernel, whose formula reads only the shapes of q, k and v (its first three arguments).
_aten = torch.ops.aten
_FORMULA_OF = {_aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention}


def _flop_formula(func):
    return flop_registry.get(_FORMULA_OF.get(func.overloadpacket, func.overloadpacket))


def _tag_graph(output, index: int) -> None:
    """Tag the autograd nodes behind `output` with block `index`, back to the nodes an earlier
    block tagged (or the graph's leaves)."""
    stack = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or _BLOCK_KEY in node.metadata:
            continue
        node.metadata[_BLOCK_KEY] = index
        stack.extend(next_node for next_node, _ in node.next_functions)


def _local(value):
    """A DTensor's shard (what this rank computes on), anything else as it is."""
    return value._local_tensor if isinstance(value, DTensor) else value
