"""The validator's loss: the mean of its batches' losses, over a pass that starts from the top."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan.components.loss_head import ChunkedLoss
from torchtitan.components.validate import Validator


class _Batches:
    """A finite loader whose dataset rewinds, like the validation loader."""

    def __init__(self, batches):
        self.batches, self.dataset, self.rewinds = batches, self, 0

    def load_state_dict(self, state):
        self.rewinds += state == {"sample_index": 0}

    def __iter__(self):
        return iter(self.batches)


def _cross_entropy(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _Decoder(nn.Module):
    """The interface the validator needs: logits, or with labels the loss the `ChunkedLoss` makes."""

    def __init__(self):
        super().__init__()
        self.embedding, self.output = nn.Embedding(11, 4), nn.Linear(4, 11)

    def forward(self, tokens, labels=None, loss=None):
        hidden = self.embedding(tokens)
        return self.output(hidden) if labels is None else loss(self.output, hidden, labels)


def _setup(n_batches):
    torch.manual_seed(0)
    model = _Decoder()
    batches = [(torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5))) for _ in range(n_batches)]
    return model, batches


@pytest.mark.parametrize("max_steps, used", [(-1, 3), (2, 2)])
def test_the_validation_loss_is_the_mean_of_the_first_max_steps_batch_losses(max_steps, used):
    model, batches = _setup(3)
    with torch.no_grad():
        want = sum(_cross_entropy(model(x), y).item() for x, y in batches[:used]) / used
    # 3 chunks of 10 tokens: unequal, so a chunk weighted by 1/3 instead of its share would show.
    chunked = ChunkedLoss(_cross_entropy, 3)
    validator = Validator(_Batches(batches), chunked, torch.device("cpu"), max_steps=max_steps)

    loader = validator.dataloader
    assert validator.validate(model) == pytest.approx(want, rel=1e-6)
    assert validator.validate(model) == pytest.approx(want, rel=1e-6)
    assert loader.rewinds == 2  # each pass starts at the split's first sample
    assert model.training
