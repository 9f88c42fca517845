"""The error every config mistake becomes, and the "did you mean" hint its messages share."""

import difflib


class ConfigError(ValueError):
    """A config mistake the user can fix; its message says what and how."""


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
