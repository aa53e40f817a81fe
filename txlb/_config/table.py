"""
The option table: every option of txlb, described once.

The command-line parser (``tap.py``), the environment lookup, the config file's keys and
``--help`` all read :data:`OPTIONS`, so an option cannot exist in one place and be
forgotten in another.  A policy with options of its own declares them in its module; the
registry collects them and they take their place here, the same as any other.
"""

from __future__ import annotations

from txlb._config.backends import (
    BackendSpec,
    DnsBackendSpec,
    backend_item,
    parse_backends,
    parse_resolver,
)
from txlb._config.bounds import DEFAULT_PREVIEW_CHARS
from txlb._config.classes import (
    DEFAULT_CLASS,
    parse_class_name,
    parse_classes,
    parse_priority_header,
)
from txlb._config.endpoints import (
    parse_admin,
    parse_admin_hosts,
    parse_exposure,
    parse_listen,
    parse_token,
)
from txlb._config.keys import parse_auth, parse_fairness, parse_keys_path
from txlb._config.limits import parse_budgets, parse_completion_estimate, parse_rate, parse_rate_key
from txlb._config.option import OptionSpec
from txlb._config.resultlog import (
    parse_log_content,
    parse_log_error_body,
    parse_log_file,
    parse_log_format,
    parse_log_user,
    parse_secret,
)
from txlb._config.routing import (
    describe_policies,
    parse_affinity,
    parse_policy,
    parse_routes,
    parse_unknown_model,
)
from txlb._config.shared import parse_shared_state
from txlb._config.values import (
    parse_count,
    parse_duration,
    parse_nonnegative_int,
    parse_nonnegative_seconds,
    parse_path,
    parse_size,
    parse_switch,
)
from txlb._scheduling.policies.registry import DEFAULT_POLICY, policy_options


def _parse_fleet(option: str, value: object) -> tuple[BackendSpec | DnsBackendSpec, ...]:
    """
    ``--backends``, a key of the config file's own in a table named as one (by
    :data:`BY_NAME`, below: read when a value is parsed, after the table is built).
    """
    return parse_backends(option, value, BY_NAME)


DEFAULT_BACKENDS = ",".join(f"127.0.0.1:{port}" for port in range(8002, 8010))
#: the default fleet in words, for the refusal of a config file that names no backends
DEFAULT_FLEET = "127.0.0.1:8002-8009"

OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec("listen", "tcp:8000", parse_listen,
               "Port number or Twisted endpoint string to serve clients on.", "LB_PORT"),
    OptionSpec("backends", DEFAULT_BACKENDS, _parse_fleet,
               "Comma-separated host:port or http://host:port backends; dns:NAME:PORT "
               "(every A/AAAA address of NAME) and srv:_service._proto.NAME (SRV records) "
               "are re-resolved on their TTL. The default applies only without --config: "
               "a config file must have a backends key (backends = [] for none).",
               "LB_BACKENDS",
               shown_default="the eight backends 127.0.0.1:8002 to 127.0.0.1:8009"),
    OptionSpec("health-interval", 10.0, parse_duration,
               "Seconds between active probes of each backend.", "LB_HC_INTERVAL"),
    OptionSpec("health-path", "/health", parse_path, "Path probed on each backend."),
    OptionSpec("health-timeout", 5.0, parse_duration, "Seconds a probe may take."),
    OptionSpec("fall", 3, parse_count,
               "Consecutive ambiguous probe failures (timeout, reset) that mark a backend down."),
    OptionSpec("rise", 1, parse_count,
               "Consecutive successful probes that bring a down backend back."),
    OptionSpec("connect-timeout", 5.0, parse_duration,
               "Seconds to open an upstream connection."),
    OptionSpec("read-timeout", 300.0, parse_duration,
               "Seconds the upstream may stay silent (before headers or between chunks)."),
    OptionSpec("send-timeout", 60.0, parse_duration,
               "Seconds a client may go without reading while the response waits for it."),
    OptionSpec("log-file", "lb_results.log", parse_log_file,
               "The result log: a path, '-' for standard output, 'none' to disable.",
               "LB_LOG_FILE"),
    OptionSpec("log-max-bytes", "50MiB", parse_size,
               "Rotate the result log when it reaches this size (bytes, KiB, MiB, GiB)."),
    OptionSpec("log-backups", 3, parse_nonnegative_int,
               "Rotated result logs kept (<name>.1 is the newest)."),
    OptionSpec("log-format", "text", parse_log_format,
               "Result log format: 'text' (one line per request) or 'json' (JSON lines)."),
    OptionSpec("log-content", DEFAULT_PREVIEW_CHARS, parse_log_content,
               "Characters of each answer kept after '|' in the result log (0: none, "
               "at most 1000)."),
    OptionSpec("log-user", "keep", parse_log_user,
               "An orid taken from the body's 'user': 'keep', 'hash' (a keyed digest) or "
               "'drop'."),
    OptionSpec("log-user-key", None, parse_secret,
               "Key of the 'hash' digest, so it is stable across restarts (environment or "
               "config file only; default: a random key per start).", "LB_LOG_USER_KEY",
               cli=False),
    OptionSpec("log-error-body", "keep", parse_log_error_body,
               "Error bodies in the result log: 'keep' (up to 8 KiB), 'none', or N characters."),
    OptionSpec("admin", "tcp:8001:interface=127.0.0.1", parse_admin,
               "Admin endpoint (status, drain, metrics); a bare port binds 127.0.0.1; "
               "'none' disables it.", "LB_ADMIN"),
    OptionSpec("admin-token", None, parse_token,
               "Require 'Authorization: Bearer <token>' on the admin port.", "LB_ADMIN_TOKEN"),
    OptionSpec("admin-hosts", (), parse_admin_hosts,
               "More Host names the admin port answers to, comma-separated ('*': any), "
               "besides loopback names and its own address.", "LB_ADMIN_HOSTS"),
    OptionSpec("shutdown-timeout", 30.0, parse_duration,
               "Seconds in-flight requests get to finish on SIGTERM/SIGINT."),
    OptionSpec("policy", DEFAULT_POLICY, parse_policy, describe_policies, "LB_POLICY"),
    OptionSpec("queue-timeout", 30.0, parse_duration,
               "Seconds a request may wait when every backend for it is at max_conns."),
    OptionSpec("unknown-model", "404", parse_unknown_model,
               "A request naming a model no backend lists: '404' (an OpenAI-style error, as "
               "vLLM answers) or 'forward' (to any backend by the policy, as nginx would).",
               "LB_UNKNOWN_MODEL"),
    # each built-in policy's own options (--cache-block, ...), declared in its module
    *policy_options(),
    OptionSpec("affinity", None, parse_affinity,
               "Session affinity: 'header:NAME' or 'user' (bounded-load consistent hashing)."),
    OptionSpec("routes", (), parse_routes,
               "Model aliases split by weight (config file [[routes]] only).", cli=False),
    OptionSpec("retries", 2, parse_nonnegative_int,
               "Extra tries on another backend (refused/reset before a response, 502/503)."),
    OptionSpec("retry-window", 10.0, parse_duration,
               "Seconds after the request's arrival past which no new try starts."),
    OptionSpec("resume", "on", parse_switch,
               "Resume a chat or completions stream on another engine when its own fails "
               "part-way, so the client reads one uninterrupted answer: 'on' or 'off'.",
               "LB_RESUME"),
    OptionSpec("resume-tries", 1, parse_nonnegative_int,
               "Continuations one stream may have at most (0: none)."),
    OptionSpec("outlier-5xx", 5, parse_nonnegative_int,
               "5xx answers in a row that eject a backend for a cool-down (0: never)."),
    OptionSpec("outlier-cooldown", 30.0, parse_duration,
               "Seconds of the first outlier ejection; it grows with each repeat."),
    OptionSpec("hung-after", 1.25, parse_nonnegative_seconds,
               "Seconds without a byte from a backend while it has requests -- in flight, or "
               "left unanswered by clients who gave up -- and others answer, that get it "
               "probed at once and marked down if its health path does not answer within 1s "
               "(0: never)."),
    OptionSpec("slow-start", 0.0, parse_nonnegative_seconds,
               "Seconds over which a recovered backend's weight ramps from 1% to full."),
    OptionSpec("max-body", "64MiB", parse_size,
               "Larger request bodies get 413 (checked while the body arrives)."),
    OptionSpec("header-timeout", 30.0, parse_duration,
               "Seconds a client may take to send a request's line and headers."),
    OptionSpec("rate-limit", None, parse_rate,
               "Requests per client key, e.g. '100/s' or '600/m' (token bucket)."),
    OptionSpec("rate-burst", None, parse_count,
               "Bucket size: requests a key may send at once.",
               shown_default="one second's worth of --rate-limit"),
    OptionSpec("rate-key", "ip", parse_rate_key,
               "What a client is: 'ip', 'token' (the bearer token, never logged) or "
               "'header:NAME'."),
    OptionSpec("auth", "off", parse_auth,
               "'keys': every request needs an API key of --keys-file (401 without one); "
               "its tenant names the client for classes, budgets, rate limits and fair "
               "shares. 'off': no key is asked.", "LB_AUTH"),
    OptionSpec("keys-file", None, parse_keys_path,
               "The tenants and the SHA-256 of their API keys (TOML; python -m txlb.keys "
               "makes a key); re-read on every reload.", "LB_KEYS_FILE"),
    OptionSpec("fairness", "auto", parse_fairness,
               "Who is served first within a priority class when requests queue: 'fifo' "
               "(arrival order), 'vtc' (the tenant that has received the fewest weighted "
               "tokens) or 'auto' (vtc with --auth keys, else fifo).", "LB_FAIRNESS"),
    OptionSpec("workers", 1, parse_count,
               "Processes sharing the listening socket (tcp only), with least-connections "
               "exact across them."),
    OptionSpec("lb-status", "on", parse_exposure,
               "GET /__lb_status on the main port: 'on', 'loopback' (answered to clients on "
               "this host only; others reach a backend) or 'off' (always sent to a backend)."),
    OptionSpec("x-backend", "on", parse_exposure,
               "X-Backend and X-Backend-Port on responses: 'on', 'loopback' (to clients on "
               "this host only) or 'off'."),
    OptionSpec("budgets", (), parse_budgets,
               "Token budgets per client key or priority class (config file [[budgets]] "
               "only).", cli=False),
    OptionSpec("budget-completion-estimate", 256, parse_completion_estimate,
               "Completion tokens a token budget reserves for a request that sets no "
               "max_tokens (reconciled from usage at the end)."),
    OptionSpec("classes", (), parse_classes,
               "Priority classes, highest first (config file [[classes]] only; default: "
               "interactive, default, batch).", cli=False),
    OptionSpec("priority-header", "X-Priority", parse_priority_header,
               "Request header naming a priority class ('none': ignore it).",
               "LB_PRIORITY_HEADER"),
    OptionSpec("default-class", DEFAULT_CLASS, parse_class_name,
               "Priority class of a request that names none and matches no class.",
               "LB_DEFAULT_CLASS"),
    OptionSpec("resolver", (), parse_resolver,
               "DNS servers for dns:/srv: backends, HOST[:PORT] comma-separated.",
               "LB_RESOLVER", shown_default="the system's, from /etc/resolv.conf"),
    OptionSpec("shared-state", None, parse_shared_state,
               "Redis URL the replicas of a fleet share in-flight counts, drains, "
               "membership and rate buckets through: "
               "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] (rediss:// for TLS; ?ca=PATH for "
               "a private CA, ?password_file=PATH, ?prefix=NAME; the password is never "
               "shown).", "LB_SHARED_STATE", shown_default="none (one replica alone)"),
)

#: Every option by its name, which is also its key in the config file.
BY_NAME = {spec.name: spec for spec in OPTIONS}


def backend_entry(option: str, item: object) -> BackendSpec:
    """
    One backend table or address as the config file or the admin API gives it: a key of
    the file's own (``policy``) in a table is named as one (see :func:`backend_item`).
    """
    return backend_item(option, item, BY_NAME)
