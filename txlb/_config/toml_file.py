"""
The ``--config`` file read: a bounded read of a regular file, parsed as TOML.

Every way the file can fail -- missing, a FIFO or a device, too large, not UTF-8, not
TOML, nested too deeply -- is one :class:`ConfigError` line, whether at start-up or on a
reload (which reads it off the reactor thread and hands the result to ``build_config``).
"""

from __future__ import annotations

import os
import stat
import sys
from typing import Any

from txlb._config.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


#: The largest ``--config`` file txlb reads: a real one is a few kilobytes (10,000 backend
#: tables are about 1 MiB), so anything past this is a mistake and refused rather than read
#: and parsed at length.
MAX_CONFIG_BYTES = 4 * 1024**2


def read_text(path: str, option: str = "config") -> str:
    """
    Read the ``--config`` file (or another TOML file of txlb's, named by ``option`` in the
    messages: ``--keys-file``), turning every way it can fail into a ConfigError.

    Only a regular file is read: the path is opened without blocking (a FIFO's open
    would wait for a writer) and the opened file itself is checked, so a FIFO, a device
    or a directory is refused, never waited on, however the path changes meanwhile.  At
    most :data:`MAX_CONFIG_BYTES` are read.  What the file holds may make the parser
    fail in three ways besides invalid TOML -- bytes that are not UTF-8, arrays or inline
    tables nested past Python's recursion limit, an integer too long to convert -- and
    each is the same one-line refusal.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise ConfigError(f"--{option}: cannot read {path!r}: {error.strerror}") from None
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(f"--{option}: {path!r} is not a regular file "
                              f"({_file_kind(mode)})")
        raw = _read_at_most(descriptor, MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"--{option}: cannot read {path!r}: {error.strerror}") from None
    finally:
        os.close(descriptor)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"--{option}: {path!r} is larger than "
                          f"{MAX_CONFIG_BYTES // 1024**2} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise ConfigError(f"--{option}: {path!r} is not UTF-8 text: byte "
                          f"0x{raw[error.start]:02x} on line {line}") from None
    return text


def read_toml(path: str, option: str = "config") -> dict[str, Any]:
    """The TOML file at ``path`` read (:func:`read_text`) and parsed (:func:`loads`)."""
    return loads(read_text(path, option), path, option)


def loads(text: str, path: str, option: str = "config") -> dict[str, Any]:
    """``text`` (the file at ``path``) parsed as TOML; every failure one ConfigError."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--{option}: {path!r} is not valid TOML: {error}") from None
    except RecursionError:
        raise ConfigError(f"--{option}: {path!r} is not valid TOML: arrays or inline tables "
                          "nested too deeply") from None
    except ValueError as error:  # an integer past Python's digit limit
        raise ConfigError(f"--{option}: {path!r} is not valid TOML: {error}") from None


def _read_at_most(descriptor: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of an open file, fewer only at its end."""
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(descriptor, min(left, 1024**2))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _file_kind(mode: int) -> str:
    """What a path that is not a regular file is, in a word."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((word for test, word in kinds if test(mode)), "not a file")
