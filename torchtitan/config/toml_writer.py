"""JobConfig -> TOML text: the resolved config a run writes, and values as messages quote them."""

from torchtitan.config.job_config import JobConfig


def to_toml(config: JobConfig) -> str:
    """Serialize a JobConfig as TOML text (None values are left out, as TOML has no null)."""
    out = []
    for section, table in config.to_dict().items():
        out.append(f"[{section}]")
        for key, value in table.items():
            if value is not None:
                out.append(f"{key} = {toml_value(value)}")
        out.append("")
    return "\n".join(out)


def as_written(value) -> str:
    """A value as messages quote it: a string in single quotes, anything else as TOML writes it."""
    return f"'{value}'" if isinstance(value, str) else toml_value(value)


def toml_value(value) -> str:
    """One value in TOML syntax: bools lower-case, numbers as Python writes them, strings escaped."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return '"' + "".join(_toml_char(c) for c in str(value)) + '"'


# A TOML basic string may not hold '"', '\\' or control characters as they are.
_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_char(c: str) -> str:
    if c in _TOML_ESCAPES:
        return _TOML_ESCAPES[c]
    return f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
