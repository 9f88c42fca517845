"""`forward_backward`, the step's micro-batch: its losses, the model's extra (MoE auxiliary)
loss included, are scaled so that accumulated micro-batches give one full batch's gradients."""

from dataclasses import replace

import torch

from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.loss_head import ChunkedLoss
from torchtitan.components.training_step import forward_backward
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.moe import pop_aux_loss
from torchtitan.models.qwen3 import qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3Model

SEQ_LEN = 32


def _gradients(micro_batches: int) -> dict[str, torch.Tensor]:
    args = qwen3_flavors["debugmodel_moe"]
    args = replace(
        args, n_layers=2, max_seq_len=SEQ_LEN, moe_args=replace(args.moe_args, seq_aux_loss_coeff=0.1)
    )
    torch.manual_seed(0)
    model = Qwen3Model(args)
    model.init_weights()
    tokens = torch.randint(0, 2048, (4, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    cfg = parse_args(["--config", "qwen3_debug_model_moe.toml", "--training.seq_len", str(SEQ_LEN)], env={})
    for inputs, labels in zip(tokens[:, :-1].chunk(micro_batches), tokens[:, 1:].chunk(micro_batches)):
        forward_backward(model, ChunkedLoss(cross_entropy_loss, 4), inputs, labels, micro_batches,
                         ParallelDims(1, 1, 1, 1), cfg, extra_loss_fn=pop_aux_loss)  # fmt: skip
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_two_accumulated_micro_batches_with_the_moe_aux_loss_give_the_full_batchs_gradients():
    full, accumulated = _gradients(1), _gradients(2)
    router = [name for name in full if "router" in name or "gate" in name]
    assert router and all(full[name].abs().sum() > 0 for name in router)  # the aux loss reaches them
    assert full.keys() == accumulated.keys()
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], rtol=1e-4, atol=1e-6, msg=name)
