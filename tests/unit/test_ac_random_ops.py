"""AC replays random ops: with `preserve_rng_state`, a recompute draws the forward's dropout
masks, so every AC mode gives the gradients of no AC bit for bit."""

from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from tests.model_testing import SEQ_LEN, VOCAB, next_token_loss_and_grads, tiny_llama3
from torchtitan.config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.parallelize import LLAMA3_SAVE_LIST

MODES = {
    "full": ActivationCheckpoint(mode="full"),
    "every 2nd block": ActivationCheckpoint(mode="selective", selective_ac_option="2"),
    "op-SAC": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
}


def _with_dropout(model: nn.Module) -> nn.Module:
    """Dropout (p = 0.2) on each block's attention output and feed-forward output."""
    for block in model.layers.values():
        block.attention.wo = nn.Sequential(block.attention.wo, nn.Dropout(0.2))
        block.feed_forward = nn.Sequential(block.feed_forward, nn.Dropout(0.2))
    return model


def _gradients(ac: ActivationCheckpoint | None) -> dict[str, torch.Tensor]:
    model = _with_dropout(tiny_llama3())
    if ac is not None:
        apply_ac(model, ac, op_sac_save_list=LLAMA3_SAVE_LIST)
    tokens = torch.randint(0, VOCAB, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)  # the dropout masks
    return next_token_loss_and_grads(model.train(), tokens)[1]


@pytest.mark.parametrize("mode", list(MODES))
def test_with_preserve_rng_state_every_gradient_equals_no_ac_bit_for_bit(mode):
    want = _gradients(None)
    got = _gradients(replace(MODES[mode], preserve_rng_state=True))
    assert all(torch.equal(got[name], want[name]) for name in want), mode


@pytest.mark.parametrize("mode", list(MODES))
def test_without_it_a_recompute_draws_other_masks(mode):
    """What the test above guards against: the recompute's dropout differs from the forward's."""
    want = _gradients(None)
    got = _gradients(MODES[mode])
    assert not all(torch.equal(got[name], want[name]) for name in want), mode
