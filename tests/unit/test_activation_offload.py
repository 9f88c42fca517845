"""Activation offload (`[activation_checkpoint] offload = "saved"`): numerics, the bytes that leave
the device per block, prefetch order, the host pool, and refused settings. On the CPU the copies
are synchronous and "host" is the offloader's pool, apart from what autograd holds."""

import gc
from dataclasses import replace

import pytest
import torch

from tests.model_testing import init_on_cpu, next_token_loss_and_grads, tiny_deepseek_v3
from torchtitan.config import ActivationCheckpoint, ConfigError
from torchtitan.distributed.activation_checkpoint import (
    ACFacts,
    apply_ac,
    parse_offload_blocks,
    plan_activation_checkpointing,
)
from torchtitan.distributed.activation_offload import OffloadedTensor
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import LLAMA3_SAVE_LIST
from torchtitan.tools.activation_memory import bytes_held_for_backward

ARGS = replace(llama3_flavors["debugmodel"], max_seq_len=64, n_layers=4)
# Every activation of the debug model at this size is 32 KiB or more; the routing is smaller.
MIN_BYTES = 1024
MODES = {
    "none": ActivationCheckpoint(mode="none"),
    "full": ActivationCheckpoint(mode="full"),
    "selective 2": ActivationCheckpoint(mode="selective", selective_ac_option="2"),
    "op-SAC": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
}


def _offloading(ac: ActivationCheckpoint, blocks: str = "all") -> ActivationCheckpoint:
    return replace(ac, offload="saved", offload_blocks=blocks, offload_min_bytes=MIN_BYTES)


def _model(ac: ActivationCheckpoint):
    with torch.device("meta"):
        model = Transformer(ARGS)
    plan = apply_ac(model, ac, op_sac_save_list=LLAMA3_SAVE_LIST)
    return init_on_cpu(model), plan


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, 65), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def no_ac():
    model, _ = _model(MODES["none"])
    return next_token_loss_and_grads(model, _tokens())


@pytest.mark.parametrize("mode", MODES)
def test_offload_gives_the_no_ac_loss_and_gradients_bit_for_bit(mode, no_ac):
    model, plan = _model(_offloading(MODES[mode]))
    loss, grads = next_token_loss_and_grads(model, _tokens())
    want_loss, want_grads = no_ac
    assert sum(plan.offloader.bytes_by_block.values()) > 0
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


@pytest.mark.parametrize("mode", ["full", "op-SAC"])
def test_offload_of_moe_blocks_gives_the_gradients_without_offload_bit_for_bit(mode):
    def run(ac):
        model = tiny_deepseek_v3()
        plan = apply_ac(model, ac)
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
        return next_token_loss_and_grads(model, tokens), plan

    (want_loss, want_grads), _ = run(MODES[mode])
    (loss, grads), plan = run(replace(_offloading(MODES[mode]), offload_min_bytes=0))
    assert sum(plan.offloader.bytes_by_block.values()) > 0
    assert torch.equal(loss, want_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


@pytest.mark.parametrize("mode", MODES)
def test_device_bytes_held_for_backward_drop_by_the_bytes_each_block_offloads(mode):
    tokens = _tokens()[:, :-1]
    baseline, _ = _model(MODES[mode])
    held_without = bytes_held_for_backward(baseline, tokens)
    for block in range(ARGS.n_layers):
        model, plan = _model(_offloading(MODES[mode], blocks=str(block)))
        # A first step fills the pool, whose buffers the measured forward then reuses: what is
        # measured is the device side alone.
        next_token_loss_and_grads(model, _tokens())
        held_with = bytes_held_for_backward(
            model, tokens, elsewhere=plan.offloader.pool.free_buffer_tensors()
        )
        offloaded = dict(plan.offloader.bytes_by_block)
        assert set(offloaded) == {block}
        assert offloaded[block] > 0
        assert held_without - held_with == offloaded[block], (block, held_without, held_with, offloaded)


def test_what_each_mode_offloads_is_what_it_holds_for_backward():
    per_block = {}
    for mode in ("none", "full", "op-SAC"):
        model, plan = _model(_offloading(MODES[mode], blocks="1"))
        next_token_loss_and_grads(model, _tokens())
        per_block[mode] = plan.offloader.bytes_by_block[1]
    hidden_states = 2 * 64 * ARGS.dim * 4
    assert per_block["full"] == hidden_states  # the block's input, nothing else
    assert hidden_states < per_block["op-SAC"] < per_block["none"]


def test_backward_brings_each_block_back_one_block_ahead():
    model, plan = _model(_offloading(MODES["full"]))
    next_token_loss_and_grads(model, _tokens())
    backward = [event for event in plan.offloader.log if event[0] != "offload"]
    last = ARGS.n_layers - 1
    want = [("backward", last), ("prefetch", last), ("prefetch", last - 1)]
    for block in range(last - 1, 0, -1):
        want += [("backward", block), ("prefetch", block - 1)]
    want += [("backward", 0)]
    assert backward == want


def test_every_host_buffer_returns_to_the_pool_after_backward():
    model, plan = _model(_offloading(MODES["op-SAC"]))
    next_token_loss_and_grads(model, _tokens())
    pool = plan.offloader.pool
    assert pool.bytes_allocated > 0
    assert pool.bytes_in_use == 0
    assert pool.free_buffers > 0


def test_a_checkpoint_that_stops_early_still_returns_the_buffers_it_never_read():
    ac = replace(_offloading(MODES["op-SAC"]), early_stop=True)
    model, plan = _model(ac)
    next_token_loss_and_grads(model, _tokens())
    gc.collect()
    assert plan.offloader.pool.bytes_in_use == 0


def _live_objects() -> tuple[int, int]:
    """(live tensors, live offload handles), after a collection."""
    gc.collect()
    objects = gc.get_objects()
    tensors = sum(isinstance(o, torch.Tensor) for o in objects)
    return tensors, sum(isinstance(o, OffloadedTensor) for o in objects)


def test_twenty_steps_keep_live_tensors_and_pool_buffers_flat():
    model, plan = _model(_offloading(MODES["op-SAC"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counted, allocated = [], []
    for step in range(1, 21):
        next_token_loss_and_grads(model, _tokens(step))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        allocated.append(plan.offloader.pool.bytes_allocated)
        if step in (2, 8, 14, 20):  # a pass over every object is slow in a long test session
            counted.append(_live_objects())
    tensors, handles = zip(*counted)
    # The first step allocates the pool and the optimizer's state; from the second on, nothing
    # grows (the count may fall as other tests' garbage is collected, never rise).
    assert max(tensors) == tensors[0], tensors
    assert len(set(allocated)) == 1, allocated
    assert set(handles) == {0}
    assert plan.offloader.pool.bytes_in_use == 0


def test_offload_blocks_names_single_blocks_and_ranges():
    assert parse_offload_blocks("all") == frozenset()
    assert parse_offload_blocks("0-2, 5") == {0, 1, 2, 5}


@pytest.mark.parametrize("spec", ["", "first", "3-1", "-2", "1,,2"])
def test_a_malformed_offload_blocks_is_refused_with_the_syntax(spec):
    with pytest.raises(ConfigError, match=r"'activation_checkpoint.offload_blocks' = .* \"0-3,8\""):
        plan_activation_checkpointing(_offloading(MODES["full"], blocks=spec), ACFacts())


def test_offload_with_memory_budget_is_refused_naming_the_modes_that_work():
    ac = _offloading(ActivationCheckpoint(mode="memory_budget"))
    with pytest.raises(
        ConfigError, match=r"mode = 'memory_budget'.*Use mode \"none\", \"full\" or \"selective\""
    ):
        plan_activation_checkpointing(ac, ACFacts(compile_enabled=True))


def test_offload_of_compiled_blocks_is_refused():
    with pytest.raises(ConfigError, match=r"compile.enable.*Set compile.enable = false"):
        plan_activation_checkpointing(_offloading(MODES["op-SAC"]), ACFacts(compile_enabled=True))


def test_offload_under_a_zero_bubble_schedule_is_refused_naming_the_schedules_that_work():
    with pytest.raises(ConfigError, match=r"zero-bubble.*\"1F1B\" or \"Interleaved1F1B\""):
        plan_activation_checkpointing(_offloading(MODES["full"]), ACFacts(split_backward=True))


def test_the_plan_logs_which_blocks_offload(caplog):
    with caplog.at_level("INFO"):
        _model(_offloading(MODES["full"], blocks="0,2"))
    assert "offload of saved tensors of 1 KiB or more on 2/4 blocks: 0, 2" in caplog.text


def test_a_forward_without_backward_frees_what_it_offloaded():
    model, _ = _model(_offloading(MODES["none"]))
    out = model(_tokens()[:, :-1])
    del out
    assert _live_objects()[1] == 0
