"""TOML file + command line -> validated `JobConfig`.

Precedence is defaults < TOML file < command line. Every mistake a user can make in a config
becomes a `ConfigError` whose message names the key, the value and the fix; `train.main`
turns it into one paragraph on stderr and exit code 2. This module reads the keys (unknown,
misspelt, renamed upstream keys, values of the wrong type); `torchtitan.config.validation`
then checks what they mean together.
"""

import dataclasses
import difflib
import logging
import re
import sys
import types
import typing
from contextvars import ContextVar
from pathlib import Path

from torchtitan.config.custom import added_keys, extend_job_config
from torchtitan.config.errors import ConfigError, did_you_mean
from torchtitan.config.job_config import JobConfig, describe_type, section_types
from torchtitan.config.toml_writer import toml_value
from torchtitan.config.upstream import (
    ANY,
    CONVERTER_SECTIONS,
    QUANTIZE_FLOAT8,
    RENAMED_FOLDER_KEYS,
    RENAMED_KEYS,
    UPSTREAM_ONLY_SECTIONS,
    has_upstream_keys,
    unbuilt_key,
    upstream_keys_of,
)
from torchtitan.config.validation import validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
PROJECT_ROOT = PACKAGE_ROOT.parent
DEFAULT_CONFIG = "debug_model.toml"

logger = logging.getLogger(__name__)


# The schema being read: this trainer's JobConfig, or one that job.custom_config_module extends.
_schema: ContextVar[type[JobConfig]] = ContextVar("schema", default=JobConfig)


def _sections() -> dict[str, type]:
    return section_types(_schema.get())


def find_config_dirs() -> list[Path]:
    """Every `torchtitan/models/*/train_configs/` folder, sorted."""
    return sorted((PACKAGE_ROOT / "models").glob("*/train_configs"))


def resolve_config_path(name_or_path: str, source: str = "") -> Path:
    """Find a config by path, or by bare file name across all models' train_configs; `source`
    (e.g. "$CONFIG_FILE") says in the error where the name came from.

    Raises:
        ConfigError: when nothing matches (listing where it looked) or a bare name is ambiguous.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    looked = [str(path.resolve())]
    if path.parent == Path("."):
        names = [path.name] if path.suffix == ".toml" else [path.name, path.name + ".toml"]
        matches = [d / n for d in find_config_dirs() for n in names if (d / n).is_file()]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            listed = ", ".join(str(m.relative_to(PROJECT_ROOT)) for m in matches)
            raise ConfigError(
                f"config name '{name_or_path}' is ambiguous; it matches {listed}. "
                "Pass one of these paths to --config instead."
            )
        looked += [str(d) for d in find_config_dirs()]
    given = f" (from {source})" if source else ""
    if path.is_dir():
        raise ConfigError(
            f"config file '{name_or_path}'{given} is a folder; give a TOML file in it, e.g. "
            f"'{next(iter(sorted(path.glob('*.toml'))), path / 'debug_model.toml')}'."
        )
    raise ConfigError(
        f"config file '{name_or_path}'{given} does not exist. Looked in: {'; '.join(looked)}. "
        "Pass a path to a TOML file, or the name of a file in one of those folders."
    )


def _section_fields(section_cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def _unknown_key_error(where: str, section: str, key: str) -> ConfigError:
    sections = _sections()
    if section in UPSTREAM_ONLY_SECTIONS:
        return ConfigError(
            f"section [{section}] in {where} configures {UPSTREAM_ONLY_SECTIONS[section]} in upstream "
            "torchtitan, which this trainer does not build; remove the section."
        )
    nested = f"{section}.{key.rpartition('.')[0]}"
    if "." in key and has_upstream_keys(nested):
        known = [name.rpartition(".")[2] for name in upstream_keys_of(nested)]
        return ConfigError(
            f"unknown key '{section}.{key}' in {where}: upstream torchtitan's [{nested}] is understood here "
            f"only for {', '.join(known)}.{did_you_mean(key.rpartition('.')[2], known, always=False)}"
        )
    if section not in sections and has_upstream_keys(section):
        known = [name.partition(".")[2] for name in upstream_keys_of(section) if not name.endswith(".*")]
        return ConfigError(
            f"unknown key '{section}.{key}' in {where}: upstream torchtitan's [{section}] is understood here "
            f"only for {', '.join(known)}.{did_you_mean(key, known, always=False)}"
        )
    if section not in sections:
        return ConfigError(
            f"unknown section [{section}] in {where}.{did_you_mean(section, sections)} "
            f"Valid sections: {', '.join(sections)}."
        )
    fields = _section_fields(sections[section])
    owners = _sections_with_key(key)
    # A key of exactly one other section, and no near-miss of one here: most likely written
    # under the section where upstream torchtitan used to keep it (parallel degrees in [training]).
    if len(owners) == 1 and not difflib.get_close_matches(key, fields, n=1, cutoff=0.75):
        return ConfigError(
            f"'{section}.{key}' in {where}: '{key}' is a key of [{owners[0]}], not of [{section}]; "
            f"write it as '{owners[0]}.{key}'."
        )
    return ConfigError(
        f"unknown key '{section}.{key}' in {where}.{did_you_mean(key, fields)} "
        f"Valid keys of [{section}]: {', '.join(fields)}."
    )


def _is_own_key(section: str, key: str) -> bool:
    sections = _sections()
    return section in sections and key in _section_fields(sections[section])


def _is_bool_key(section: str, key: str) -> bool:
    return _is_own_key(section, key) and typing.get_type_hints(_sections()[section])[key] is bool


def _cli_value(text: str | None, like):
    """A command-line value as the type of `like`, to compare with it (the text if it does not parse)."""
    if text is None:
        return True
    if like is ANY or like is None:
        return text
    try:
        return _parse_text(text, type(like))
    except ValueError:
        return text


def _resolve_key(section: str, key: str, value, where: str, from_text: bool) -> tuple[str, str] | None:
    """The key of this trainer that `section.key` sets: itself, or this trainer's name for an
    upstream torchtitan key; None for an upstream key that is ignored (with a warning).

    `value` is the TOML value, or with `from_text` the command line's text (None for a flag).

    Raises:
        ConfigError: for an unknown key, or an upstream key whose feature is not built here
            set to anything but upstream's default.
    """
    if _is_own_key(section, key):
        return section, key
    name = f"{section}.{key}"
    new_name = RENAMED_KEYS.get(name)
    if name in RENAMED_FOLDER_KEYS and isinstance(value, str) and not value.endswith(".model"):
        new_name = RENAMED_FOLDER_KEYS[name]
    if new_name:
        logger.warning(
            f"Reading '{name}' in {where} as '{new_name}', its name here (upstream "
            "torchtitan's spelling, now or earlier); rename it to silence this warning."
        )
        new_section, _, new_key = new_name.partition(".")
        return new_section, new_key
    spec = unbuilt_key(name)
    if spec is None:
        raise _unknown_key_error(where, section, key)
    value = _cli_value(value, spec.default) if from_text else value
    if spec.default is ANY or value == spec.default:
        logger.warning(
            f"Ignoring '{name}' in {where}: upstream torchtitan's key for {spec.feature}, which has "
            "no effect here. Remove the key to silence this warning."
        )
        return None
    if spec.fix:
        raise ConfigError(
            f"'{name}' = {value!r} in {where} is upstream torchtitan's key for {spec.feature}, "
            f"which is not read here; {spec.fix}."
        )
    raise ConfigError(
        f"'{name}' = {value!r} in {where} is upstream torchtitan's key for {spec.feature}, "
        f"which this trainer does not build; remove the key or set it to {spec.default!r}."
    )


def _sections_with_key(key: str) -> list[str]:
    return [name for name, cls in _sections().items() if key in _section_fields(cls)]


def _option_without_key_error(name: str) -> ConfigError:
    """`--name` with no dot: a section missing its key, a key missing its section, or neither."""
    sections = _sections()
    if name in sections:
        return ConfigError(
            f"--{name} needs a key: --{name}.KEY VALUE. Keys of [{name}]: "
            f"{', '.join(_section_fields(sections[name]))}."
        )
    owners = _sections_with_key(name)
    if owners:
        spelled = " or ".join(f"--{owner}.{name}" for owner in owners)
        return ConfigError(f"--{name} needs its section: use {spelled}.")
    return ConfigError(
        f"unknown option --{name}: options look like --section.key VALUE.{did_you_mean(name, sections)} "
        f"Valid sections: {', '.join(sections)}."
    )


def _top_level_key_error(path: Path, key: str, value) -> ConfigError:
    owners = _sections_with_key(key)
    where = (
        f" '{key}' is a key of {' and '.join(f'[{o}]' for o in owners)}."
        if owners
        else f" Valid sections: {', '.join(_sections())}."
    )
    return ConfigError(
        f"'{key}' = {value!r} in {path} is a top-level key, but every key must be inside a "
        f"[section]; put it under the section it belongs to.{where}"
    )


def _is_choice(tp) -> bool:
    """Literal, or Literal | None: a mismatch is a value outside the choices, not a type error."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return all(_is_choice(a) for a in typing.get_args(tp) if a is not type(None))
    return typing.get_origin(tp) is typing.Literal


def _is_optional(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _parse_text(text: str, tp):
    """Parse a command-line string into `tp`; raises ValueError when it does not fit."""
    origin = typing.get_origin(tp)
    if origin is list:
        item = typing.get_args(tp)[0]
        # A list of lists on the command line: ";" between the lists, "," within each.
        separator = ";" if typing.get_origin(item) is list else ","
        return [_parse_text(s.strip(), item) for s in text.split(separator) if s.strip()]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and text.lower() in ("none", "null"):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _parse_text(text, arg)
            except ValueError:
                pass
        raise ValueError(text)
    if origin is typing.Literal:
        return _coerce(text, tp)
    if tp is bool:
        lowered = text.lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ValueError(text)
    return tp(text)


def _coerce(value, tp):
    """Check a TOML value against `tp` (ints widen to floats); raises ValueError on mismatch."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ValueError(value)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg)
            except ValueError:
                pass
        raise ValueError(value)
    if origin is list:
        if isinstance(value, str):
            # As on the command line; upstream torchtitan's files wrote lists this way too.
            return _parse_text(value, tp)
        item = typing.get_args(tp)[0]
        # A number in a list of names is a mistake (components = [1, 2]), not a name to spell.
        if not isinstance(value, list) or (item is str and not all(isinstance(v, str) for v in value)):
            raise ValueError(value)
        return [_coerce(v, item) for v in value]
    if tp is type(None):
        if value is None:
            return None
        raise ValueError(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ValueError(value)


def _ignored_converter_section(section: str, where: str) -> bool:
    """Whether `section` is an upstream converter section, which is ignored (with a warning)."""
    if section not in CONVERTER_SECTIONS:
        return False
    logger.warning(
        f"Ignoring section [{section}] in {where}: in upstream torchtitan it configures "
        f"{CONVERTER_SECTIONS[section]}, which acts only when model.converters enables it, and "
        "that converter is not built here. Remove the section to silence this warning."
    )
    return True


def _apply_quantize_float8(config: JobConfig, table: dict, path: Path, written_as: dict) -> dict:
    """Read upstream's [quantize.linear.float8] into [float8]; return what else [quantize] holds."""
    linear = table.get(QUANTIZE_FLOAT8[0])
    if not isinstance(linear, dict) or not isinstance(linear.get(QUANTIZE_FLOAT8[1]), dict):
        return table
    for key, value in linear[QUANTIZE_FLOAT8[1]].items():
        _refuse_two_spellings(written_as, ("float8", key), f"quantize.linear.float8.{key}", value, path)
        _set_value(config, "float8", key, value, f"{path} [quantize.linear.float8]", from_text=False)
    rest_of_linear = {k: v for k, v in linear.items() if k != QUANTIZE_FLOAT8[1]}
    rest = {k: v for k, v in table.items() if k != QUANTIZE_FLOAT8[0]}
    return rest | ({QUANTIZE_FLOAT8[0]: rest_of_linear} if rest_of_linear else {})


def _set_value(config: JobConfig, section: str, key: str, value, where: str, from_text: bool):
    sections = _sections()
    if section not in sections:
        raise _unknown_key_error(where, section, key)
    fields = _section_fields(sections[section])
    if key not in fields:
        raise _unknown_key_error(where, section, key)
    tp = typing.get_type_hints(sections[section])[key]
    if from_text and value == "" and _is_optional(tp):
        # Usually an unset shell variable ($INIT in --key "$INIT"): read as unset, the run
        # would quietly lose the setting.
        raise ConfigError(
            f"'{section}.{key}' is given an empty value in {where}, often an unset shell variable; "
            "give a value, or 'none' to leave it unset."
        )
    try:
        parsed = _parse_text(value, tp) if from_text else _coerce(value, tp)
    except (ValueError, TypeError):
        problem = "is not" if _is_choice(tp) else "has the wrong type: expected"
        quoted = "" if from_text else _quoted_hint(value, tp)
        hint = quoted or _example(section, key, fields[key], from_text)
        raise ConfigError(
            f"'{section}.{key}' = {value!r} in {where} {problem} {describe_type(tp)}{hint}."
        ) from None
    setattr(getattr(config, section), key, parsed)


def _example(section: str, key: str, field: dataclasses.Field, from_text: bool) -> str:
    """A correctly typed example for a number key, from its default value; none for other
    keys (a boolean's "expected bool" and a choice's list of values say enough)."""
    default = field.default
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        return ""
    if from_text:
        return f", for example --{section}.{key} {default!r}"
    return f", for example {key} = {toml_value(default)}"


def _quoted_hint(value, tp) -> str:
    """The fix for a number or boolean written as a TOML string ("3e-3" where 3e-3 was meant)."""
    if not isinstance(value, str) or _is_choice(tp):
        return ""
    try:
        _parse_text(value, tp)
    except (ValueError, TypeError):
        return ""
    return f" (written as a string: write {value} without quotes)"


def _read_toml(path: Path) -> dict:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}.") from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raise ConfigError(
            f"config file {path} starts with a byte-order mark, which TOML does not allow; save it "
            "as UTF-8 without BOM."
        )
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {raw[e.start]:#04x} on line {line}); save it "
            "as UTF-8."
        ) from None
    except tomllib.TOMLDecodeError as e:
        if duplicate := _duplicate_key(raw.decode("utf-8"), str(e)):
            raise ConfigError(f"config file {path} {duplicate}; keep one of them.") from None
        raise ConfigError(f"config file {path} is not valid TOML: {e}.") from None


def _duplicate_key(text: str, error: str) -> str | None:
    """For tomllib's "Cannot overwrite a value (at line N, column C)": which key is set twice
    and where, as "sets 'section.key' twice (lines M and N)"; None for any other error."""
    found = re.match(r"Cannot overwrite a value \(at line (\d+)", error)
    if not found:
        return None
    line_number = int(found.group(1))
    lines = text.splitlines()
    key_at = re.compile(r"\s*([A-Za-z0-9_.\-\"']+)\s*=")
    section, seen = "", {}
    for number, line in enumerate(lines[:line_number], start=1):
        if header := re.match(r"\s*\[([^\[\]]+)\]", line):
            section = header.group(1).strip()
        elif (key := key_at.match(line)) is not None:
            name = f"{section}.{key.group(1).strip(chr(34) + chr(39))}" if section else key.group(1)
            if number == line_number:
                first = seen.get(name)
                return f"sets '{name}' twice (lines {first} and {number})" if first else None
            seen.setdefault(name, number)
    return None


def _apply_toml(config: JobConfig, data: dict, path: Path) -> None:
    problems: list[str] = []
    written_as: dict[tuple[str, str], tuple[str, object]] = {}
    for section, table in data.items():
        try:
            _apply_toml_section(config, section, table, path, problems, written_as)
        except ConfigError as e:
            problems.append(str(e))
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        # All at once, so that a file from upstream torchtitan is fixed in one pass.
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(f"{len(problems)} problems in {path}:\n{listed}")


def _apply_toml_section(
    config: JobConfig, section: str, table, path: Path, problems: list[str], written_as: dict
) -> None:
    """Set one section's keys; a bad key's message goes to `problems` and the rest still apply.
    `written_as` maps each key set so far to the name and value the file gave it."""
    if not isinstance(table, dict):
        raise _top_level_key_error(path, section, table)
    if section == "quantize":
        table = _apply_quantize_float8(config, table, path, written_as)
        if not table:
            return
    if _ignored_converter_section(section, str(path)):
        return
    if section not in _sections() and not has_upstream_keys(section):
        raise _unknown_key_error(str(path), section, "")
    for key, value in _dotted(table):
        try:
            target = _resolve_key(section, key, value, str(path), from_text=False)
            if target is None:
                continue
            _refuse_two_spellings(written_as, target, f"{section}.{key}", value, path)
            _set_value(config, *target, value, str(path), from_text=False)
        except ConfigError as e:
            problems.append(str(e))


def _dotted(table: dict, prefix: str = ""):
    """(key, value) for each value of `table`, sub-tables' keys dotted: upstream's
    [training.dataloader] num_workers is the key 'dataloader.num_workers' of [training]."""
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _dotted(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _refuse_two_spellings(written_as: dict, target: tuple[str, str], name: str, value, path: Path) -> None:
    """An upstream name and this trainer's name of one key, set to different values in a file."""
    earlier = written_as.setdefault(target, (name, value))
    if earlier[0] != name and earlier[1] != value:
        raise ConfigError(
            f"{path} sets '{earlier[0]}' = {earlier[1]!r} and '{name}' = {value!r}, which are the "
            f"same key here ('{'.'.join(target)}'); keep one."
        )


def _continues_a_list(override: tuple[str, str, str | None]) -> bool:
    """Whether a bare word after `override` is its list's next item (--compile.components
    model loss), as upstream's command line reads it."""
    section, key, text = override
    return text is not None and _takes_a_list(section, key) is not False


def _takes_a_list(section: str, key: str) -> bool | None:
    """Whether `--section.key` takes a list, under this trainer's name, upstream's quantize
    spelling or an earlier upstream name; for an upstream key not read here, True where its
    value may be one (its own error or warning then sees all the items); None if unknown."""
    prefix = ".".join(QUANTIZE_FLOAT8) + "."
    if section == "quantize" and key.startswith(prefix):
        section, key = "float8", key[len(prefix) :]
    section, _, key = RENAMED_KEYS.get(f"{section}.{key}", f"{section}.{key}").partition(".")
    if _is_own_key(section, key):
        return typing.get_origin(typing.get_type_hints(_sections()[section])[key]) is list
    spec = unbuilt_key(f"{section}.{key}")
    if spec is None:
        return None
    return spec.default is ANY or isinstance(spec.default, list)


def _split_cli(argv: list[str]) -> tuple[str | None, list[tuple[str, str, str | None]]]:
    """Split argv into the config file and (section, key, text-or-None-for-flag) overrides."""
    config_file = None
    overrides = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") and overrides and _continues_a_list(overrides[-1]):
            section, key, text = overrides[-1]  # upstream's tyro takes lists space-separated
            overrides[-1] = (section, key, f"{text},{arg}")
            i += 1
            continue
        if not arg.startswith("--"):
            after = ""
            if overrides and overrides[-1][2] is not None and _takes_a_list(*overrides[-1][:2]) is False:
                section, key, text = overrides[-1]
                after = f" after --{section}.{key} {text}, which takes one value"
            raise ConfigError(
                f"unexpected argument '{arg}'{after}. Options look like --section.key value (see --help)."
            )
        name, eq, inline = arg[2:].partition("=")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        takes_next = not eq and nxt is not None and not nxt.startswith("--")
        text = inline if eq else (nxt if takes_next else None)
        i += 2 if takes_next else 1
        if name in ("config", "job.config_file"):
            if config_file is not None and text != config_file:
                raise ConfigError(
                    f"two config files are given: '{config_file}' and --{name} '{text}'; give one "
                    "(--config NAME_OR_PATH, or --job.config_file, not both)."
                )
            if not text:
                # An empty value is usually an unset shell variable; training the default
                # config instead would hide that.
                got = "nothing" if text is None else "an empty value"
                raise ConfigError(
                    f"--{name} needs a value, a TOML path or config file name, but got {got}. "
                    f"Pass one, or leave out --{name} to use $CONFIG_FILE or {DEFAULT_CONFIG}."
                )
            config_file = text
            continue
        section, dot, key = name.partition(".")
        if not dot:
            raise _option_without_key_error(section)
        overrides.append((section, key, text))
    return config_file, overrides


def _apply_override(config: JobConfig, section: str, key: str, text: str | None) -> None:
    where = "the command line"
    prefix = ".".join(QUANTIZE_FLOAT8) + "."
    if section == "quantize" and key.startswith(prefix):
        section, key = "float8", key[len(prefix) :]
    if _ignored_converter_section(section, where):
        return
    negated = not _is_own_key(section, key) and key.startswith("no_") and _is_bool_key(section, key[3:])
    if text is None and negated:
        setattr(getattr(config, section), key[3:], False)
        return
    target = _resolve_key(section, key, text, where, from_text=True)
    if target is None:
        return
    section, key = target
    if text is not None:
        _set_value(config, section, key, text, where, from_text=True)
    elif _is_bool_key(section, key):
        setattr(getattr(config, section), key, True)
    else:
        hint = typing.get_type_hints(_sections()[section])[key]
        raise ConfigError(f"--{section}.{key} needs a value ({describe_type(hint)}).")


# Where a config names its job.custom_config_module: this trainer's key, and upstream's.
CUSTOM_CONFIG_KEYS = (("job", "custom_config_module"), ("experimental", "custom_args_module"))


def _custom_config_module(overrides: list[tuple[str, str, str | None]], data: dict) -> tuple[str, str]:
    """The module that extends the schema, and the key that named it ("" and "" for none):
    the command line's last, else the TOML file's. Read before the rest, since it decides which
    keys exist; a value of the wrong type is left for the key's own check."""
    for section, key, text in reversed(overrides):
        if (section, key) in CUSTOM_CONFIG_KEYS:
            return text or "", f"--{section}.{key}"
    for section, key in CUSTOM_CONFIG_KEYS:
        value = data.get(section, {}).get(key) if isinstance(data.get(section), dict) else None
        if isinstance(value, str):
            return value, f"{section}.{key}"
    return "", ""


def _schema_of(module: str, key: str) -> type[JobConfig]:
    if not module:
        return JobConfig
    schema = extend_job_config(module, key)
    logger.info(f"Config schema extended by {module}: {', '.join(added_keys(schema)) or 'no new keys'}")
    return schema


def parse_args(argv: list[str] | None = None, env: dict | None = None) -> JobConfig:
    """Build the JobConfig from `argv` (default sys.argv[1:]) and `$CONFIG_FILE`.

    The config file comes from `--config`, `--job.config_file` or `$CONFIG_FILE` (in that
    order); with none of them the Llama 3 debug config is used. With `job.custom_config_module`
    set (on the command line or in the file) that module is imported first, and the config
    returned is an instance of its extended `JobConfig` (`torchtitan.config.custom`).

    Raises:
        ConfigError: for any unknown, mistyped, out-of-range or unsupported setting.
    """
    argv = sys.argv[1:] if argv is None else argv
    env = dict(__import__("os").environ) if env is None else env
    config_file, overrides = _split_cli(argv)
    source = "" if config_file or not env.get("CONFIG_FILE") else "$CONFIG_FILE"
    config_file = config_file or env.get("CONFIG_FILE") or DEFAULT_CONFIG
    path = resolve_config_path(config_file, source)
    data = _read_toml(path)
    if not data:
        defaults = JobConfig()
        logger.warning(
            f"config file {path} is empty: the run takes every default (model {defaults.model.name} "
            f"{defaults.model.flavor}, {defaults.training.steps} steps of {defaults.training.seq_len} "
            "tokens). Name a preset (--config debug_model.toml) or fill the file."
        )
    schema = _schema_of(*_custom_config_module(overrides, data))
    token = _schema.set(schema)
    try:
        # Split again: the schema's own keys decide whether a bare word continues a list.
        overrides = _split_cli(argv)[1]
        config = schema()
        _apply_toml(config, data, path)
        for section, key, text in overrides:
            _apply_override(config, section, key, text)
    finally:
        _schema.reset(token)
    config.job.config_file = str(path)
    return validate(config)


def wants_help(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv


def _schema_for_help(argv: list[str], env: dict) -> type[JobConfig]:
    """The schema `--help` lists: extended when `argv`, or the config file it or `env` names,
    sets job.custom_config_module; the trainer's own when they cannot be read."""
    try:
        config_file, overrides = _split_cli([a for a in argv if a not in ("--help", "-h")])
        config_file = config_file or env.get("CONFIG_FILE")
        data = _read_toml(resolve_config_path(config_file)) if config_file else {}
    except ConfigError:  # the help of the trainer's own keys is still worth printing
        return JobConfig
    return _schema_of(*_custom_config_module(overrides, data))


def format_help(argv: list[str] | None = None, env: dict | None = None) -> str:
    """`--help` text: every option with its type, default and one-line description; with
    job.custom_config_module set in `argv` or in the config file named there or in `env`'s
    $CONFIG_FILE (default: the process environment), that module's keys too.

    Raises:
        ConfigError: when that module cannot extend the schema.
    """
    env = dict(__import__("os").environ) if env is None else env
    schema = _schema_for_help(argv or [], env)
    lines = [
        "usage: python -m torchtitan.train [--config NAME_OR_PATH] [--section.key VALUE ...]",
        "",
        "Precedence: defaults < TOML file < command line. Booleans: --section.key or",
        "--section.no_key. Lists: space-separated (--compile.components model loss) or",
        "comma-separated in one value. The config file may also come from",
        "--job.config_file or $CONFIG_FILE; the default is " + DEFAULT_CONFIG + ".",
    ]
    defaults = schema()
    for section, cls in section_types(schema).items():
        lines += ["", f"[{section}]"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            lines.append(f"  --{section}.{f.name} ({describe_type(hints[f.name])}, default {default!r})")
            lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)
