"""
One road from a config to the running parts, walked option by option.

For every option of the table, a balancer built with one value and reloaded to another
must hold the same state as a balancer built with the other value from the start -- so a
reload applies every option start-up applies, by construction, and a new option that is
wired at start-up but forgotten by reload fails here.  Each option must also *show* in the
parts' state (two fresh balancers differ), or the comparison could not fail; the few read
from ``lb.config`` where they are used say so in :data:`READ_WHERE_USED`.  The options a
reload cannot change are exactly ``RESTART_ONLY``, and a reload that changes one keeps it.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase

from txlb import LoadBalancer
from txlb._config import OPTIONS, Config, build_config
from txlb._reload import RESTART_ONLY

#: a config file's base lines every case starts from (TOML)
BASE = 'backends = ["127.0.0.1:9000"]\n'
#: a keys file of two tenants, for --auth keys
KEYS = Path(__file__).parent.parent / "fixtures" / "keys" / "keys.toml"
OTHER_KEYS = KEYS.with_name("other.toml")

#: for each option a reload applies: (the extra base lines it needs to matter, the lines
#: that set it to another value).  Every option of the table but the restart-only ones
#: must be here -- a test checks it -- so a new option is walked as soon as it exists.
CHANGES: dict[str, tuple[str, str]] = {
    "backends": ("", 'backends = ["127.0.0.1:9001"]\n'),
    "health_interval": ("", "health-interval = 3\n"),
    "health_path": ("", 'health-path = "/healthz"\n'),
    "health_timeout": ("", "health-timeout = 2\n"),
    "fall": ("", "fall = 5\n"),
    "rise": ("", "rise = 2\n"),
    "connect_timeout": ("", "connect-timeout = 2\n"),
    "read_timeout": ("", "read-timeout = 100\n"),
    "send_timeout": ("", "send-timeout = 20\n"),
    "log_max_bytes": ("", 'log-max-bytes = "1MiB"\n'),
    "log_backups": ("", "log-backups = 5\n"),
    "log_format": ("", 'log-format = "json"\n'),
    "log_content": ("", "log-content = 0\n"),
    "log_user": ("", 'log-user = "drop"\n'),
    "log_user_key": ('log-user = "hash"\n', 'log-user-key = "a-key-of-enough-length-1"\n'),
    "log_error_body": ("", 'log-error-body = "none"\n'),
    "admin_token": ("", 'admin-token = "a-token-of-enough-length"\n'),
    "admin_hosts": ("", 'admin-hosts = ["lb.example.com"]\n'),
    "shutdown_timeout": ("", "shutdown-timeout = 5\n"),
    "policy": ("", 'policy = "p2c"\n'),
    "queue_timeout": ("", "queue-timeout = 3\n"),
    "unknown_model": ("", 'unknown-model = "forward"\n'),
    "cache_block": ('policy = "cache-aware"\n', "cache-block = 128\n"),
    "cache_entries": ('policy = "cache-aware"\n', "cache-entries = 5000\n"),
    "cache_load": ('policy = "cache-aware"\n', "cache-load = 2\n"),
    "affinity": ("", 'affinity = "header:X-Session"\n'),
    "routes": ("", '[[routes]]\nmodel = "chat"\nto = { "m1" = 9, "m2" = 1 }\n'),
    "retries": ("", "retries = 1\n"),
    "retry_window": ("", "retry-window = 5\n"),
    "resume": ("", 'resume = "off"\n'),
    "resume_tries": ("", "resume-tries = 3\n"),
    "outlier_5xx": ("", "outlier-5xx = 3\n"),
    "outlier_cooldown": ("", "outlier-cooldown = 10\n"),
    "hung_after": ("", "hung-after = 2\n"),
    "slow_start": ("", "slow-start = 5\n"),
    "max_body": ("", 'max-body = "1MiB"\n'),
    "header_timeout": ("", "header-timeout = 10\n"),
    "rate_limit": ("", "rate-limit = 5\n"),
    "rate_burst": ("rate-limit = 5\n", "rate-burst = 7\n"),
    "rate_key": ("rate-limit = 5\n", 'rate-key = "token"\n'),
    "lb_status": ("", 'lb-status = "off"\n'),
    "x_backend": ("", 'x-backend = "off"\n'),
    "budgets": ("", '[[budgets]]\nname = "per-ip"\nkey = "ip"\ntokens_per_minute = 20000\n'),
    "budget_completion_estimate": (
        '[[budgets]]\nname = "per-ip"\nkey = "ip"\ntokens_per_minute = 20000\n',
        "budget-completion-estimate = 100\n"),
    "classes": ("", '[[classes]]\nname = "gold"\n[[classes]]\nname = "default"\n'),
    "priority_header": ("", 'priority-header = "X-Prio"\n'),
    "default_class": ("", 'default-class = "batch"\n'),
    "keys_file": (f'auth = "keys"\nkeys-file = "{OTHER_KEYS}"\n', f'keys-file = "{KEYS}"\n'),
    "auth": (f'keys-file = "{KEYS}"\n', 'auth = "keys"\n'),
    "fairness": ("", 'fairness = "vtc"\n'),
}

#: options no part holds: read from the balancer's running config where they are used
READ_WHERE_USED: dict[str, str] = {
    "shutdown_timeout": "read by the balancer's lifecycle service when it stops",
}

#: state that differs between any two balancers, or that a reload changes by design
#: (the reloader's own generation), and so is no part's setting
_NOT_SETTINGS = ("reloader", "_started", "_probing", "repeats", "_secret", "_media_key")


def _text(extra: str, change: str) -> str:
    """
    The file of the base, ``extra`` and ``change``: their top-level keys first (a later
    fragment's value of a key over an earlier one's), then their ``[[tables]]``.
    """
    keys: dict[str, str] = {}
    tables: list[str] = []
    for fragment in (BASE, extra, change):
        top, mark, rest = fragment.partition("[[")
        for line in top.splitlines(keepends=True):
            keys[line.split("=", 1)[0].strip()] = line
        if mark:
            tables.append(mark + rest)
    return "".join(keys.values()) + "".join(tables)


def state(lb: LoadBalancer) -> dict[str, object]:
    """
    Every plain value reachable from the balancer's parts, by its path: numbers, strings,
    flags, enums, and the arguments of a partial -- a reloaded part and a freshly built one
    are equal exactly when these are.  Objects that are not txlb's are named by their type.
    """
    found: dict[str, object] = {}
    seen: set[int] = set()

    def walk(value: object, path: str, depth: int) -> None:
        if value is None or isinstance(value, (bool, int, float, str, bytes, enum.Enum)):
            found[path] = value
            return
        if depth > 8 or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, functools.partial):
            walk(value.args, path + "()", depth + 1)
            walk(dict(value.keywords), path + "(**)", depth + 1)
            return
        if isinstance(value, (list, tuple)):
            for index, item in enumerate(value[:64]):
                walk(item, f"{path}[{index}]", depth + 1)
            return
        if isinstance(value, (set, frozenset)):
            found[path] = sorted(repr(item) for item in value
                                 if isinstance(item, (str, int, float, bytes)))
            return
        if isinstance(value, Mapping):
            for key in sorted(value, key=repr)[:64]:
                walk(value[key], f"{path}[{key!r}]", depth + 1)
            return
        if not type(value).__module__.startswith("txlb"):
            module = getattr(value, "__module__", None)
            if callable(value) and isinstance(module, str) and module.startswith("txlb"):
                found[path] = f"{module}.{getattr(value, '__qualname__', '?')}"
            else:
                found[path] = type(value).__name__
            return
        for name, item in _fields(value):
            if name in _NOT_SETTINGS or name == "config":
                continue
            walk(item, f"{path}.{name}", depth + 1)

    walk(lb, "lb", 0)
    return found


def _fields(value: object) -> Iterator[tuple[str, Any]]:
    names = list(getattr(value, "__dict__", {}))
    for klass in type(value).__mro__:
        names.extend(name for name in getattr(klass, "__slots__", ()) if name not in names)
    for name in names:
        try:
            yield name, getattr(value, name)
        except AttributeError:
            continue


class OneRoadTests(SynchronousTestCase):
    """A reload to a config leaves the parts as start-up with that config builds them."""

    def setUp(self) -> None:
        self.directory = Path(self.mktemp())
        self.directory.mkdir()

    def config(self, text: str) -> Config:
        path = self.directory / "txlb.toml"
        path.write_text(f'log-file = "{self.directory / "results.log"}"\n' + text)
        return build_config({"config": str(path)}, environ={})

    def balancer(self, config: Config) -> LoadBalancer:
        # txlb's own upstream client (its connect timeout is a setting), never connecting
        lb = LoadBalancer(config=config, reactor=MemoryReactorClock())
        lb.main_factory()
        lb.site()
        lb.admin_resource()
        self.addCleanup(lambda: lb.result_log and lb.result_log.close())
        return lb

    def test_every_option_is_walked_or_restart_only(self) -> None:
        walked = set(CHANGES) | set(RESTART_ONLY)
        self.assertEqual(sorted({spec.attribute for spec in OPTIONS} - walked), [])
        self.assertEqual(sorted(set(CHANGES) & set(RESTART_ONLY)), [])

    def test_restart_only_is_the_fixed_list(self) -> None:
        self.assertEqual(set(RESTART_ONLY), {"listen", "admin", "workers", "log_file",
                                              "resolver", "shared_state"})

    def test_a_reload_applies_each_option_as_start_up_does(self) -> None:
        differ = []
        unseen = []
        for option, (extra, change) in sorted(CHANGES.items()):
            before = self.config(_text(extra, ""))
            after = self.config(_text(extra, change))
            self.assertNotEqual(getattr(before, option), getattr(after, option), option)
            fresh_before = state(self.balancer(before))
            fresh_after = state(self.balancer(after))
            if fresh_before == fresh_after and option not in READ_WHERE_USED:
                unseen.append(option)
            reloaded = self.balancer(before)
            reloaded.reload(after)
            self.assertEqual(getattr(reloaded.config, option), getattr(after, option))
            now = state(reloaded)
            if now != fresh_after:
                keys = sorted(set(now) | set(fresh_after))
                differ.append((option, [(key, now.get(key), fresh_after.get(key))
                                        for key in keys if now.get(key) != fresh_after.get(key)
                                        ][:5]))
        self.maxDiff = None
        self.assertEqual(differ, [])
        self.assertEqual(unseen, [])

    def test_a_restart_only_option_is_kept_as_it_runs(self) -> None:
        lb = self.balancer(self.config(BASE))
        lb.reload(self.config(BASE + "workers = 2\n"))
        self.assertEqual(lb.config.workers, 1)
