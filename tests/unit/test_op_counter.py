"""OpCounter: the one dispatch-mode counter behind the tests' and benchmarks' op counts."""

import torch
from torch.utils.checkpoint import checkpoint

from torchtitan.tools.op_counter import BACKWARD, FORWARD, OpCounter, collectives, ops

MM = torch.ops.aten.mm.default


def _weights():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=generator, requires_grad=True)
    w = torch.randn(8, 3, generator=generator, requires_grad=True)
    return x, w


def _step(counter: OpCounter, forward) -> None:
    with counter:
        out = forward()
        counter.start_backward()
        out.sum().backward()


def test_a_matmul_counts_once_in_forward_and_its_two_gradients_in_backward_with_grad_mode_off():
    x, w = _weights()
    counter = OpCounter(ops(MM))
    _step(counter, lambda: x @ w)
    assert counter.count("mm", phase=FORWARD, grad_enabled=True) == 1
    assert counter.count("mm", phase=BACKWARD, grad_enabled=False) == 2
    assert counter.count("mm", phase=BACKWARD, grad_enabled=True) == 0


def test_a_checkpointed_matmul_is_counted_again_in_backward_with_grad_mode_on():
    x, w = _weights()
    counter = OpCounter(ops(MM))
    # sin saves its input, the matmul's output: backward recomputes the matmul to get it.
    _step(counter, lambda: checkpoint(lambda a, b: torch.sin(a @ b), x, w, use_reentrant=False))
    assert counter.count("mm", phase=BACKWARD, grad_enabled=True) == 1
    assert counter.count("mm", phase=BACKWARD, grad_enabled=False) == 2


def test_each_call_records_its_first_tensor_arguments_size():
    x, w = _weights()
    with OpCounter(ops(MM)) as counter:
        x @ w
    (call,) = counter.calls
    assert (call.name, call.numel, call.nbytes) == ("mm", 32, 32 * 4)


def test_labelled_selectors_record_a_call_under_the_first_label_that_picks_it():
    x, w = _weights()
    labelled = {"matmul": ops(MM), "matmul or relu": ops(MM, torch.ops.aten.relu.default)}
    with OpCounter(labelled) as counter:
        (x @ w).relu()
    assert counter.counts_by_name() == {"matmul": 1, "matmul or relu": 1}


def test_ops_outside_the_selector_are_not_recorded():
    x, w = _weights()
    with OpCounter(collectives) as counter:
        (x @ w).relu()
    assert counter.calls == []
