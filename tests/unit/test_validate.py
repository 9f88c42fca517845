"""The validator's loss: the mean of its batches' losses, over a pass that starts from the top."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

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


def _setup(n_batches):
    torch.manual_seed(0)
    model = nn.Embedding(11, 11)
    batches = [(torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5))) for _ in range(n_batches)]
    return model, batches


@pytest.mark.parametrize("max_steps, used", [(-1, 3), (2, 2)])
def test_the_validation_loss_is_the_mean_of_the_first_max_steps_batch_losses(max_steps, used):
    model, batches = _setup(3)
    with torch.no_grad():
        want = sum(_cross_entropy(model(x), y).item() for x, y in batches[:used]) / used
    validator = Validator(_Batches(batches), _cross_entropy, torch.device("cpu"), max_steps=max_steps)

    loader = validator.dataloader
    assert validator.validate(model) == pytest.approx(want, rel=1e-6)
    assert validator.validate(model) == pytest.approx(want, rel=1e-6)
    assert loader.rewinds == 2  # each pass starts at the split's first sample
    assert model.training
