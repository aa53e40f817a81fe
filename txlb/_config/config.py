"""
One frozen :class:`Config`, built from the command line, the environment, a TOML file and
the defaults, in that order of precedence.

Every option is described once, in :data:`~txlb._config.table.OPTIONS` (its default
included: a field's default here is the table's, parsed); validation happens before any
port is opened, and every problem is a :class:`ConfigError` whose message names the option
and the offending value -- the one line an operator sees when start-up refuses.  The checks
that need the whole config (``--workers`` and ``--listen``, the classes and what names
them) run here on the finished one.
"""

from __future__ import annotations

import os
import secrets
import warnings
from collections.abc import Mapping
from typing import Any

import attrs

from txlb._config.backends import BackendSpec, DnsBackendSpec, split_backends
from txlb._config.classes import ClassSpec, built_in
from txlb._config.errors import ConfigError, did_you_mean
from txlb._config.keys import KeysFile, read_keys
from txlb._config.limits import BudgetSpec
from txlb._config.routing import RouteSpec
from txlb._config.shared import SharedStateSpec
from txlb._config.table import BY_NAME, DEFAULT_FLEET, OPTIONS
from txlb._config.toml_file import read_toml

#: Each option's default as the field holds it: the table's, parsed once.
_DEFAULT: dict[str, Any] = {spec.attribute: spec.default_value for spec in OPTIONS}

#: Keys the contract defines whose features are still to come: a config file written for
#: them is accepted (with a warning) rather than refused, so it keeps working on upgrade.
PLANNED_KEYS: frozenset[str] = frozenset()


@attrs.frozen
class Config:
    """Everything the balancer needs to start, validated.  Build with :func:`build_config`."""

    backends: tuple[BackendSpec, ...]
    listen: str = _DEFAULT["listen"]
    health_interval: float = _DEFAULT["health_interval"]
    health_path: str = _DEFAULT["health_path"]
    health_timeout: float = _DEFAULT["health_timeout"]
    fall: int = _DEFAULT["fall"]
    rise: int = _DEFAULT["rise"]
    connect_timeout: float = _DEFAULT["connect_timeout"]
    read_timeout: float = _DEFAULT["read_timeout"]
    send_timeout: float = _DEFAULT["send_timeout"]
    log_file: str = _DEFAULT["log_file"]
    log_max_bytes: int = _DEFAULT["log_max_bytes"]
    log_backups: int = _DEFAULT["log_backups"]
    log_format: str = _DEFAULT["log_format"]
    log_content: int = _DEFAULT["log_content"]
    log_user: str = _DEFAULT["log_user"]
    log_user_key: str | None = attrs.field(default=_DEFAULT["log_user_key"], repr=False)
    log_error_body: int | None = _DEFAULT["log_error_body"]
    admin: str = _DEFAULT["admin"]
    admin_token: str | None = _DEFAULT["admin_token"]
    admin_hosts: tuple[str, ...] = _DEFAULT["admin_hosts"]
    shutdown_timeout: float = _DEFAULT["shutdown_timeout"]
    policy: str = _DEFAULT["policy"]
    queue_timeout: float = _DEFAULT["queue_timeout"]
    unknown_model: str = _DEFAULT["unknown_model"]
    affinity: str | None = _DEFAULT["affinity"]
    #: the built-in policies' own options, declared in their modules (cache_aware.py)
    cache_block: int = _DEFAULT["cache_block"]
    cache_entries: int = _DEFAULT["cache_entries"]
    cache_load: float = _DEFAULT["cache_load"]
    routes: tuple[RouteSpec, ...] = _DEFAULT["routes"]
    retries: int = _DEFAULT["retries"]
    retry_window: float = _DEFAULT["retry_window"]
    resume: bool = _DEFAULT["resume"]
    resume_tries: int = _DEFAULT["resume_tries"]
    outlier_5xx: int = _DEFAULT["outlier_5xx"]
    outlier_cooldown: float = _DEFAULT["outlier_cooldown"]
    hung_after: float = _DEFAULT["hung_after"]
    slow_start: float = _DEFAULT["slow_start"]
    max_body: int = _DEFAULT["max_body"]
    header_timeout: float = _DEFAULT["header_timeout"]
    rate_limit: float | None = _DEFAULT["rate_limit"]
    rate_burst: int | None = _DEFAULT["rate_burst"]
    rate_key: str = _DEFAULT["rate_key"]
    workers: int = _DEFAULT["workers"]
    lb_status: str = _DEFAULT["lb_status"]
    x_backend: str = _DEFAULT["x_backend"]
    budgets: tuple[BudgetSpec, ...] = _DEFAULT["budgets"]
    budget_completion_estimate: int = _DEFAULT["budget_completion_estimate"]
    classes: tuple[ClassSpec, ...] = _DEFAULT["classes"]
    priority_header: str | None = _DEFAULT["priority_header"]
    default_class: str = _DEFAULT["default_class"]
    resolver: tuple[tuple[str, int], ...] = _DEFAULT["resolver"]
    #: the ``dns:``/``srv:`` entries of ``--backends`` (``backends`` holds the addresses)
    dns_backends: tuple[DnsBackendSpec, ...] = ()
    shared_state: SharedStateSpec | None = _DEFAULT["shared_state"]
    auth: str = _DEFAULT["auth"]
    keys_file: str | None = _DEFAULT["keys_file"]
    #: ``--fairness``: ``None`` is ``auto`` (see :func:`fairness_of`)
    fairness: str | None = _DEFAULT["fairness"]
    #: ``--keys-file`` as read when this config was built (every reload reads it again)
    keys: KeysFile | None = None


def fairness_of(config: Config) -> str:
    """The queue's order within a class: ``--fairness``, where ``auto`` is VTC with keys."""
    if config.fairness is not None:
        return config.fairness
    return "vtc" if config.auth == "keys" else "fifo"


def check_auth(config: Config) -> None:
    """
    ``--auth keys`` needs a keys file, and the keys file is the one source of who a client
    is: a ``[[classes]]`` bound to key digests, or a budget of one client (a token, an
    address, a header's value), would be a second one that can disagree with it, so either
    is refused with keys on (a budget of every client applies to each tenant).  A tenant's
    class must be one of the classes.
    """
    if config.auth != "keys":
        return
    if config.keys is None:
        raise ConfigError("--auth: 'keys' needs --keys-file, the file of the tenants' keys "
                          "(python -m txlb.keys makes one)")
    for spec in config.classes:
        if spec.keys:
            raise ConfigError(f"classes.keys: class {spec.name!r} is bound to keys, but with "
                              "--auth keys a tenant's class is set in the keys file "
                              "(tenants.NAME.class)")
    for budget in config.budgets:
        if budget.key is not None:
            raise ConfigError(f"budgets: budget {budget.name!r} is for one client, but with "
                              "--auth keys the client is the tenant and a tenant's own "
                              "budget is set in the keys file (tenants.NAME.tokens_per_minute)")
    taken = {budget.name for budget in config.budgets}
    for tenant in config.keys.tenants:
        if tenant.windows and tenant_budget_name(tenant.name) in taken:
            raise ConfigError(f"budgets: budget {tenant_budget_name(tenant.name)!r} is the "
                              f"name of tenant {tenant.name!r}'s own budget (keys file); "
                              "rename the [[budgets]] entry")
    names = [spec.name for spec in class_specs(config)]
    for tenant in config.keys.tenants:
        if tenant.priority is not None and tenant.priority not in names:
            raise ConfigError(f"--keys-file: tenants.{tenant.name}.class {tenant.priority!r} "
                              f"is not one of the classes ({', '.join(names)})"
                              f"{did_you_mean(tenant.priority, names)}")


def tenant_budget_name(tenant: str) -> str:
    """The budget a tenant's ``tokens_per_minute``/``tokens_per_day`` make: ``tenant.NAME``."""
    return f"tenant.{tenant}"


def with_tenant_budgets(config: Config) -> Config:
    """
    ``config`` with each tenant's own token budget (keys file) among its budgets, under
    ``--auth keys``: one budget of that tenant's requests alone, limited and shown as a
    ``[[budgets]]`` entry is.
    """
    if config.auth != "keys" or config.keys is None:
        return config
    own = tuple(BudgetSpec(tenant_budget_name(t.name), "tenant", f"tenant:{t.name}", None,
                           t.windows) for t in config.keys.tenants if t.windows)
    return attrs.evolve(config, budgets=config.budgets + own) if own else config


def check_workers(config: Config) -> None:
    """
    ``--workers`` above 1 shares one listening socket between processes, which txlb does
    for TCP endpoints only (an ``ssl:`` or ``unix:`` one is refused rather than half
    supported).
    """
    if config.workers > 1 and config.listen.split(":", 1)[0].lower() not in ("tcp", "tcp6"):
        raise ConfigError(f"--workers: {config.workers} worker processes need a tcp: "
                          f"--listen endpoint, not {config.listen!r}")


def class_specs(config: Config) -> tuple[ClassSpec, ...]:
    """The classes in force: the file's, or the built-in three (see :func:`built_in`)."""
    return config.classes or built_in(config.queue_timeout)


def check_classes(config: Config) -> None:
    """
    What needs the whole config: the default class exists, starvation ages are short, and
    every budget given for a class names one.
    """
    specs = class_specs(config)
    for spec in specs:
        timeout = spec.queue_timeout or config.queue_timeout
        if spec.starvation_age is not None and spec.starvation_age >= timeout:
            raise ConfigError(f"classes.starvation_age: {spec.starvation_age:g}s of class "
                              f"{spec.name!r} is not shorter than its queue timeout "
                              f"({timeout:g}s): its requests would time out before the "
                              "guard serves them")
    names = [spec.name for spec in specs]
    if config.default_class not in names:
        raise ConfigError(f"--default-class: {config.default_class!r} is not one of the "
                          f"classes ({', '.join(names)})"
                          f"{did_you_mean(config.default_class, names)}")
    for budget in config.budgets:
        # a budget for a class no request can be in would never apply, silently
        if budget.priority is not None and budget.priority not in names:
            raise ConfigError(f"budgets.class: budget {budget.name!r} is for class "
                              f"{budget.priority!r}, which is not one of the classes "
                              f"({', '.join(names)}){did_you_mean(budget.priority, names)}")


def build_config(
    command_line: Mapping[str, object | None],
    environ: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
) -> Config:
    """
    Merge the sources in precedence order: command line > environment > TOML > default.

    ``command_line`` maps long option names (``"health-interval"``) to the value given on
    the command line, or ``None`` when it was not given; it may also hold ``"config"``.
    ``file_values`` is that file as :func:`read_toml` already read it (a reload reads it
    off the reactor thread); without it the file is read here.

    The default fleet (``127.0.0.1:8002``-``8009``) is for a start with nothing
    configured: a config file that has no ``backends`` key, with no ``--backends`` or
    ``LB_BACKENDS`` either, is refused -- it is what a truncated save leaves, and
    reloading it would send every request to whatever listens on those local ports.
    """
    env = os.environ if environ is None else environ
    config_path = command_line.get("config") or env.get("LB_CONFIG")
    in_file: dict[str, Any] = {}
    if config_path:
        in_file = dict(read_toml(str(config_path)) if file_values is None else file_values)
        for key in sorted(set(in_file) & PLANNED_KEYS):
            warnings.warn(f"{config_path}: {key!r} is not supported by this version of "
                          "txlb yet and is ignored", stacklevel=2)
            del in_file[key]
        unknown = sorted(set(in_file) - set(BY_NAME))
        if unknown:
            raise ConfigError(f"--config: unknown key {unknown[0]!r} in {config_path}"
                              f"{did_you_mean(unknown[0], BY_NAME)}")

    values: dict[str, Any] = {}
    for spec in OPTIONS:
        given = command_line.get(spec.name)
        label = spec.name
        if given is None and spec.env and spec.env in env:
            given, label = env[spec.env], f"{spec.name} (from {spec.env})"
        if given is None and spec.name in in_file:
            given, label = in_file[spec.name], f"{spec.name} (from {config_path})"
        if given is None:
            given = spec.default
        values[spec.attribute] = None if given is None else spec.parse(label, given)
    if (config_path and "backends" not in in_file and command_line.get("backends") is None
            and "LB_BACKENDS" not in env):
        raise ConfigError(f"--config: {config_path} has no 'backends' key: list the "
                          "backends there (backends = [] for a fleet the admin API "
                          "fills) or give --backends; the default fleet "
                          f"({DEFAULT_FLEET}) is used only without a config file")
    values["backends"], values["dns_backends"] = split_backends(values["backends"])
    if values["keys_file"] is not None:
        values["keys"] = read_keys(values["keys_file"])
    config = Config(**values)
    check_workers(config)
    check_classes(config)
    check_auth(config)
    config = with_tenant_budgets(config)
    if config.log_user == "hash" and config.log_user_key is None:
        # chosen once, here, so that every --workers worker digests with the same key
        config = attrs.evolve(config, log_user_key=secrets.token_hex(32))
    return config
