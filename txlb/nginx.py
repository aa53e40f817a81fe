"""
``python -m txlb.nginx``: print the nginx configuration equivalent to txlb's options.

The promise that makes txlb safe to adopt: the day the team gets root, nginx replaces it
and no client changes a line.  This takes the same options as ``twistd llmlb`` (command
line, environment, ``--config`` file) and prints an nginx ``upstream`` + ``server`` that
behave the same where nginx can: the policy, weights and caps, keep-alive to the backends,
streaming without buffering, the timeouts, retries, body limit, forwarded headers,
``X-Backend``, JSON error bodies for the errors the proxy makes itself, rate limits.  What
nginx cannot do is listed as comments, each with the closest nginx way.

With ``--standalone PREFIX`` it writes a complete ``PREFIX/nginx.conf`` that runs
unprivileged with every file under ``PREFIX`` (what the parity tests and the benchmarks
start), and says on standard error how to start it.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from collections.abc import Sequence

from twisted.python import usage

from txlb._config.config import Config, build_config
from txlb._config.errors import ConfigError
from txlb._scheduling.policies.registry import find_factory
from txlb.tap import Options as LlmlbOptions

UPSTREAM = "txlb_backends"


def _seconds(value: float) -> str:
    """nginx time: whole seconds where exact, else milliseconds."""
    return f"{int(value)}s" if float(value).is_integer() else f"{math.ceil(value * 1000)}ms"


def _size(value: int) -> str:
    for unit, factor in (("g", 1024**3), ("m", 1024**2), ("k", 1024)):
        if value and value % factor == 0:
            return f"{value // factor}{unit}"
    return str(value)


#: Each server endpoint's arguments in the order Twisted's parser takes them positionally
#: (``tcp:8000:127.0.0.1`` names the interface; tcp6 puts the backlog before it).
_POSITIONAL = {
    "tcp": ("port", "interface", "backlog"),
    "tcp6": ("port", "backlog", "interface"),
    "ssl": ("port", "privateKey", "certKey", "sslmethod", "interface", "backlog",
            "extraCertChain", "dhParameters"),
    "unix": ("address", "mode", "backlog", "lockfile"),
}


def _endpoint_arguments(endpoint: str) -> tuple[str, dict[str, str]]:
    """
    A Twisted server endpoint string read as Twisted reads it: the kind, and every
    argument by name whether it was given by position or as ``name=value``.  A backslash
    takes the next character (so ``\\:`` is a backslash, then a separator), and a
    value may hold ``=``.  Reading it any other way would give nginx a listener or a key
    file other than the one twistd uses.
    """
    fields: list[list[str]] = [[""]]
    characters = iter(endpoint)
    for character in characters:
        if character == "\\":
            fields[-1][-1] += next(characters, "")
        elif character == ":":
            fields.append([""])
        elif character == "=" and len(fields[-1]) == 1:
            fields[-1].append("")
        else:
            fields[-1][-1] += character
    kind = fields[0][0].lower()
    names = _POSITIONAL.get(kind, ())
    arguments: dict[str, str] = {}
    positional = [field[0] for field in fields[1:] if len(field) == 1]
    for name, value in zip(names, positional, strict=False):  # extra ones: Twisted errs
        arguments[name] = value
    arguments.update((field[0], field[1]) for field in fields[1:] if len(field) == 2)
    return kind, arguments


def tls_directives(endpoint: str) -> list[str]:
    """
    ``ssl_certificate`` and ``ssl_certificate_key`` for an ``ssl:`` endpoint (none for
    others): nginx refuses ``listen ... ssl`` without them.  Twisted's ``privateKey`` is
    the key (``server.pem`` when not given, as Twisted reads it; the certificate too
    unless ``certKey`` is given), ``certKey`` the certificate.  Paths are made absolute
    against the working directory, as twistd reads them, because nginx would read a
    relative one against its own prefix.
    """
    kind, arguments = _endpoint_arguments(endpoint)
    if kind != "ssl":
        return []
    private_key = arguments.get("privateKey", "server.pem")
    key = os.path.abspath(private_key)
    certificate = os.path.abspath(arguments.get("certKey", private_key))
    lines = [f"ssl_certificate {_quote(certificate)};",
             f"ssl_certificate_key {_quote(key)};"]
    if "extraCertChain" in arguments:
        lines.append("# extraCertChain: nginx reads the chain from ssl_certificate; append "
                     "the intermediate certificates to that file")
    return lines


def nginx_log_path(log_file: str) -> str:
    """
    The file nginx logs to beside ``--log-file``: the same name with ``.nginx`` before its
    extension (``lb_results.log`` -> ``lb_results.nginx.log``), never txlb's own file --
    nginx started beside txlb as a canary would write a second format into it.
    """
    directory, name = os.path.split(log_file)
    stem, dot, extension = name.rpartition(".")
    renamed = f"{stem}.nginx.{extension}" if dot and stem else f"{name}.nginx"
    return os.path.join(directory, renamed)


def access_log_directive(log_file: str, base: str | None = None) -> str:
    """
    ``--log-file`` as nginx's ``access_log`` in the ``txlb_results`` format: a file beside
    it (:func:`nginx_log_path`, absolute against ``base``, the working directory by
    default: nginx would read a relative path against its own prefix), standard output
    for ``-``, nothing for ``none``.
    """
    if log_file == "none":
        return "access_log off;"
    path = "/dev/stdout" if log_file == "-" else os.path.abspath(
        os.path.join(base or os.getcwd(), nginx_log_path(log_file)))
    return f"access_log {_quote(path)} txlb_results;"


def listen_directive(endpoint: str) -> str:
    """A Twisted server endpoint string as an nginx ``listen`` (TCP only)."""
    kind, arguments = _endpoint_arguments(endpoint)
    if kind == "unix":
        return f"unix:{arguments.get('address', '')}"
    if kind not in ("tcp", "tcp6", "ssl") or "port" not in arguments:
        raise ConfigError(f"--listen: {endpoint!r} has no nginx equivalent")
    port = arguments["port"]
    interface = arguments.get("interface")
    address = f"[{interface}]:{port}" if interface and ":" in interface else \
        f"{interface}:{port}" if interface else port
    return f"{address} ssl" if kind == "ssl" else address


def _error_body(status: int, message: str) -> str:
    from txlb._http.errors import error_body

    return error_body(status, message).decode()


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _nginx_directive(policy: str) -> str | None:
    """What the policy registry says behaves like ``policy`` in nginx, if anything."""
    factory = find_factory(policy)
    return None if factory is None else factory.nginx


def upstream_block(config: Config) -> list[str]:
    lines = [f"upstream {UPSTREAM} {{"]
    policy = config.policy
    if config.affinity and config.affinity.startswith("header:"):
        key = "$http_" + config.affinity.split(":", 1)[1].lower().replace("-", "_")
        lines.append(f"    hash {key} consistent;  # --affinity (no load bound in nginx)")
    elif config.affinity:
        lines.append("    hash $remote_addr consistent;  # --affinity user: nginx cannot read "
                     "the body's user; the client address is the closest key")
    elif (directive := _nginx_directive(policy)) is not None:
        lines.append(f"    {directive}")
    else:
        lines.append("    least_conn;")
        lines.append(f"    # --policy {policy}: no nginx equivalent; least_conn is the closest"
                     " (nginx cannot see engine queues or latency)")
    fail_timeout = _seconds(config.health_interval)
    for backend in config.backends:
        extra = f" weight={backend.weight}" if backend.weight != 1 else ""
        if backend.max_conns:
            extra += f" max_conns={backend.max_conns}"
        # one failed connect takes it out until the next "probe", as txlb's passive ejection
        lines.append(f"    server {backend.key}{extra} max_fails=1 fail_timeout={fail_timeout};")
    lines += _resolved_servers(config, fail_timeout)
    lines += [
        "    keepalive 64;",
        "    keepalive_timeout 4s;  # below vLLM's 5 s idle keep-alive",
        "}",
    ]
    return lines


def _resolved_servers(config: Config, fail_timeout: str) -> list[str]:
    """
    ``dns:``/``srv:`` backends as nginx's ``server NAME resolve`` (open source since
    1.27.3; it needs the upstream's shared memory ``zone``): nginx re-resolves on the TTL
    and, for SRV, makes the lowest priority the primaries and the rest backups, as txlb.
    """
    if not config.dns_backends:
        return []
    lines = ["    zone txlb_backends 1m;  # 'resolve' needs the upstream in shared memory "
             "(nginx >= 1.27.3)"]
    for entry in config.dns_backends:
        extra = f" max_conns={entry.max_conns}" if entry.max_conns else ""
        if entry.kind == "dns":
            if entry.weight != 1:
                extra = f" weight={entry.weight}{extra}"
            lines.append(f"    server {entry.name}:{entry.port}{extra} resolve max_fails=1 "
                         f"fail_timeout={fail_timeout};")
        else:
            service, proto, host = entry.name.split(".", 2)
            lines.append(f"    server {host} service={service}.{proto}{extra} resolve "
                         f"max_fails=1 fail_timeout={fail_timeout};")
    return lines


def resolver_directive(config: Config) -> list[str]:
    """The ``resolver`` nginx's ``resolve`` servers ask: ``--resolver``, else resolv.conf's."""
    if not config.dns_backends:
        return []
    servers = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
               for host, port in config.resolver] or _system_nameservers()
    if not servers:
        return ["# no --resolver and no nameserver in /etc/resolv.conf: set 'resolver' "
                "for the resolve servers below"]
    # nginx caches answers for their TTL; txlb re-resolves within 1 s..300 s of it
    return [f"resolver {' '.join(servers)} valid=300s;", "resolver_timeout 5s;"]


def _system_nameservers(path: str = "/etc/resolv.conf") -> list[str]:
    """The ``nameserver`` lines of ``path`` (nginx has no default resolver)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read(65536).splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            host = parts[1].split("%", 1)[0]
            found.append(f"[{host}]" if ":" in host else host)
    return found


def unsupported_notes(config: Config) -> list[str]:
    """What nginx cannot do, each with the closest nginx way."""
    notes = [
        "Active health checks (/health every --health-interval, --fall/--rise): nginx OSS only "
        "ejects passively (max_fails/fail_timeout above). A dead engine behind a live API "
        "server keeps getting requests until they fail; nginx Plus has 'health_check "
        "uri=/health'.",
        "Model-aware routing: nginx does not read request bodies for routing. Closest: one "
        "upstream per model and a 'map $http_x_model $pool' on a header the clients send.",
        "GET /v1/models (union over backends): proxied to one backend instead.",
        "The result log: use log_format with $upstream_addr $upstream_status $request_time "
        "$upstream_response_time (see the txlb_results format below); nginx cannot summarise "
        "the response body (finish reason, tokens) or record the backend's error body.",
        "Admin API (drain, add, remove, /metrics): edit the upstream (add 'down' to a server "
        "to drain it) and 'nginx -s reload'; metrics via stub_status or an exporter.",
        "Queueing at max_conns (--queue-timeout): nginx OSS answers 502 at once when every "
        "server is at max_conns; nginx Plus has 'queue N timeout=T'.",
        "Priority classes ([[classes]], --priority-header): nginx has no priority queue; "
        "every upstream serves requests in arrival order (nginx Plus's 'queue' is one FIFO "
        "per worker), so no class is served ahead of another and none has a starvation "
        "guard. The closest: cap a class's rate with a limit_req zone of its own whose key "
        "is empty for the other classes (nginx does not count a request with an empty key),"
        " e.g. map $http_x_priority $batch_key { batch $binary_remote_addr; default \"\"; }.",
        "--slow-start: nginx Plus only ('slow_start=' on a server).",
        "--outlier-5xx: closest is 'proxy_next_upstream http_500' with max_fails, which "
        "also retries.",
    ]
    if config.resume and config.resume_tries:
        notes.append("--resume: nginx cannot continue a stream whose backend fails part-way; "
                     "the client gets the answer cut short, as txlb with --resume off.")
    if config.dns_backends:
        notes.append("dns:/srv: backends: nginx re-resolves them on the TTL ('resolve' "
                     "below, open source since 1.27.3, with 'valid=' as its upper bound); "
                     "it has no slow start for new addresses and no admin drain that "
                     "survives a re-resolution.")
    if config.routes:
        notes.append("[[routes]] model aliases: nginx cannot rewrite the body's model. Closest: "
                     "split_clients on a request id to separate upstreams per target.")
    if config.affinity:
        notes.append("--affinity bounded load: nginx's 'hash ... consistent' has no load bound; "
                     "a hot session can overload one backend.")
    if config.budgets:
        names = ", ".join(budget.name for budget in config.budgets)
        notes.append(f"[[budgets]] token budgets ({names}): nginx's limit_req counts "
                     "requests, not tokens, and cannot read usage from an answer; nothing "
                     "below limits tokens. Closest: a limit_req per key at the request rate "
                     "the budget allows for a typical request.")
    return notes


def _backend_headers(config: Config, indent: str, port: bool = True) -> list[str]:
    """``X-Backend`` (and ``X-Backend-Port``) as ``--x-backend`` says: nginx sends no
    header whose value is empty, which is how ``loopback`` hides them from the others."""
    if config.x_backend == "off":
        return []
    suffix = "_shown" if config.x_backend == "loopback" else ""
    lines = [f"{indent}add_header X-Backend $txlb_backend{suffix} always;"]
    if port:
        lines.append(f"{indent}add_header X-Backend-Port $txlb_backend_port{suffix} always;")
    return lines


def server_block(config: Config, log_base: str | None = None) -> list[str]:
    """The ``server``; a relative ``--log-file`` is read against ``log_base``."""
    retries = config.retries
    status_stub = json.dumps({
        "healthy": len(config.backends), "total": len(config.backends),
        "backends": [{"backend": b.key, "healthy": True, "active": 0, "draining": False}
                     for b in config.backends],
        "note": "static: nginx OSS has no live upstream state",
    })
    lines = [
        "server {",
        f"    listen {listen_directive(config.listen)};",
        *("    " + line for line in tls_directives(config.listen)),
        f"    {access_log_directive(config.log_file, log_base)}",
        f"    client_max_body_size {_size(config.max_body)};",
        "    client_body_buffer_size 1m;",
        f"    client_header_timeout {_seconds(config.header_timeout)};",
        "    large_client_header_buffers 4 16k;",
        "",
    ]
    if config.lb_status != "off":  # off: /__lb_status goes to a backend like any path
        lines.append("    location = /__lb_status {")
        if config.lb_status == "loopback":
            # txlb proxies other clients' requests for it; nginx can only refuse them
            lines += ["        allow 127.0.0.0/8;", "        allow ::1;", "        deny all;"]
        lines += [
            "        default_type application/json;",
            f"        return 200 {_quote(status_stub)};",
            "    }",
            "",
        ]
    lines += [
        "    location / {",
        f"        proxy_pass http://{UPSTREAM};",
        "        proxy_http_version 1.1;",
        '        proxy_set_header Connection "";',
        "        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "        proxy_set_header X-Forwarded-Proto $scheme;",
        "        proxy_buffering off;            # every chunk to the client as it arrives",
        "        proxy_request_buffering on;     # whole body first: it can be sent again",
        f"        proxy_connect_timeout {_seconds(config.connect_timeout)};",
        f"        proxy_read_timeout {_seconds(config.read_timeout)};",
        f"        proxy_send_timeout {_seconds(config.read_timeout)};",
        f"        send_timeout {_seconds(config.send_timeout)};",
        "        # retried as close to txlb as nginx allows: never a timeout (the generation",
        "        # may still run); a POST only when nginx could not send it at all (txlb also",
        "        # retries a POST answered 502/503); no non_idempotent, which would re-send a",
        "        # POST the backend had whole and then reset: a second generation",
    ]
    if retries:
        lines += [
            "        proxy_next_upstream error http_502 http_503;",
            f"        proxy_next_upstream_tries {retries + 1};",
            f"        proxy_next_upstream_timeout {_seconds(config.retry_window)};",
        ]
    else:
        lines.append("        proxy_next_upstream off;")
    # the backend's own X-Backend (a balancer behind this one) is never passed on: the
    # client sees this one's, or none with --x-backend off
    lines += ["        proxy_hide_header X-Backend;", "        proxy_hide_header X-Backend-Port;"]
    lines += _backend_headers(config, "        ")
    if config.rate_limit is not None:
        burst = config.rate_burst or max(1, math.ceil(config.rate_limit))
        lines += [
            "        # limit_req counts requests, not tokens (txlb's --rate-limit too)",
            f"        limit_req zone=txlb burst={burst} nodelay;",
            "        limit_req_status 429;",
        ]
    lines += [
        "        proxy_intercept_errors off;     # the backend's own errors pass unchanged",
        "        error_page 413 = @txlb_413;",
        "        error_page 429 = @txlb_429;",
        "        error_page 502 = @txlb_502;",
        "        error_page 503 = @txlb_503;",
        "        error_page 504 = @txlb_504;",
        "    }",
    ]
    for status, message in ((413, "the request body is over the limit"),
                            (429, "rate limit exceeded for this client"),
                            (502, "no backend could be reached"),
                            (503, "no backend is available"),
                            (504, "the backend sent nothing in time")):
        lines += [
            f"    location @txlb_{status} {{",
            "        default_type application/json;",
            *_backend_headers(config, "        ", port=False),
            f"        return {status} {_quote(_error_body(status, message))};",
            "    }",
        ]
    lines.append("}")
    return lines


def http_level(config: Config, log_base: str | None = None) -> list[str]:
    """Everything that goes in nginx's ``http`` block."""
    lines = ["# Generated by python -m txlb.nginx: the nginx equivalent of txlb's options.",
             "# What nginx cannot do:"]
    for note in unsupported_notes(config):
        lines.append("#   - " + note)
    lines += [
        "# Reloading: 'python -m txlb.check lb.toml && kill -HUP <pid>' (or POST /reload on",
        "# txlb's admin port) is 'nginx -t && nginx -s reload': the file read again, checked",
        "# whole, and applied without dropping a connection; a bad file keeps the old one.",
        "",
        "# X-Backend names the server that answered: the last of $upstream_addr after retries",
        "map $upstream_addr $txlb_backend {",
        r'    "~(?:^|,\s*)(?<last>[^,\s]+)$" $last;',
        "    default $upstream_addr;",
        "}",
        "map $txlb_backend $txlb_backend_port {",
        r'    "~:(?<port>\d+)$" $port;',
        "    default \"\";",
        "}",
    ]
    if config.x_backend == "loopback":
        lines += [
            "# --x-backend loopback: the backend's name only for clients on this host",
            "map $remote_addr $txlb_local {",
            r'    "~^127\." 1;',
            '    "::1" 1;',
            '    default "";',
            "}",
            "map $txlb_local $txlb_backend_shown {",
            '    1 $txlb_backend;',
            '    default "";',
            "}",
            "map $txlb_local $txlb_backend_port_shown {",
            '    1 $txlb_backend_port;',
            '    default "";',
            "}",
        ]
    lines += [
        "log_format txlb_results '$time_local orid=$http_x_orid $upstream_addr "
        "status=$status upstream_status=$upstream_status dur=$request_time "
        "ttfb=$upstream_header_time $request_method $request_uri';",
    ]
    if config.rate_limit is not None:
        key = {"ip": "$binary_remote_addr", "token": "$http_authorization"}.get(
            config.rate_key,
            "$http_" + config.rate_key.split(":", 1)[-1].lower().replace("-", "_"))
        per_minute = config.rate_limit * 60
        rate = (f"{int(config.rate_limit)}r/s" if config.rate_limit >= 1
                else f"{max(1, round(per_minute))}r/m")
        lines.append(f"limit_req_zone {key} zone=txlb:10m rate={rate};")
    lines += resolver_directive(config)
    lines.append("")
    return lines + upstream_block(config) + [""] + server_block(config, log_base)


def render(config: Config, standalone: str | None = None) -> str:
    """
    The configuration text: ``http``-level, or a whole ``nginx.conf`` under a prefix
    (made absolute: nginx would read a relative one against its own).  A relative
    ``--log-file`` goes under the prefix too, so that every file stays there.
    """
    if standalone is None:
        return "\n".join(http_level(config)) + "\n"
    prefix = os.path.abspath(standalone)
    body = http_level(config, prefix)
    wrapped = [
        "worker_processes 1;",
        "worker_rlimit_nofile 65536;",
        f"pid {prefix}/nginx.pid;",
        f"error_log {prefix}/error.log warn;",
        "# each proxied stream takes two connections: 32768 holds 16,000 streams",
        "events { worker_connections 32768; }",
        "http {",
        f"    client_body_temp_path {prefix}/client_body;",
        f"    proxy_temp_path {prefix}/proxy;",
        f"    fastcgi_temp_path {prefix}/fastcgi;",
        f"    uwsgi_temp_path {prefix}/uwsgi;",
        f"    scgi_temp_path {prefix}/scgi;",
        "    server_tokens off;",
        *("    " + line if line else "" for line in body),
        "}",
    ]
    return "\n".join(wrapped) + "\n"


class Options(LlmlbOptions):
    """``twistd llmlb``'s options, plus where to write a standalone configuration."""

    synopsis = "[llmlb options] [--standalone PREFIX]"
    optParameters = [
        *LlmlbOptions.optParameters,
        ["standalone", None, None,
         "Write a whole nginx.conf running unprivileged into this directory (made if "
         "missing), every file nginx writes under it."],
    ]

    def postOptions(self) -> None:
        try:
            self.config = build_config({k: v for k, v in self.items() if k != "standalone"})
        except ConfigError as error:
            raise usage.UsageError(str(error)) from None


#: What nginx writes under a standalone prefix: made before it starts, so that a new
#: directory works on the first try (nginx creates none of its parents).
PREFIX_DIRECTORIES = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def make_prefix(prefix: str) -> None:
    """Create a standalone prefix and its temporary directories (an existing one is fine)."""
    for sub in PREFIX_DIRECTORIES:
        os.makedirs(os.path.join(prefix, sub), exist_ok=True)


def main(argv: Sequence[str] | None = None) -> None:
    options = Options()
    try:
        options.parseOptions(list(sys.argv[1:] if argv is None else argv))
        prefix = options["standalone"]
        text = render(options.config, prefix)
        if prefix:
            make_prefix(prefix)
            path = os.path.join(os.path.abspath(prefix), "nginx.conf")
            with open(path, "w") as conf:
                conf.write(text)
    except OSError as error:
        sys.stderr.write(f"python -m txlb.nginx: error: --standalone: cannot write "
                         f"{options['standalone']!r}: {error.strerror}\n")
        raise SystemExit(2) from None
    except (usage.UsageError, ConfigError) as error:
        sys.stderr.write(f"python -m txlb.nginx: error: {error}\n")
        raise SystemExit(2) from None
    if prefix:
        quoted = shlex.quote(path)
        sys.stderr.write(f"wrote {path}; start it with: nginx -p "
                         f"{shlex.quote(os.path.dirname(path))} -c {quoted} "
                         f"-g 'daemon off;'\n")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
