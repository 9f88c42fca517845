"""apply_ac: every mode leaves loss and gradients unchanged; bad settings are refused."""

import pytest
import torch

from torchtitan.config import ActivationCheckpoint, ConfigError
from torchtitan.distributed.activation_checkpoint import DEFAULT_SAVE_LIST, apply_ac, save_list
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer


def _model() -> Transformer:
    args = TransformerModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model


def _loss_and_grads(model):
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()
    }


def _wrapped(model) -> list[str]:
    return [name for name, block in model.layers.named_children() if "Checkpoint" in type(block).__name__]


@pytest.mark.parametrize(
    "mode, option, wrapped",
    [
        ("full", "2", ["0", "1", "2", "3"]),
        ("selective", "1", ["0", "1", "2", "3"]),
        ("selective", "2", ["0", "2"]),
        ("selective", "op", ["0", "1", "2", "3"]),
    ],
)
def test_mode_wraps_expected_blocks_and_keeps_loss_and_grads(mode, option, wrapped):
    ref_loss, ref_grads = _loss_and_grads(_model())
    model = _model()
    apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option=option))
    loss, grads = _loss_and_grads(model)
    assert _wrapped(model) == wrapped
    assert torch.allclose(loss, ref_loss, rtol=1e-6)
    for name, grad in ref_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-5, atol=1e-7), name


def test_none_wraps_nothing():
    model = _model()
    apply_ac(model, ActivationCheckpoint(mode="none"))
    assert _wrapped(model) == []


def test_layer_selective_count_belongs_to_each_model():
    first, second = _model(), _model()
    apply_ac(first, ActivationCheckpoint(mode="selective", selective_ac_option="3"))
    apply_ac(second, ActivationCheckpoint(mode="selective", selective_ac_option="3"))
    assert _wrapped(first) == _wrapped(second) == ["0", "3"]


@pytest.mark.parametrize("option", ["0", "-1", "every", "1.5"])
def test_invalid_selective_option_is_refused(option):
    with pytest.raises(ConfigError, match="selective_ac_option"):
        apply_ac(_model(), ActivationCheckpoint(mode="selective", selective_ac_option=option))


def test_memory_budget_without_compile_is_refused():
    with pytest.raises(ConfigError, match="compile.enable"):
        apply_ac(_model(), ActivationCheckpoint(mode="memory_budget"))


def test_force_recompute_fqn_on_non_linear_is_refused():
    cfg = ActivationCheckpoint(
        mode="selective",
        selective_ac_option="op",
        per_op_sac_force_recompute_mm_shapes_by_fqns=["attention_norm"],
    )
    with pytest.raises(ConfigError, match="not an nn.Linear"):
        apply_ac(_model(), cfg)


def test_model_save_list_is_default_plus_additions_minus_drops():
    extra = torch.ops.aten.addmm.default
    built = save_list(add=[extra], drop=[torch.ops.aten.max.default])
    assert extra in built and torch.ops.aten.max.default not in built
    assert built - {extra} == DEFAULT_SAVE_LIST - {torch.ops.aten.max.default}
