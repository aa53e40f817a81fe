"""
The kinds of value many options share: numbers, counts, durations, sizes, URL paths.

Each parser takes the option's name (for the message) and a value as it arrives -- a
``str`` from the command line or the environment, or a native TOML value -- and returns the
value :class:`~txlb._config.config.Config` holds, or raises one :class:`ConfigError` line.
"""

from __future__ import annotations

import re

from txlb._config.errors import ConfigError


def parse_number(option: str, value: object) -> float:
    """Any finite or infinite number (the callers bound it); a bool is not a number."""
    if isinstance(value, bool):
        raise ConfigError(f"--{option}: {value!r} is not a number")
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:  # an int past a float's range
            raise ConfigError(f"--{option}: {value!r} is too large") from None
    try:
        return float(str(value).strip())
    except ValueError:
        raise ConfigError(f"--{option}: {value!r} is not a number") from None


def parse_duration(option: str, value: object) -> float:
    """Seconds, decimals allowed; must be positive."""
    seconds = parse_number(option, value)
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"--{option}: {value!r} must be a positive number of seconds")
    return seconds


def parse_count(option: str, value: object) -> int:
    """A whole number, at least 1."""
    count = parse_nonnegative_int(option, value)
    if count < 1:
        raise ConfigError(f"--{option}: {value!r} must be at least 1")
    return count


def parse_switch(option: str, value: object) -> bool:
    """``on`` or ``off`` (a config file may say ``true`` or ``false``)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("on", "off"):
        raise ConfigError(f"--{option}: {value!r} is not 'on' or 'off'")
    return text == "on"


def parse_nonnegative_int(option: str, value: object) -> int:
    """A whole number, 0 or more."""
    if isinstance(value, bool):
        raise ConfigError(f"--{option}: {value!r} is not a whole number")
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip()
        if not re.fullmatch(r"\d+", text):
            raise ConfigError(f"--{option}: {value!r} is not a whole number")
        number = int(text)
    if number < 0:
        raise ConfigError(f"--{option}: {value!r} must not be negative")
    return number


_SIZE_UNITS = {"": 1, "B": 1, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_size(option: str, value: object) -> int:
    """Bytes, or a number with a ``KiB``, ``MiB`` or ``GiB`` suffix."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]iB|B)?\s*", str(value), re.IGNORECASE)
    if not match:
        raise ConfigError(f"--{option}: {value!r} is not a size (bytes, or N with KiB/MiB/GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").upper()])


def parse_path(option: str, value: object) -> str:
    """An absolute URL path such as ``/health``."""
    text = str(value)
    if not text.startswith("/") or any(c.isspace() for c in text):
        raise ConfigError(f"--{option}: {value!r} must be a URL path starting with '/'")
    return text


def parse_nonnegative_seconds(option: str, value: object) -> float:
    """Seconds, decimals allowed; 0 (the feature is off) or more."""
    seconds = parse_number(option, value)
    if not seconds >= 0 or seconds == float("inf"):
        raise ConfigError(f"--{option}: {value!r} must be 0 or more seconds")
    return seconds
