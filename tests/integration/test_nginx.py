"""The generated nginx configuration: the right directives, and nginx accepts it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from txlb import build_config
from txlb.nginx import listen_directive, render, tls_directives

from ..parts import missing
from ..processes import ROOT, throwaway_certificate

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                  else None)


def conf(**options: object) -> str:
    given = {"backends": "127.0.0.1:8002,127.0.0.1:8003", **{
        k.replace("_", "-"): v for k, v in options.items()}}
    return render(build_config(given, {}))


class GeneratedConfigTests(SynchronousTestCase):
    def test_defaults_map_to_nginx(self) -> None:
        text = conf()
        for directive in (
            "upstream txlb_backends {", "least_conn;",
            "server 127.0.0.1:8002 max_fails=1 fail_timeout=10s;", "keepalive 64;",
            "listen 8000;", "client_max_body_size 64m;", "proxy_http_version 1.1;",
            'proxy_set_header Connection "";', "proxy_buffering off;",
            "proxy_read_timeout 300s;", "proxy_connect_timeout 5s;",
            "proxy_next_upstream error http_502 http_503;",
            "proxy_next_upstream_tries 3;", "proxy_next_upstream_timeout 10s;",
            "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
            "proxy_set_header X-Forwarded-Proto $scheme;",
            "add_header X-Backend $txlb_backend always;",
            "add_header X-Backend-Port $txlb_backend_port always;",
            "location = /__lb_status {",
        ):
            self.assertIn(directive, text)
        self.assertNotIn("timeout http_502", text)  # a timeout is never retried
        # re-sending a POST the backend had whole would be a second generation
        self.assertFalse([line for line in text.splitlines()
                          if "proxy_next_upstream " in line and "non_idempotent" in line])

    def test_lb_status_and_x_backend_exposure(self) -> None:
        self.assertIn("location = /__lb_status {", conf())
        off = conf(lb_status="off", x_backend="off")
        self.assertNotIn("__lb_status", off)
        self.assertNotIn("add_header X-Backend", off)
        local = conf(lb_status="loopback", x_backend="loopback")
        self.assertIn("allow 127.0.0.0/8;", local)
        self.assertIn("add_header X-Backend $txlb_backend_shown always;", local)
        self.assertIn("add_header X-Backend-Port $txlb_backend_port_shown always;", local)
        self.assertNotIn("add_header X-Backend $txlb_backend always;", local)
        # as txlb: the backend's own X-Backend never reaches the client
        for text in (conf(), off, local):
            self.assertIn("proxy_hide_header X-Backend;", text)
            self.assertIn("proxy_hide_header X-Backend-Port;", text)

    def test_policies_weights_caps(self) -> None:
        self.assertIn("random two least_conn;", conf(policy="p2c"))
        self.assertIn("    random;", conf(policy="random"))
        self.assertNotIn("least_conn", conf(policy="round-robin"))
        self.assertIn("--policy queue-depth: no nginx equivalent", conf(policy="queue-depth"))
        self.assertIn("hash $http_x_session consistent;", conf(affinity="header:X-Session"))
        path = self.mktemp()
        Path(path).write_text('[[backends]]\nurl = "127.0.0.1:9000"\nweight = 3\n'
                              'max_conns = 8\n')
        self.assertIn("server 127.0.0.1:9000 weight=3 max_conns=8",
                      render(build_config({"config": path}, {})))

    def test_limits_and_retries(self) -> None:
        text = conf(max_body="1MiB", read_timeout="2.5", retries="0", rate_limit="30/m",
                    rate_burst="5", rate_key="token")
        self.assertIn("client_max_body_size 1m;", text)
        self.assertIn("proxy_read_timeout 2500ms;", text)
        self.assertIn("proxy_next_upstream off;", text)
        self.assertIn("limit_req_zone $http_authorization zone=txlb:10m rate=30r/m;", text)
        self.assertIn("limit_req zone=txlb burst=5 nodelay;", text)

    def test_what_nginx_cannot_do_is_listed(self) -> None:
        text = conf()
        for topic in ("Active health checks", "Model-aware routing", "result log",
                      "Admin API", "Queueing at max_conns", "Priority classes",
                      "no priority queue"):
            self.assertIn(topic, text)

    def test_token_budgets_are_said_not_to_map(self) -> None:
        """nginx's limit_req counts requests: the generated config says so for budgets."""
        self.assertNotIn("[[budgets]]", conf())
        text = conf(budgets=[{"name": "per-ip", "key": "ip", "tokens_per_minute": 1000}],
                    rate_limit="5/s")
        self.assertIn("#   - [[budgets]] token budgets (per-ip): nginx's limit_req counts "
                      "requests, not tokens", text)
        self.assertIn("# limit_req counts requests, not tokens", text)

    def test_listen_forms(self) -> None:
        self.assertEqual(listen_directive("tcp:8000"), "8000")
        self.assertEqual(listen_directive("tcp:8000:interface=127.0.0.1"), "127.0.0.1:8000")
        self.assertEqual(listen_directive("tcp6:8000:interface=\\:\\:1"), "[::1]:8000")
        self.assertEqual(listen_directive("unix:/run/lb.sock"), "unix:/run/lb.sock")

    def test_listen_forms_as_twisted_parses_them(self) -> None:
        """
        Any spelling Twisted's endpoint parser accepts for twistd is the same listener in
        nginx: the port as a keyword, positional arguments in each parser's own order, a
        backslash taking the next character (an escaped backslash before a separator too).
        """
        self.assertEqual(listen_directive("tcp:port=8000:interface=127.0.0.1"),
                         "127.0.0.1:8000")
        self.assertEqual(listen_directive("tcp:8000:127.0.0.1"), "127.0.0.1:8000")
        self.assertEqual(listen_directive("tcp6:8000:50:\\:\\:1"),
                         "[::1]:8000")  # tcp6's order: port, backlog, interface
        self.assertEqual(listen_directive("ssl:port=8443:privateKey=k.pem"), "8443 ssl")
        self.assertEqual(listen_directive("unix:address=/run/lb.sock"), "unix:/run/lb.sock")
        self.assertEqual(listen_directive("unix:/run/a\\:b.sock"),
                         "unix:/run/a:b.sock")

    def test_ssl_key_paths_as_twisted_reads_them(self) -> None:
        """The key as a positional argument, an escaped backslash, Twisted's server.pem."""
        here = os.getcwd()
        positional = "\n".join(tls_directives("ssl:8443:/k/key.pem:/k/cert.pem"))
        self.assertIn("ssl_certificate '/k/cert.pem';", positional)
        self.assertIn("ssl_certificate_key '/k/key.pem';", positional)
        backslash = "\n".join(tls_directives("ssl:8443:privateKey=/k/a\\\\:certKey=/k/c"))
        self.assertIn("ssl_certificate_key '/k/a\\\\';", backslash)  # the file /k/a\
        self.assertIn("ssl_certificate '/k/c';", backslash)
        default = "\n".join(tls_directives("ssl:8443"))  # Twisted reads ./server.pem
        self.assertIn(f"ssl_certificate_key '{here}/server.pem';", default)

    def test_command_line(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        result = subprocess.run([sys.executable, "-m", "txlb.nginx", "--backends",
                                 "127.0.0.1:1", "--policy", "p2c"],
                                capture_output=True, text=True, check=True, env=env)
        self.assertIn("random two least_conn;", result.stdout)
        bad = subprocess.run([sys.executable, "-m", "txlb.nginx", "--fall", "x"],
                             capture_output=True, text=True, env=env)
        self.assertEqual(bad.returncode, 2)
        self.assertEqual(bad.stderr.strip().count("\n"), 0)
        self.assertIn("--fall", bad.stderr)

    def test_nginx_accepts_every_variant(self) -> None:
        if NGINX is None:
            missing("nginx", "nginx is not installed (apt-get install nginx)")
        prefix = Path(self.mktemp()).resolve()
        prefix.mkdir()
        variants = [{}, {"policy": "p2c"}, {"policy": "random", "retries": "0"},
                    {"affinity": "user"}, {"affinity": "header:X-S", "rate_limit": "5/s"},
                    {"rate_limit": "1/h", "rate_key": "header:X-Team"},
                    {"lb_status": "loopback", "x_backend": "loopback"},
                    {"lb_status": "off", "x_backend": "off"}]
        key, cert = throwaway_certificate(prefix)
        variants += [{"listen": f"ssl:1:interface=127.0.0.1:privateKey={key}:certKey={cert}"},
                     {"log_file": "none"}, {"log_file": "-"}]
        for options in variants:
            config = build_config({"backends": "127.0.0.1:1,127.0.0.1:2",
                                   "listen": "tcp:1:interface=127.0.0.1",
                                   **{k.replace("_", "-"): v for k, v in options.items()}},
                                  {})
            (prefix / "nginx.conf").write_text(render(config, str(prefix)))
            result = subprocess.run([NGINX, "-t", "-p", str(prefix), "-c",
                                     str(prefix / "nginx.conf")], capture_output=True,
                                    text=True)
            self.assertEqual(result.returncode, 0, f"{options}: {result.stderr}")


class TlsAndLogTests(SynchronousTestCase):
    """An ssl: listener brings its certificate; the txlb_results format is used; prefixes."""

    def test_ssl_endpoint_names_its_certificate_and_key(self) -> None:
        directory = Path(self.mktemp()).resolve()
        directory.mkdir()
        key, cert = throwaway_certificate(directory)
        text = conf(listen=f"ssl:8443:privateKey={key}:certKey={cert}")
        self.assertIn("listen 8443 ssl;", text)
        self.assertIn(f"ssl_certificate '{cert}';", text)
        self.assertIn(f"ssl_certificate_key '{key}';", text)
        # without certKey Twisted reads the certificate from the key file, and so does nginx
        combined = directory / "both.pem"
        combined.write_bytes(key.read_bytes() + cert.read_bytes())
        both = conf(listen=f"ssl:8443:privateKey={combined}")
        self.assertIn(f"ssl_certificate '{combined}';", both)
        self.assertIn(f"ssl_certificate_key '{combined}';", both)
        self.assertNotIn("ssl_certificate", conf())

    def test_relative_certificate_paths_are_made_absolute(self) -> None:
        directory = Path(self.mktemp()).resolve()
        directory.mkdir()
        throwaway_certificate(directory)
        here = os.getcwd()
        os.chdir(directory)
        self.addCleanup(os.chdir, here)
        text = conf(listen="ssl:8443:privateKey=key.pem:certKey=cert.pem")
        self.assertIn(f"ssl_certificate '{directory / 'cert.pem'}';", text)
        self.assertIn(f"ssl_certificate_key '{directory / 'key.pem'}';", text)

    def test_the_log_format_is_used_for_the_log_file(self) -> None:
        text = conf(log_file="/var/log/llm/lb_results.log")
        self.assertIn("log_format txlb_results ", text)
        # beside txlb's result log, never in it: a canary nginx would mix two formats
        self.assertIn("access_log '/var/log/llm/lb_results.nginx.log' txlb_results;", text)
        self.assertIn("access_log '/var/log/results.nginx' txlb_results;",
                      conf(log_file="/var/log/results"))
        self.assertIn("access_log '/dev/stdout' txlb_results;", conf(log_file="-"))
        self.assertIn("access_log off;", conf(log_file="none"))
        standalone = render(build_config({"backends": "127.0.0.1:1"}, {}), "/srv/lb")
        self.assertIn("access_log '/srv/lb/lb_results.nginx.log' txlb_results;", standalone)

    def test_standalone_creates_a_missing_prefix_that_nginx_accepts(self) -> None:
        prefix = Path(self.mktemp()).resolve() / "new" / "prefix"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        result = subprocess.run([sys.executable, "-m", "txlb.nginx", "--backends",
                                 "127.0.0.1:1", "--listen", "tcp:1:interface=127.0.0.1",
                                 "--standalone", str(prefix)],
                                capture_output=True, text=True, check=True, env=env)
        self.assertTrue(prefix.is_dir())
        self.assertEqual(result.stdout, "")  # the file is written, as docs/migration.md says
        self.assertIn(f"wrote {prefix / 'nginx.conf'}", result.stderr)
        self.assertIn("server_tokens off;", (prefix / "nginx.conf").read_text())
        if NGINX is None:
            missing("nginx", "nginx is not installed (apt-get install nginx)")
        checked = subprocess.run([NGINX, "-t", "-p", str(prefix), "-c",
                                  str(prefix / "nginx.conf")], capture_output=True, text=True)
        self.assertEqual(checked.returncode, 0, checked.stderr)
