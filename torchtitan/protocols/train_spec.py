"""TrainSpec: the one registration that ties a model name to everything the trainer builds."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from torchtitan.config.custom import import_named_module
from torchtitan.config.errors import ConfigError, did_you_mean
from torchtitan.protocols.model_args import BaseModelArgs


@dataclass(frozen=True)
class TrainSpec:
    """Builders for one model family.

    Attributes:
        name: the `model.name` users write in TOML.
        model_cls: built as `model_cls(args)` on the meta device; must have `init_weights()`.
        flavors: flavor name -> args.
        parallelize_fn: `(model, parallel_dims, job_config, device, **options) -> model`,
            applies TP, EP, AC, compile and data parallelism in the order the model needs;
            `options` are `parallelize_decoder`'s (the memory estimator's seams).
        build_optimizer_fn, build_lr_scheduler_fn, build_dataloader_fn, build_tokenizer_fn,
        build_loss_fn: the components; shared defaults live in `torchtitan.components`.
        extra_loss_fn: optional `(model) -> Tensor | None`, a loss the model adds to the
            training loss for backward (e.g. MoE auxiliary losses); not part of the logged loss.
        post_optimizer_step_fn: optional `(model, dp_group) -> {name: 0-dim tensor}`, run after
            every optimizer step on every rank (e.g. MoE load balancing); what it returns is
            logged at log steps.
        state_dict_adapter: optional `StateDictAdapter` subclass, built as `cls(model_args,
            hf_assets_path)`, that converts the model's state dict to and from Hugging Face's.
    """

    name: str
    model_cls: type[nn.Module]
    flavors: dict[str, BaseModelArgs]
    parallelize_fn: Callable
    build_optimizer_fn: Callable
    build_lr_scheduler_fn: Callable
    build_dataloader_fn: Callable
    build_tokenizer_fn: Callable
    build_loss_fn: Callable
    extra_loss_fn: Callable | None = None
    post_optimizer_step_fn: Callable | None = None
    state_dict_adapter: type | None = None

    def get_flavor(self, flavor: str, key: str = "model.flavor") -> BaseModelArgs:
        """The args of `flavor`; raises ConfigError listing the valid flavors, naming `flavor`
        as the config key or command-line option `key` it came from."""
        if flavor not in self.flavors:
            hint = did_you_mean(flavor, self.flavors, always=False)
            raise ConfigError(
                f"unknown flavor {_given(key, flavor)} for model '{self.name}'.{hint} "
                f"Valid flavors: {', '.join(self.flavors)}."
            )
        return self.flavors[flavor]

    def build_meta_model(self, model_args: BaseModelArgs, dtype: torch.dtype) -> nn.Module:
        """The model with parameters of `dtype` on the meta device: no memory, no init yet."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device("meta"):
                return self.model_cls(model_args)
        finally:
            torch.set_default_dtype(previous)


_REGISTRY: dict[str, TrainSpec] = {}


def _given(key: str, value: str) -> str:
    """How an error names `value`: as the command-line option (`--flavor '9B'`) or config key
    (`'model.flavor' = '9B'`) the user wrote it under."""
    return f"{key} '{value}'" if key.startswith("--") else f"'{key}' = '{value}'"


def register_train_spec(spec: TrainSpec) -> None:
    """Make `spec` available under `spec.name`; a second registration of a name is a bug."""
    if spec.name in _REGISTRY:
        raise ValueError(f"train spec '{spec.name}' is already registered")
    _REGISTRY[spec.name] = spec


def registered_train_spec(name: str, key: str = "model.name") -> TrainSpec:
    """The spec registered as `name` so far; raises ConfigError listing the registered models,
    naming `name` as the config key or command-line option `key` it came from.

    Pitfall: this module imports no model, so the built-in families are registered only once
    `torchtitan.models` is imported; look specs up with `torchtitan.models.get_train_spec`.
    """
    if name not in _REGISTRY:
        hint = did_you_mean(name, _REGISTRY, always=False)
        raise ConfigError(
            f"unknown model {_given(key, name)}.{hint} Registered models: {', '.join(sorted(_REGISTRY))}."
        )
    return _REGISTRY[name]


def import_custom_module(name: str, key: str = "job.custom_import") -> None:
    """Import module `name` (dotted) for its side effects, typically `register_train_spec`
    calls for models of one's own; an empty `name` imports nothing.

    Raises:
        ConfigError: when `name`, or a package above it, cannot be found, naming the config
            key or command-line option `key` it came from and how to make it importable. An
            error inside the module, including a failed import of something it needs,
            propagates with its traceback: it is a bug there.
    """
    if name:
        import_named_module(name, key)
