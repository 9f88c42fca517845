"""The registry's lookup, and what is built from a looked-up spec.

It lives with the models, not in `torchtitan.protocols`, because a lookup must see every
built-in family registered: importing this module imports `torchtitan.models`, whose families
register themselves on import. `torchtitan.protocols` defines the spec and the registry and knows
no model.
"""

from dataclasses import replace
from pathlib import Path

from torchtitan.config.errors import ConfigError
from torchtitan.protocols.state_dict_adapter import StateDictAdapter, with_trained_seq_len
from torchtitan.protocols.train_spec import TrainSpec, registered_train_spec


def get_train_spec(name: str, key: str = "model.name") -> TrainSpec:
    """The spec registered as `name`: a built-in family, or one a `job.custom_import` module
    registered. Raises ConfigError listing the registered models, naming `name` as the config
    key or command-line option `key` it came from."""
    return registered_train_spec(name, key)


def build_state_dict_adapter(
    model_name: str,
    flavor: str,
    hf_assets_path: str | Path | None = None,
    seq_len: int | None = None,
    keys: tuple[str, str] = ("--model", "--flavor"),
) -> StateDictAdapter:
    """The adapter of `model_name`'s TrainSpec for `flavor`, for weights trained at `seq_len`
    tokens (see `with_trained_seq_len`).

    Raises:
        ConfigError: for an unknown model or flavor, or a model without an adapter. The message
            names them as `keys`, the converters' command-line options by default.
    """
    model_key, flavor_key = keys
    spec = get_train_spec(model_name, model_key)
    args = with_trained_seq_len(spec.get_flavor(flavor, flavor_key), seq_len)
    if spec.state_dict_adapter is None:
        raise ConfigError(f"model '{model_name}' has no Hugging Face state-dict adapter")
    return spec.state_dict_adapter(args, hf_assets_path)


def build_run_state_dict_adapter(job_config) -> StateDictAdapter | None:
    """The adapter for what a run trained, from its config (the trainer's, or the config.toml
    each run writes to its dump folder): the flavor with the run's `[model]` attention keys and
    YaRN setting (`update_from_config`), the published context unless training.seq_len is
    longer (`with_trained_seq_len`). None for a model without an adapter.

    Raises:
        ConfigError: as `update_from_config` (e.g. block_causal with a tokenizer without EOS).
    """
    spec = get_train_spec(job_config.model.name)
    if spec.state_dict_adapter is None:
        return None
    flavor = spec.get_flavor(job_config.model.flavor)
    published = replace(flavor.update_from_config(job_config), max_seq_len=flavor.max_seq_len)
    args = with_trained_seq_len(published, job_config.training.seq_len)
    return spec.state_dict_adapter(args, job_config.model.hf_assets_path)
