"""The models' RMSNorm (`torchtitan.models.layers.RMSNorm`): it hands `F.rms_norm` a weight of its
input's dtype, so that on a GPU a bf16 activation under autocast reaches the fused kernel instead
of the decomposed fallback that torch takes (with a one-time warning) for mixed dtypes."""

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tests.model_testing import SEQ_LEN, VOCAB, next_token_loss_and_grads, tiny_deepseek_v3, tiny_qwen3
from torchtitan.models.layers import RMSNorm


def _norm_with_random_weight(dim: int) -> RMSNorm:
    norm = RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=torch.Generator().manual_seed(1)) + 0.5)
    return norm


def test_a_bf16_input_is_normalized_with_the_weight_cast_to_bf16():
    norm = _norm_with_random_weight(64)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).bfloat16()

    out = norm(x)

    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.rms_norm(x, (64,), norm.weight.detach().bfloat16(), 1e-6))


def test_the_weight_gradient_of_a_bf16_input_stays_in_the_weights_dtype():
    norm = _norm_with_random_weight(64)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()

    norm(x).float().square().sum().backward()

    assert norm.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert norm.weight.grad.abs().sum() > 0


def test_an_input_of_the_weights_dtype_gives_nn_rms_norm_bit_for_bit():
    norm = _norm_with_random_weight(64)
    reference = torch.nn.RMSNorm(64, eps=1e-6)
    reference.load_state_dict(norm.state_dict())
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))

    assert torch.equal(norm(x), reference(x))


class _RmsNormDtypes(TorchFunctionMode):
    """Records (input dtype, weight dtype) of every `F.rms_norm` call."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.rms_norm:
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            self.calls.append((args[0].dtype, weight.dtype))
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    "build",
    [tiny_qwen3, lambda: tiny_deepseek_v3(q_lora_rank=24)],
    ids=["qwen3 q/k norms", "deepseek_v3 q/kv norms"],
)
def test_under_bf16_autocast_every_norm_gets_a_weight_of_its_inputs_dtype(build):
    model = build()
    tokens = torch.randint(0, VOCAB, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    recorder = _RmsNormDtypes()

    with recorder, torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = next_token_loss_and_grads(model, tokens)

    assert torch.isfinite(loss)
    assert (torch.bfloat16, torch.bfloat16) in recorder.calls  # norms fed by a bf16 matmul
    assert all(x_dtype == w_dtype for x_dtype, w_dtype in recorder.calls), recorder.calls
    assert all(p.dtype == torch.float32 for p in model.parameters())
