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
from torch.utils._pytree import tree_map
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


class RecomputeFlops(TorchDispatchMode):
    """Per block, the FLOPs of what activation checkpointing recomputes in backward.

    An op is a recompute when it runs inside backward (an autograd graph task) with grad mode
    on (the gradients' own ops run with it off), within the forward of one of a block's modules;
    it counts for that block. What SAC replays from its cache is not dispatched again, so it
    does not count. FLOPs come from torch's formulas (`torch.utils.flop_counter`), at the shapes
    of this rank's shards for a DTensor op: this rank's FLOPs, where FlopCounterMode would count
    the op's global shapes.

    Args:
        blocks: block index -> module.

    Pitfall: enter it before the forward, as `OpCounter` (a dispatch mode entered only for
    backward breaks selective-AC recompute). `flops` holds the totals once backward ran.
    """

    def __init__(self, blocks: dict[int, torch.nn.Module]):
        super().__init__()
        self.owner = {module: index for index, block in blocks.items() for module in block.modules()}
        self.running: list[int] = []
        self.flops: dict[int, int] = defaultdict(int)

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

    def _enter_module(self, module, args) -> None:
        if module in self.owner:
            self.running.append(self.owner[module])

    def _leave_module(self, module, args, output) -> None:
        # Called also when the forward raised (a checkpoint's early stop ends its recompute so).
        if module in self.owner and self.running:
            self.running.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        recomputing = torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
        formula = flop_registry.get(func.overloadpacket)
        if self.running and recomputing and formula is not None:
            local_args, local_kwargs, local_out = tree_map(_local, (args, kwargs, out))
            self.flops[self.running[-1]] += formula(*local_args, **local_kwargs, out_val=local_out)
        return out


def _local(value):
    """A DTensor's shard (what this rank computes on), anything else as it is."""
    return value._local_tensor if isinstance(value, DTensor) else value
