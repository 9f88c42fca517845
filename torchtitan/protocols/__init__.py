"""What a model provides to the trainer: its args protocol and its TrainSpec."""

from torchtitan.protocols.model_args import BaseModelArgs
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

__all__ = ["BaseModelArgs", "TrainSpec", "get_train_spec", "register_train_spec"]
