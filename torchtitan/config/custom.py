"""Modules of one's own that a config names: importing them, and extending the schema with one.

`job.custom_import` names a module every rank imports for its side effects (a model that
registers itself). `job.custom_config_module` names a module whose `JobConfig` dataclass adds
keys to this trainer's schema, as upstream torchtitan's did: each field of it is a
`[section]`, and a section that exists here gains the fields it declares, while a new one is
added whole. So a model of one's own can read `job_config.my_section.my_key` from the TOML
file or `--my_section.my_key` like any other key, with `--help`, type checks and the range
bounds of `torchtitan.config.job_config.opt`.
"""

import dataclasses
import functools
import importlib
import typing
from types import ModuleType, NoneType, UnionType

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, describe_type, section_types

# The values a TOML key can hold here, and so the types a key of one's own may have.
_SCALARS = (bool, int, float, str)


def custom_import_error(name: str, missing: str, key: str = "job.custom_import") -> ConfigError:
    """The message for a module `name` that cannot be found (`missing`: the first package of
    `name` that is not there), naming the config key or command-line option `key`."""
    return ConfigError(
        f"{_given(key, name)} cannot be imported: no module named '{missing}'. Install the "
        "package that holds it on every node, or add the folder above it to PYTHONPATH "
        "(run_train.sh passes the environment on to every rank)."
    )


def check_module_name(name: str, key: str) -> None:
    """Raise a ConfigError naming `key` unless `name` is a dotted module name."""
    if not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(
            f"{_given(key, name)} is not a module name; give the dotted name Python imports it by "
            "(my_project.models for my_project/models.py, its folder on PYTHONPATH)."
        )


def import_named_module(name: str, key: str) -> ModuleType:
    """Import module `name`, given by config key or command-line option `key`.

    Raises:
        ConfigError: when `name` is not a module name, or it or a package above it cannot be
            found. An error inside the module, a failed import of something it needs included,
            propagates with its traceback: it is a bug there.
    """
    check_module_name(name, key)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is None or not (name == error.name or name.startswith(f"{error.name}.")):
            raise
        raise custom_import_error(name, error.name, key) from None


def extend_job_config(module_name: str, key: str = "job.custom_config_module") -> type[JobConfig]:
    """This trainer's `JobConfig` class with the sections and keys of `module_name`'s `JobConfig`,
    built once per imported module (so that two configs parsed with it compare equal).

    A field of the module's `JobConfig` that names a section here extends it: its keys are
    added, and a key this trainer already has may get a new default and help text (its range
    bounds stay unless given anew) but must keep its type. Any other field adds its section
    whole. The result subclasses `JobConfig`, so code that takes a `JobConfig` takes it too.

    Args:
        module_name: the dotted module, imported here (and so on every rank that parses).
        key: where the name came from, for messages.

    Raises:
        ConfigError: when the module cannot be found or has no `JobConfig` dataclass, when a
            field of it is not a dataclass, or when a key has no default, a type a TOML file
            cannot give (bool, int, float, str, a Literal of them, a list of them, or any of
            these or None), or another type than this trainer's key of that name.
    """
    module = import_named_module(module_name, key)
    custom = getattr(module, "JobConfig", None)
    if not (isinstance(custom, type) and dataclasses.is_dataclass(custom)):
        raise ConfigError(
            f"{_given(key, module_name)} defines no JobConfig dataclass; define one there, with one "
            "field per [section] to add or extend (see 'Keys of your own' in the README)."
        )
    return _extended_schema(custom, module_name)


@functools.cache
def _extended_schema(custom: type, module_name: str) -> type[JobConfig]:
    sections = section_types()
    extended = []
    for name, section_cls in _field_types(custom, module_name).items():
        where = f"{module_name}.JobConfig.{name}"
        if not (isinstance(section_cls, type) and dataclasses.is_dataclass(section_cls)):
            raise ConfigError(
                f"{where} is {describe_type(section_cls)}, but every field of JobConfig is a [section] "
                "of the TOML file, so its type must be a dataclass of that section's keys."
            )
        merged = _extend_section(sections.get(name), section_cls, name, module_name)
        extended.append((name, merged, dataclasses.field(default_factory=merged)))
    schema = dataclasses.make_dataclass("JobConfig", extended, bases=(JobConfig,))
    schema.__module__ = module_name
    return schema


def added_keys(schema: type[JobConfig]) -> list[str]:
    """The keys ("section.key") that `schema` has and this trainer's own `JobConfig` has not."""
    own = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in section_types().items()}
    return [
        f"{name}.{f.name}"
        for name, cls in section_types(schema).items()
        for f in dataclasses.fields(cls)
        if f.name not in own.get(name, ())
    ]


def _extend_section(own_cls: type | None, custom_cls: type, section: str, module_name: str) -> type:
    """`own_cls` with `custom_cls`'s keys added or re-declared; for a new section (`own_cls`
    None), `custom_cls` itself once its keys are checked."""
    own_types = typing.get_type_hints(own_cls) if own_cls else {}
    own_fields = {f.name: f for f in dataclasses.fields(own_cls)} if own_cls else {}
    keys = []
    for name, tp in _field_types(custom_cls, module_name).items():
        f = custom_cls.__dataclass_fields__[name]
        where = f"'{section}.{name}' in {module_name}"
        if name in own_types and tp != own_types[name]:
            raise ConfigError(
                f"{where} is declared {describe_type(tp)}, but it is this trainer's key of type "
                f"{describe_type(own_types[name])}; keep that type (a new default is fine), or rename "
                "your key."
            )
        if not _is_toml_type(tp):
            raise ConfigError(
                f"{where} is declared {describe_type(tp)}, which a TOML file cannot give; use bool, int, "
                "float, str, a Literal of them, a list of them, or any of these | None."
            )
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(
                f"{where} has no default; give it one, so that a config that leaves it out still runs."
            )
        metadata = {**own_fields[name].metadata, **f.metadata} if name in own_fields else f.metadata
        copy = dataclasses.field(default=f.default, default_factory=f.default_factory, metadata=metadata)
        keys.append((name, tp, copy))
    if own_cls is None:
        return custom_cls
    return dataclasses.make_dataclass(custom_cls.__name__, keys, bases=(own_cls,))


def _field_types(cls: type, module_name: str) -> dict[str, object]:
    """Each field of dataclass `cls` and its type, string annotations resolved."""
    try:
        hints = typing.get_type_hints(cls)
    except NameError as error:
        raise ConfigError(
            f"{cls.__qualname__} in {module_name} has an annotation that names something not defined "
            f"there ({error}); import it in that module."
        ) from None
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_toml_type(tp) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return all(isinstance(choice, _SCALARS) for choice in typing.get_args(tp))
    if origin in (typing.Union, UnionType):
        return all(arg is NoneType or _is_toml_type(arg) for arg in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return item in _SCALARS or typing.get_origin(item) in (typing.Literal, list) and _is_toml_type(item)
    return tp in _SCALARS


def _given(key: str, name: str) -> str:
    return f"{key} {name}" if key.startswith("--") else f"'{key}' = '{name}'"
