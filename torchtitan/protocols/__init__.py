"""What a model provides to the trainer: its args protocol and its TrainSpec. Specs are looked
up through `torchtitan.models.get_train_spec`, which sees every built-in model."""

from torchtitan.protocols.model_args import BaseModelArgs
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

__all__ = ["BaseModelArgs", "TrainSpec", "register_train_spec"]
