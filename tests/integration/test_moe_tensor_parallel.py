"""Tensor parallelism for MoE models and multi-head latent attention (CPU, gloo): every gradient
of TP 2 equals one process's, under each AC mode, and the backward's collectives. (Training
through the trainer under these layouts is test_layout_parity.py's.)

Run as a script under torchrun (2 processes), this file is also the gradient worker
(`run_worker` launches it).
"""

import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.integration.workers import run_worker, shut_down
from tests.model_testing import init_on_cpu, next_token_loss_and_grads
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import loss_context
from torchtitan.models import get_train_spec
from torchtitan.tools.op_counter import BACKWARD, OpCounter, collectives

pytestmark = pytest.mark.integration

# name: (model, flavor, overrides of the flavor's args)
MODELS = {
    "qwen3 moe": ("qwen3", "debugmodel_moe", {}),
    "deepseek_v3": ("deepseek_v3", "debugmodel", {}),
    "deepseek_v3 with q_lora": ("deepseek_v3", "debugmodel", {"q_lora_rank": 32}),
}
AC_MODES = {"none": ("none", "2"), "full": ("full", "2"), "selective op": ("selective", "op")}
GRAD_RTOL = 1e-5  # of each gradient's largest entry


@pytest.fixture(scope="module")
def gradient_report():
    return run_worker("test_moe_tensor_parallel")


@pytest.mark.parametrize("ac", list(AC_MODES))
@pytest.mark.parametrize("model", list(MODELS))
def test_tp2_gradients_equal_one_process(gradient_report, model, ac):
    result = gradient_report[model][ac]
    assert result["loss_error"] <= 1e-6, result
    assert result["params"] > 20 and result["worst"] == [], result


@pytest.mark.parametrize("ac", list(AC_MODES))
def test_tp2_moe_backward_reduce_scatters_its_input_gradient_once_as_a_dense_mlp_does(gradient_report, ac):
    """Every branch of the MoE leaves its input gradient a partial sum, reduce-scattered once
    per block (2 per block, attention's and the MoE's, plus the embedding's: 13 for 6 blocks).
    The only all-reduce left is of the routing weights, 2 x 64 tokens x top-2; before, each
    branch all-reduced a whole 2 x 64 x 256 gradient of its own."""
    backward = gradient_report["backward collectives"][ac]
    recomputed = 6 if ac == "full" else 0  # full AC re-runs each block's attention reduce-scatter
    assert backward["reduce_scatter_tensor"] == 13 + recomputed, backward
    assert backward["largest all_reduce"] == 2 * 64 * 2, backward


def _build(name, flavor, overrides, tp, ac):
    spec = get_train_spec(name)
    mode, option = AC_MODES[ac]
    argv = ["--model.name", name, "--model.flavor", flavor, "--training.seq_len", "64",
            "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", mode,
            "--activation_checkpoint.selective_ac_option", option,
            "--parallelism.tensor_parallel_degree", str(tp)]  # fmt: skip
    # expert_tensor_parallel_degree keeps its default 1: without EP, TP shards the experts anyway.
    cfg = parse_args(argv, env={})
    with torch.device("meta"):
        model = spec.model_cls(replace(spec.flavors[flavor], **overrides).update_from_config(cfg))
    parallel_dims = None
    if tp > 1:
        parallel_dims = ParallelDims(1, 1, tp, tp)
        parallel_dims.build_mesh("cpu")
        spec.parallelize_fn(model, parallel_dims, cfg, torch.device("cpu"))
    init_on_cpu(model)
    return model, parallel_dims, cfg


def _loss_and_grads(model, parallel_dims, cfg, tokens):
    # Takes `_build`'s triple as it is; only TP runs the loss in a loss-parallel context.
    context = loss_context(parallel_dims, cfg) if parallel_dims else None
    return next_token_loss_and_grads(model, tokens, context)


def _close(grad: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(grad, want, rtol=0, atol=GRAD_RTOL * want.abs().max().item())


def _backward_collectives(model, parallel_dims, cfg, tokens) -> dict:
    """How many reduce-scatters run in backward, and the most elements any all-reduce moves there."""
    with OpCounter(collectives) as counter, loss_context(parallel_dims, cfg):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        counter.start_backward()
        loss.backward()
    all_reduces = counter.matching("all_reduce", phase=BACKWARD)
    return {
        "reduce_scatter_tensor": counter.count("reduce_scatter_tensor", phase=BACKWARD),
        "largest all_reduce": max((call.numel for call in all_reduces), default=0),
    }


def _worker() -> None:
    dist.init_process_group("gloo")
    tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(0))
    moe_tp2 = {ac: _build("qwen3", "debugmodel_moe", {}, 2, ac) for ac in AC_MODES}
    report = {"backward collectives": {
        ac: _backward_collectives(*built, tokens) for ac, built in moe_tp2.items()
    }}  # fmt: skip
    for label, (name, flavor, overrides) in MODELS.items():
        ref_loss, ref_grads = _loss_and_grads(*_build(name, flavor, overrides, 1, "none"), tokens)
        report[label] = {}
        for ac in AC_MODES:
            loss, grads = _loss_and_grads(*_build(name, flavor, overrides, 2, ac), tokens)
            worst = [param for param, grad in grads.items() if not _close(grad, ref_grads[param])]
            loss_error = abs(loss.item() - ref_loss.item())
            report[label][ac] = {"loss_error": loss_error, "params": len(grads), "worst": worst}
    if dist.get_rank() == 0:
        print(json.dumps(report))
    shut_down()


CONFIGS = {"qwen3 moe": "qwen3_debug_model_moe.toml", "deepseek_v3": "deepseek_v3_debug_model.toml"}


def test_expert_tp_other_than_1_or_tp_is_refused():
    argv = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "4"]
    with pytest.raises(ConfigError, match="must be 1 or the tensor_parallel_degree"):
        parse_args(["--config", CONFIGS["qwen3 moe"]] + argv, env={})


if __name__ == "__main__":
    _worker()
