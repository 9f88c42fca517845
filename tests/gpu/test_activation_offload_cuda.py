"""Activation offload on a CUDA GPU: the asynchronous path (side streams, pinned pool buffers,
events) that the CPU suite cannot run. The gradients equal those without offload, the device
memory held for backward drops by the offloaded bytes, and the pool stops growing after the
first step. Marked `gpu`; skipped without CUDA (`scripts/gpu_check.sh` runs it)."""

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from torchtitan.config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallelize import LLAMA3_SAVE_LIST

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU"
        + (" (hidden from this session)" if os.environ.get("CUDA_VISIBLE_DEVICES") == "" else ""),
    ),
]
CUDA = torch.device("cuda")
ARGS = replace(llama3_flavors["debugmodel"], max_seq_len=1024)
MODES = {
    "none": ActivationCheckpoint(mode="none"),
    "full": ActivationCheckpoint(mode="full"),
    "op-SAC": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
}


def _model(ac: ActivationCheckpoint):
    with torch.device("meta"):
        model = Transformer(ARGS)
    plan = apply_ac(model, ac, op_sac_save_list=LLAMA3_SAVE_LIST)
    model.to_empty(device=CUDA)
    torch.manual_seed(0)
    model.init_weights()
    return model, plan


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, ARGS.vocab_size, (4, 1025), generator=generator).to(CUDA)


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _grads(model, tokens) -> dict[str, torch.Tensor]:
    _loss(model, tokens).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("mode", MODES)
def test_offload_on_cuda_gives_the_gradients_without_offload(mode):
    tokens = _tokens()
    want = _grads(_model(MODES[mode])[0], tokens)
    model, plan = _model(replace(MODES[mode], offload="saved", offload_min_bytes=2**16))
    for _ in range(2):  # the second step reuses the pool's buffers
        got = _grads(model, tokens)
        # Kernels may sum in another order run to run (attention's backward); a copy read before
        # it arrived, or a buffer overwritten before it was read, is off by far more.
        for name, grad in got.items():
            error = (grad - want[name]).norm() / want[name].norm()
            assert error < 1e-5, (name, error.item())
    assert plan.offloader.pool.bytes_in_use == 0
    assert sum(plan.offloader.bytes_by_block.values()) > 0


def test_offload_on_cuda_lowers_the_memory_held_for_backward_by_what_it_offloads():
    tokens = _tokens()
    held = {}
    for name, ac in (("without", MODES["op-SAC"]), ("with", replace(MODES["op-SAC"], offload="saved"))):
        model, plan = _model(ac)
        _grads(model, tokens)  # fills the pool
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = _loss(model, tokens)
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - before
        offloaded = sum(plan.offloader.bytes_by_block.values()) if plan.offloader else 0
        loss.backward()
        del model, loss
    # The allocator rounds each block up, so the drop is at least most of the offloaded bytes.
    assert held["without"] - held["with"] >= 0.9 * offloaded > 0, (held, offloaded)


def test_the_pinned_pool_stops_growing_after_the_first_step():
    model, plan = _model(replace(MODES["op-SAC"], offload="saved"))
    tokens = _tokens()
    allocated = []
    for _ in range(4):
        _grads(model, tokens)
        allocated.append(plan.offloader.pool.bytes_allocated)
    assert allocated[0] > 0
    assert len(set(allocated)) == 1, allocated
    assert all(buffer.is_pinned() for buffer in plan.offloader.pool.free_buffer_tensors())
