"""TOML file + command line -> validated `JobConfig`.

Precedence is defaults < TOML file < command line. Every mistake a user can make in a config
becomes a `ConfigError` whose message names the key, the value and the fix; `train.main`
turns it into one paragraph on stderr and exit code 2.
"""

import dataclasses
import difflib
import logging
import math
import os
import sys
import types
import typing
from pathlib import Path

from torchtitan.config.job_config import (
    BUNDLED_DATASET_FILES,
    CHECKPOINT_STATE_KEYS,
    ActivationCheckpoint,
    JobConfig,
    model_compile_enabled,
)
from torchtitan.config.upstream import (
    ANY,
    CONVERTER_SECTIONS,
    QUANTIZE_FLOAT8,
    RENAMED_FOLDER_KEYS,
    RENAMED_KEYS,
    UPSTREAM_BUNDLED_DATASETS,
    UPSTREAM_ONLY_SECTIONS,
    has_upstream_keys,
    unbuilt_key,
    upstream_keys_of,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
PROJECT_ROOT = PACKAGE_ROOT.parent
DEFAULT_CONFIG = "debug_model.toml"

logger = logging.getLogger(__name__)

# Keys whose feature is not built yet: any value other than the default stops the run.
NOT_BUILT_YET = {
    "parallelism.context_parallel_degree": "context parallelism",
    "parallelism.pipeline_parallel_degree": "pipeline parallelism",
}
# `model.converters` entries, upstream's newer spelling included, and the converter each names.
CONVERTERS = {"float8": "float8", "quantize.linear.float8": "float8"}


class ConfigError(ValueError):
    """A config mistake the user can fix; its message says what and how."""


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


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _is_abbreviation(short: str, name: str) -> bool:
    letters = iter(name)
    return short[:1] == name[:1] and all(c in letters for c in short)


def did_you_mean(name: str, choices, always: bool = True) -> str:
    """' Did you mean X?' with the most similar choice, case aside: close spelling, else an
    abbreviation, else (with `always`) the least dissimilar; '' when there is none."""
    by_lower = {c.lower(): c for c in choices}
    lowered, choices = name.lower(), list(by_lower)
    close = difflib.get_close_matches(lowered, choices, n=1, cutoff=0.5)
    close = close or [c for c in choices if _is_abbreviation(c, lowered)][:1]
    if always:
        close = close or difflib.get_close_matches(lowered, choices, n=1, cutoff=0.0)
    return f" Did you mean '{by_lower[close[0]]}'?" if close else ""


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


def describe_type(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {describe_type(typing.get_args(tp)[0])}"
    return "none" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _is_optional(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _parse_text(text: str, tp):
    """Parse a command-line string into `tp`; raises ValueError when it does not fit."""
    origin = typing.get_origin(tp)
    if origin is list:
        item = typing.get_args(tp)[0]
        return [_parse_text(s.strip(), item) for s in text.split(",") if s.strip()]
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
    return f", for example {key} = {_toml_value(default)}"


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
        raise ConfigError(f"config file {path} is not valid TOML: {e}.") from None


def _apply_toml(config: JobConfig, path: Path) -> None:
    data = _read_toml(path)
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


def _check_ranges(config: JobConfig) -> None:
    for section, cls in _sections().items():
        for f in dataclasses.fields(cls):
            value = getattr(getattr(config, section), f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            # nan fails every comparison, so the bounds below would let it through.
            if not math.isfinite(value):
                raise ConfigError(
                    f"'{section}.{f.name}' = {value} is not a finite number; set it to a finite value."
                )
            lo, hi = f.metadata.get("min"), f.metadata.get("max")
            gt, lt = f.metadata.get("gt"), f.metadata.get("lt")
            bad = (lo is not None and value < lo) or (hi is not None and value > hi)
            bad = bad or (gt is not None and value <= gt) or (lt is not None and value >= lt)
            if bad:
                bounds = [f">= {lo}"] * (lo is not None) + [f"<= {hi}"] * (hi is not None)
                bounds += [f"> {gt}"] * (gt is not None) + [f"< {lt}"] * (lt is not None)
                raise ConfigError(
                    f"'{section}.{f.name}' = {value} is out of range: it must be {' and '.join(bounds)}."
                )


def _check_not_built(config: JobConfig) -> None:
    defaults = JobConfig()
    for target, feature in NOT_BUILT_YET.items():
        section, _, only_key = target.partition(".")
        keys = [only_key] if only_key else [f.name for f in dataclasses.fields(getattr(config, section))]
        for key in keys:
            value = getattr(getattr(config, section), key)
            if value != getattr(getattr(defaults, section), key):
                raise ConfigError(
                    f"'{section}.{key}' = {value!r} needs {feature}, which is not supported yet. "
                    f"Remove the key or set it back to "
                    f"{getattr(getattr(defaults, section), key)!r}."
                )


# The torch.compile backends whose partitioner (min-cut rematerialization) applies
# `activation_memory_budget`; others, "eager" first, save what they always save.
MEMORY_BUDGET_BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition")


def check_activation_checkpoint(
    ac_config: ActivationCheckpoint, model_compile_enabled: bool, compile_backend: str
) -> None:
    """What `[activation_checkpoint]` can be checked for without the model: the mode, the
    selective option, memory_budget's range and its need of a compiling backend, and debug
    with op-SAC or compile. Run by `validate` (so the launchers' check catches it) and by
    `apply_ac` for direct callers.

    Raises:
        ConfigError: naming the key, its value and the fix.
    """
    valid_modes = ("none", "full", "selective", "memory_budget")
    if ac_config.mode not in valid_modes:
        raise ConfigError(
            f"'activation_checkpoint.mode' = '{ac_config.mode}' is unknown; use one of "
            f"{', '.join(valid_modes)}."
        )
    option = ac_config.selective_ac_option
    every_nth = option.isascii() and option.isdigit() and int(option) > 0
    if ac_config.mode == "selective" and option != "op" and not every_nth:
        raise ConfigError(
            f"'activation_checkpoint.selective_ac_option' = '{option}' is invalid: use \"op\" "
            'for per-op selective AC or a positive integer N (as a string, e.g. "2").'
        )
    if not 0.0 <= ac_config.memory_budget <= 1.0:
        raise ConfigError(
            f"'activation_checkpoint.memory_budget' = {ac_config.memory_budget} is outside [0, 1]: "
            "0 recomputes everything, 1 saves everything."
        )
    if ac_config.mode == "memory_budget" and not model_compile_enabled:
        raise ConfigError(
            "'activation_checkpoint.mode' = 'memory_budget' works through torch.compile's "
            'partitioner: set compile.enable = true with "model" in compile.components.'
        )
    if ac_config.mode == "memory_budget" and compile_backend not in MEMORY_BUDGET_BACKENDS:
        raise ConfigError(
            f"'activation_checkpoint.mode' = 'memory_budget' has no effect with 'compile.backend' = "
            f"'{compile_backend}', which does not apply the budget; use one of "
            f"{', '.join(MEMORY_BUDGET_BACKENDS)}, or another AC mode."
        )
    if ac_config.debug and ac_config.mode != "none":
        if model_compile_enabled:
            raise ac_debug_conflict('compiled blocks (compile.enable with "model" in compile.components)')
        if ac_config.mode == "selective" and option == "op":
            raise ac_debug_conflict(
                'per-op selective AC (selective_ac_option = "op"), which checkpoints by a policy'
            )


def attention_backend_conflict(mask_type: str, whose: str = "") -> ConfigError:
    """The error for a mask type other than causal with the sdpa attention backend; `whose`
    says where the backend came from when the config may not have set it."""
    return ConfigError(
        f"'model.attn_mask_type' = '{mask_type}' needs the flex attention backend, but "
        f"'model.attn_backend' is 'sdpa'{whose}, which is causal only. Set "
        'model.attn_backend = "flex", or model.attn_mask_type = "causal".'
    )


def split_documents_conflict(mask_type: str, backend: str | None, whose: str = "") -> ConfigError:
    """The error for `model.attn_split_documents` with a mask type it does not apply to; `whose`
    says where the mask type came from when the config may not have set it. The fix it names
    also sets the flex backend unless ``backend`` already is flex."""
    problem = (
        f"'model.attn_split_documents' = true, but 'model.attn_mask_type' is '{mask_type}'{whose}; "
        "the key splits sliding_window and chunked masks at EOS."
    )
    if mask_type == "block_causal":
        return ConfigError(f"{problem} block_causal always splits documents: drop the key.")
    flex = "" if backend == "flex" else 'model.attn_backend = "flex" and '
    return ConfigError(
        f"{problem} For causal attention split at documents set {flex}model.attn_mask_type = "
        '"block_causal" (which always splits), and drop the key.'
    )


def ac_debug_conflict(conflict: str) -> ConfigError:
    """The error for `activation_checkpoint.debug` with `conflict`, something torch's checkpoint
    debug mode cannot trace: it replaces a checkpoint's `context_fn` with its own tracer and
    refuses one that is set (op-SAC, full AC of MoE blocks), and fails inside compile."""
    return ConfigError(
        f"'activation_checkpoint.debug' = true cannot trace {conflict}: torch's checkpoint "
        'debug mode only wraps blocks checkpointed without a policy. Trace with mode "full" (or '
        "selective N) on a dense model with compile off, or set debug = false."
    )


def _check_checkpoint(config: JobConfig) -> None:
    c = config.checkpoint
    unknown = sorted(set(c.exclude_from_loading) - set(CHECKPOINT_STATE_KEYS))
    if unknown:
        raise ConfigError(
            f"'checkpoint.exclude_from_loading' = {c.exclude_from_loading} names {unknown}, which a "
            f"checkpoint does not hold; valid entries: {', '.join(CHECKPOINT_STATE_KEYS)}."
        )
    if not c.enable:
        _refuse_checkpoint_keys_without_enable(config)
    if c.initial_load_in_hf and not c.initial_load_model_only:
        raise ConfigError(
            "'checkpoint.initial_load_model_only' = false asks for the optimizer and training state, "
            "which a Hugging Face checkpoint (checkpoint.initial_load_in_hf = true) does not hold; "
            "set initial_load_model_only = true."
        )
    if c.last_save_in_hf and not c.last_save_model_only:
        raise ConfigError(
            "'checkpoint.last_save_in_hf' = true writes the model weights only, but "
            "checkpoint.last_save_model_only = false asks for a last checkpoint to resume from; set "
            "last_save_model_only = true, or last_save_in_hf = false (and convert a DCP checkpoint "
            "later with scripts/checkpoint_conversion/convert_to_hf.py)."
        )
    if c.initial_load_in_hf and not c.initial_load_path:
        raise ConfigError(
            "'checkpoint.initial_load_in_hf' = true needs 'checkpoint.initial_load_path', the folder "
            "with the Hugging Face safetensors."
        )


def _refuse_checkpoint_keys_without_enable(config: JobConfig) -> None:
    """Keys that act only with checkpoint.enable; ignoring them would train from scratch, or end
    with no export, without a word."""
    c, defaults = config.checkpoint, type(config.checkpoint)()
    set_keys = [
        f"'checkpoint.{key}' = {_as_written(getattr(c, key))}"
        for key in ("initial_load_path", "load_step", "exclude_from_loading", "last_save_in_hf")
        if getattr(c, key) != getattr(defaults, key)
    ]
    if set_keys:
        folder = Path(config.job.dump_folder) / c.folder
        raise ConfigError(
            f"{set_keys[0]} acts only with checkpoint.enable = true; set it (this run's checkpoints "
            f"then go to '{folder}'), or remove the key."
        )


def _check_profiling(p) -> None:
    if p.enable_profiling and p.profile_freq < p.profiler_warmup + p.profiler_active:
        raise ConfigError(
            f"'profiling.profile_freq' = {p.profile_freq} is shorter than profiler_warmup "
            f"({p.profiler_warmup}) + profiler_active ({p.profiler_active}); raise profile_freq."
        )


# Folder keys (all under job.dump_folder but itself): an empty value, usually an unset shell
# variable, would write into the current folder.
FOLDER_KEYS = ("job.dump_folder", "metrics.save_tb_folder", "checkpoint.folder",
               "profiling.save_traces_folder", "profiling.save_memory_snapshot_folder",
               "comm.save_traces_folder")  # fmt: skip


def _check_folders(config: JobConfig) -> None:
    for name in FOLDER_KEYS:
        section, _, key = name.partition(".")
        if not getattr(getattr(config, section), key).strip():
            raise ConfigError(
                f"'{name}' is empty, often an unset shell variable: the run would write into the "
                "current folder; give a folder."
            )
    dump = Path(config.job.dump_folder)
    # os.path.exists: Path.exists raises where a parent cannot be entered.
    existing = next(p for p in (dump, *dump.parents) if os.path.exists(p))
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return
    problem = "is not a folder" if not existing.is_dir() else "cannot be written"
    raise ConfigError(
        dump_folder_error(config.job.dump_folder, problem if existing == dump else f"{existing} {problem}")
    )


def dump_folder_error(dump_folder: str, problem: str) -> str:
    """The message for a `job.dump_folder` the run cannot write to."""
    return f"'job.dump_folder' = '{dump_folder}' cannot be used: {problem}; choose another folder."


def _check_consistency(config: JobConfig) -> None:
    t, p = config.training, config.parallelism
    _check_folders(config)
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        raise ConfigError(
            f"'parallelism.data_parallel_shard_degree' = {p.data_parallel_shard_degree} is "
            "invalid: use a positive degree or -1 for the ranks left over."
        )
    if t.global_batch_size != -1 and t.global_batch_size < 1:
        raise ConfigError(
            f"'training.global_batch_size' = {t.global_batch_size} is invalid: use a positive "
            "number of sequences or -1 for local_batch_size x data-parallel degree."
        )
    if t.dtype == "bfloat16" and t.mixed_precision_param == "float32":
        raise ConfigError(
            "'training.dtype' = 'bfloat16' with 'training.mixed_precision_param' = 'float32' "
            "would upcast bf16 weights; set mixed_precision_param to 'bfloat16'."
        )
    if config.optimizer.early_step_in_backward and t.max_norm > 0:
        raise ConfigError(
            f"'training.max_norm' = {t.max_norm} clips by the norm of all gradients, which "
            "'optimizer.early_step_in_backward' = true frees one by one as it steps; set "
            "training.max_norm = 0 (grad_norm is still logged) or early_step_in_backward = false."
        )
    m = config.model
    if m.attn_backend == "sdpa" and m.attn_mask_type not in (None, "causal"):
        raise attention_backend_conflict(m.attn_mask_type)
    if m.attn_split_documents and m.attn_mask_type in ("causal", "block_causal"):
        raise split_documents_conflict(m.attn_mask_type, m.attn_backend)
    _check_expert_parallel(p)
    _check_sequence_shards(config)
    _check_converters(config)
    _check_upstream_datasets(config)
    _check_validation(config.validation, t)
    check_activation_checkpoint(
        config.activation_checkpoint, model_compile_enabled(config), config.compile.backend
    )
    _check_checkpoint(config)
    _check_profiling(config.profiling)
    if config.compile.enable:
        unknown = sorted(set(config.compile.components) - {"model", "loss"})
        if unknown:
            raise ConfigError(
                f"'compile.components' = {config.compile.components} contains {unknown}; "
                "valid components are 'model' and 'loss'."
            )


def _check_converters(config: JobConfig) -> None:
    converters = config.model.converters
    unknown = [name for name in converters if name not in CONVERTERS]
    if unknown:
        raise ConfigError(
            f"'model.converters' = {converters} names {unknown}, which this trainer does not build; "
            "the converter here is float8 (also spelled 'quantize.linear.float8'). Remove the rest."
        )
    f8 = config.float8
    if "float8" in {CONVERTERS[name] for name in converters}:
        if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
            raise ConfigError(
                f"'float8.enable_fsdp_float8_all_gather' = true needs recipe_name 'tensorwise' (one scale "
                f"per weight), but recipe_name = '{f8.recipe_name}'; set recipe_name = 'tensorwise' or "
                "turn the float8 all-gather off."
            )
        if "auto_filter_small_kn" in f8.filter_fqns and f8.recipe_name == "rowwise_with_gw_hp":
            raise ConfigError(
                "'float8.filter_fqns' holds 'auto_filter_small_kn', which torchao has no size heuristic "
                "for under recipe_name 'rowwise_with_gw_hp'; remove the entry, or use 'tensorwise' or "
                "'rowwise'."
            )
        if f8.moe_fqns:
            raise ConfigError(
                f"'float8.moe_fqns' = {f8.moe_fqns} asks for float8 grouped experts, which this trainer "
                "does not build (float8 converts nn.Linear layers; the experts train in the "
                "high-precision dtype); set moe_fqns = [] or remove it."
            )
        if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
            raise ConfigError(
                "'float8.precompute_float8_dynamic_scale_for_fsdp' = true precomputes the scales of the "
                "float8 all-gather; set float8.enable_fsdp_float8_all_gather = true too, or turn it off."
            )
    elif f8 != JobConfig().float8:
        logger.warning(
            "[float8] is set but has no effect: float8 training is on only when model.converters "
            'includes "float8". Add it, or remove the section to silence this warning.'
        )


def _check_upstream_datasets(config: JobConfig) -> None:
    """Upstream's bundled samples would otherwise be looked up on the hub, which fails (or hangs
    offline) only once the ranks have started."""
    for section in ("training", "validation") if config.validation.enable else ("training",):
        name = getattr(config, section).dataset
        if name in UPSTREAM_BUNDLED_DATASETS and getattr(config, section).dataset_path is None:
            streamed = "'c4' (streamed from the hub), " if section == "training" else ""
            raise ConfigError(
                f"'{section}.dataset' = '{name}' is upstream torchtitan's bundled C4 sample, which is "
                f"not shipped here; use '{UPSTREAM_BUNDLED_DATASETS[name]}' (the bundled corpus here), "
                f"{streamed}or set '{section}.dataset_path' to local files."
            )


def _check_validation(v, t) -> None:
    if v.enable and v.dataset_path is None and v.dataset not in BUNDLED_DATASET_FILES:
        raise ConfigError(
            f"'validation.dataset' = '{v.dataset}' would stream from the hub, but validation needs a "
            "finite split: set 'validation.dataset_path' to local files of a held-out split (or use "
            "'smoke_validation', the bundled one)."
        )
    if v.steps == 0 or v.steps < -1:
        raise ConfigError(
            f"'validation.steps' = {v.steps} is invalid: use a positive number of batches or -1 "
            "for every whole global batch of the split."
        )
    # Only an enabled validation runs the model at validation.seq_len, so a disabled section
    # may keep the 2048 default under a shorter training.seq_len.
    if v.enable and v.seq_len > t.seq_len:
        raise ConfigError(
            f"'validation.seq_len' = {v.seq_len} exceeds 'training.seq_len' = {t.seq_len}: the "
            f"model's RoPE table covers only training.seq_len positions. Set validation.seq_len "
            f"to at most {t.seq_len}."
        )


def _check_sequence_shards(config: JobConfig) -> None:
    """Sequence parallelism splits every sequence into tensor_parallel_degree equal shards:
    the training one, and the validation one when validation runs."""
    tp = config.parallelism.tensor_parallel_degree
    lengths = [("training.seq_len", config.training.seq_len)]
    if config.validation.enable:
        lengths.append(("validation.seq_len", config.validation.seq_len))
    for key, length in lengths:
        if length % tp:
            raise ConfigError(
                f"'{key}' = {length} is not a multiple of 'parallelism.tensor_parallel_degree' = {tp}: "
                f"sequence parallelism splits each sequence into {tp} equal shards. Use a multiple "
                f"of {tp}, e.g. {length - length % tp or tp}."
            )


def _check_expert_parallel(p) -> None:
    """What can be told from the config alone; the resolved degrees are checked at parallelize."""
    ep = p.expert_parallel_degree
    etp, tp = p.expert_tensor_parallel_degree, p.tensor_parallel_degree
    if etp not in (1, tp):
        raise ConfigError(
            f"'parallelism.expert_tensor_parallel_degree' = {etp} must be 1 or the "
            f"tensor_parallel_degree ({tp}): under expert parallelism the experts are either spread over "
            "the TP ranks too (1) or sharded over TP."
        )
    if ep == 1:
        return
    shard = p.data_parallel_shard_degree
    borrows_tp = tp > 1 and etp == 1
    if borrows_tp and ep % tp:
        raise ConfigError(
            f"'parallelism.expert_parallel_degree' = {ep} is not a multiple of tensor_parallel_degree "
            f"{tp}: with expert_tensor_parallel_degree 1 the EP group takes all the TP ranks and the "
            f"rest from the FSDP shard group. Choose a multiple of {tp}, or set "
            f"parallelism.expert_tensor_parallel_degree = {tp} to shard the experts over TP instead."
        )
    from_shard = ep // tp if borrows_tp else ep
    if shard != -1 and shard % from_shard:
        raise ConfigError(
            f"'parallelism.expert_parallel_degree' = {ep} takes {from_shard} ranks of the FSDP shard "
            f"group, which does not divide data_parallel_shard_degree {shard}: expert parallelism "
            "borrows its ranks from that group; choose an expert_parallel_degree that fits it."
        )


def validate(config: JobConfig) -> JobConfig:
    """Range, not-built-yet and cross-key checks; raises ConfigError on the first problem."""
    _check_ranges(config)
    _check_consistency(config)
    _check_not_built(config)
    return config


def parse_args(argv: list[str] | None = None, env: dict | None = None) -> JobConfig:
    """Build the JobConfig from `argv` (default sys.argv[1:]) and `$CONFIG_FILE`.

    The config file comes from `--config`, `--job.config_file` or `$CONFIG_FILE` (in that
    order); with none of them the Llama 3 debug config is used.

    Raises:
        ConfigError: for any unknown, mistyped, out-of-range or unsupported setting.
    """
    argv = sys.argv[1:] if argv is None else argv
    env = dict(__import__("os").environ) if env is None else env
    config_file, overrides = _split_cli(argv)
    source = "" if config_file or not env.get("CONFIG_FILE") else "$CONFIG_FILE"
    config_file = config_file or env.get("CONFIG_FILE") or DEFAULT_CONFIG
    path = resolve_config_path(config_file, source)
    config = JobConfig()
    _apply_toml(config, path)
    for section, key, text in overrides:
        _apply_override(config, section, key, text)
    config.job.config_file = str(path)
    return validate(config)


def wants_help(argv: list[str]) -> bool:
    return "--help" in argv or "-h" in argv


def format_help() -> str:
    """`--help` text: every option with its type, default and one-line description."""
    lines = [
        "usage: python -m torchtitan.train [--config NAME_OR_PATH] [--section.key VALUE ...]",
        "",
        "Precedence: defaults < TOML file < command line. Booleans: --section.key or",
        "--section.no_key. Lists: space-separated (--compile.components model loss) or",
        "comma-separated in one value. The config file may also come from",
        "--job.config_file or $CONFIG_FILE; the default is " + DEFAULT_CONFIG + ".",
    ]
    defaults = JobConfig()
    for section, cls in _sections().items():
        lines += ["", f"[{section}]"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            lines.append(f"  --{section}.{f.name} ({describe_type(hints[f.name])}, default {default!r})")
            lines.append(f"      {f.metadata.get('help', '')}")
    return "\n".join(lines)


def to_toml(config: JobConfig) -> str:
    """Serialize a JobConfig as TOML text (None values are left out, as TOML has no null)."""
    out = []
    for section, table in config.to_dict().items():
        out.append(f"[{section}]")
        for key, value in table.items():
            if value is not None:
                out.append(f"{key} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def _as_written(value) -> str:
    """A value as messages quote it: a string in single quotes, anything else as TOML writes it."""
    return f"'{value}'" if isinstance(value, str) else _toml_value(value)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + "".join(_toml_char(c) for c in str(value)) + '"'


# A TOML basic string may not hold '"', '\\' or control characters as they are.
_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_char(c: str) -> str:
    if c in _TOML_ESCAPES:
        return _TOML_ESCAPES[c]
    return f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
