"""
:class:`OptionSpec`: one option as the config table (and a policy with options) declares it.

Its own module, at the bottom of the package, so that a policy module can declare the
options it reads next to the code that reads them, and the table collect them, without the
policy importing the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen
class OptionSpec:
    """One option: its long name, environment variable, default and parser."""

    name: str
    default: object
    parse: Callable[[str, Any], Any]
    #: the help line, or a function giving it when it depends on what is installed
    help: str | Callable[[], str]
    env: str | None = None
    cli: bool = True
    #: the default as ``--help`` shows it, where its value does not read well (a list, none)
    shown_default: str | None = None

    @property
    def attribute(self) -> str:
        return self.name.replace("-", "_")

    @property
    def help_text(self) -> str:
        return self.help if isinstance(self.help, str) else self.help()


    @property
    def default_value(self) -> Any:
        """The default as parsed, as a :class:`~txlb._config.config.Config` holds it."""
        return None if self.default is None else self.parse(self.name, self.default)
