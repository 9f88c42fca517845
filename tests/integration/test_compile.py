"""torch.compile of MoE blocks does not change the numbers: 5 training steps of the Qwen3 MoE
debug model (2 blocks, CPU fp32, inductor) compiled equal eager, under full AC and op-SAC, with
`compile.capture_scalar_outputs` off (the checkpointed MoE block falls back to eager, with a
warning) and on (the block compiles as one graph). The sequence aux loss is on throughout: the
block sets it as a side effect, which compile must trace, not break on. Torch releases known to
fail that combination are refused (tests/unit/test_ac_plan.py). Capture on (the opt-in option,
a minute of compiling per AC mode on 2 cores) is under `full_matrix`."""

import logging
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.conftest import needs_checkpointed_scalar_capture
from tests.model_testing import init_on_cpu
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.moe import load_balance_step, pop_aux_loss
from torchtitan.models.qwen3 import qwen3_flavors
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.tools.grouped_mm import grouped_mm_supported

pytestmark = pytest.mark.integration

_MODE, _OPTION = "--activation_checkpoint.mode", "--activation_checkpoint.selective_ac_option"
AC = {"full": [_MODE, "full"], "selective op": [_MODE, "selective", _OPTION, "op"]}
STEPS, SEQ_LEN = 5, 64
AUX_LOSS_COEFF = 0.01


def _model_args():
    args = qwen3_flavors["debugmodel_moe"]
    return replace(args, n_layers=2, moe_args=replace(args.moe_args, seq_aux_loss_coeff=AUX_LOSS_COEFF))


def _train(ac: str, compile_argv: list[str]) -> tuple[list[float], list[float]]:
    """(losses, load imbalance) of 5 AdamW steps on one fixed batch (so that the loss falls)."""
    argv = ["--config", "qwen3_debug_model_moe.toml", "--training.seq_len", str(SEQ_LEN)]
    cfg = parse_args(argv + AC[ac] + compile_argv, env={})
    with torch.device("meta"):
        model = Qwen3Model(_model_args().update_from_config(cfg))
    parallelize_qwen3(model, ParallelDims(1, 1, 1, 1), cfg, torch.device("cpu"))
    init_on_cpu(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 2048, (4, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    losses, imbalance = [], []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        (loss + pop_aux_loss(model)).backward()
        optimizer.step()
        imbalance.append(load_balance_step(model, None)["moe_imbalance"].item())
        losses.append(loss.item())
    return losses, imbalance


@pytest.fixture(scope="module")
def eager():
    return {ac: _train(ac, []) for ac in AC}


@pytest.mark.parametrize(
    "ac, capture",
    [
        pytest.param("full", False, id="full-capture_scalar_outputs off"),
        pytest.param("selective op", False, id="selective op-capture_scalar_outputs off"),
        # The slowest compiles of the suite, about a minute each.
        pytest.param(
            "full", True, id="full-on", marks=[needs_checkpointed_scalar_capture, pytest.mark.full_matrix]
        ),
        pytest.param(
            "selective op",
            True,
            id="selective op-on",
            marks=[needs_checkpointed_scalar_capture, pytest.mark.full_matrix],
        ),
    ],
)
def test_compiled_moe_training_equals_eager(eager, ac, capture, caplog):
    torch._dynamo.reset()
    counters.clear()
    flag = "--compile.capture_scalar_outputs" if capture else "--compile.no_capture_scalar_outputs"
    with caplog.at_level(logging.INFO):
        losses, imbalance = _train(ac, ["--compile.enable", flag])
    assert f"graph breaks allowed (MoE); capture_scalar_outputs {capture}" in caplog.text
    if capture:  # the block compiles as one graph, the aux loss side effect traced
        assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    else:  # CPU fp32 experts loop over host-read counts: the checkpointed block falls back, said once
        assert "Set compile.capture_scalar_outputs = true" in caplog.text
    want_losses, want_imbalance = eager[ac]
    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, want_losses, rtol=1e-4, atol=0)
    # The routing counts (a side effect of forward) are taken once per step, as in eager.
    assert imbalance == pytest.approx(want_imbalance, rel=1e-6)


@pytest.mark.skipif(
    not grouped_mm_supported(torch.device("cpu"), torch.bfloat16), reason="no bf16 grouped mm on this build"
)
def test_moe_blocks_in_bf16_are_not_warned_about_the_fp32_weights_grouped_mm(caplog):
    """fp32 weights with bf16 mixed precision: the experts run grouped mm in bf16, which compiles,
    even where fp32 grouped mm cannot be traced; no warning that they fall back to eager."""
    argv = ["--config", "qwen3_debug_model_moe.toml", "--training.mixed_precision_param", "bfloat16",
            "--compile.enable", *AC["full"]]  # fmt: skip
    cfg = parse_args(argv, env={})
    with torch.device("meta"):
        model = Qwen3Model(_model_args().update_from_config(cfg))
    with caplog.at_level(logging.INFO):
        parallelize_qwen3(model, ParallelDims(1, 1, 1, 1), cfg, torch.device("cpu"))
    assert "graph breaks allowed (MoE)" in caplog.text
    assert "Set compile.capture_scalar_outputs = true" not in caplog.text
