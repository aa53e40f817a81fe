"""Options, environment, TOML and their precedence; every bad value names itself."""

from __future__ import annotations

import os

from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from txlb import BackendSpec, ConfigError, build_config
from txlb.tap import Options

NONE: dict[str, str] = {}


class BuildConfigTests(SynchronousTestCase):
    def write(self, text: str) -> str:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write(text)
        return path

    def test_defaults(self) -> None:
        config = build_config({}, NONE)
        self.assertEqual(config.listen, "tcp:8000")
        self.assertEqual([b.key for b in config.backends],
                         [f"127.0.0.1:{p}" for p in range(8002, 8010)])
        self.assertEqual((config.health_interval, config.health_path, config.health_timeout),
                         (10.0, "/health", 5.0))
        self.assertEqual((config.fall, config.rise), (3, 1))
        self.assertEqual((config.connect_timeout, config.read_timeout), (5.0, 300.0))

    def test_config_defaults_match_the_option_table(self) -> None:
        """Config's own defaults (for embedders building one by hand) never drift."""
        import attrs

        from txlb._config import OPTIONS, Config

        built = build_config({}, NONE)
        for field in attrs.fields(Config):
            if field.default is not attrs.NOTHING:
                self.assertEqual(getattr(built, field.name), field.default, field.name)
        # dns_backends is --backends' dns:/srv: entries, split off by build_config; keys
        # is --keys-file as read
        self.assertEqual({f.name for f in attrs.fields(Config)} - {"dns_backends", "keys"},
                         {spec.attribute for spec in OPTIONS})

    def test_backend_forms(self) -> None:
        config = build_config({"backends": "10.0.0.1:8002, http://gpu-3:9000/,[::1]:7"}, NONE)
        self.assertEqual(
            config.backends,
            (BackendSpec("10.0.0.1", 8002), BackendSpec("gpu-3", 9000), BackendSpec("::1", 7)),
        )

    def test_port_number_means_tcp(self) -> None:
        self.assertEqual(build_config({"listen": "9000"}, NONE).listen, "tcp:9000")
        self.assertEqual(build_config({}, {"LB_PORT": "9001"}).listen, "tcp:9001")
        endpoint = "tcp:8000:interface=127.0.0.1"
        self.assertEqual(build_config({"listen": endpoint}, NONE).listen, endpoint)

    def test_precedence(self) -> None:
        """command line > environment > config file > default"""
        path = self.write('backends = ["h:1"]\nhealth-interval = 3\nread-timeout = 40\n'
                          'fall = 7\n')
        env = {"LB_HC_INTERVAL": "4", "LB_CONFIG": path}
        config = build_config({"health-interval": None, "read-timeout": "50"}, env)
        self.assertEqual(config.health_interval, 4.0)   # env beats file
        self.assertEqual(config.read_timeout, 50.0)     # command line beats file
        self.assertEqual(config.fall, 7)                # file beats default
        self.assertEqual(config.rise, 1)                # default
        config = build_config({"health-interval": "5", "config": path}, env)
        self.assertEqual(config.health_interval, 5.0)   # command line beats env

    def test_toml_backends(self) -> None:
        path = self.write(
            'listen = "tcp:0"\n'
            '[[backends]]\nurl = "http://127.0.0.1:8002"\nweight = 2\nmax_conns = 16\n'
            'models = ["llama"]\n'
            '[[backends]]\nurl = "127.0.0.1:8003"\n'
        )
        config = build_config({"config": path}, NONE)
        self.assertEqual(
            config.backends,
            (BackendSpec("127.0.0.1", 8002, 2, 16, ("llama",)), BackendSpec("127.0.0.1", 8003)),
        )

    def assertRejected(self, given: dict[str, object], *words: str) -> None:
        error = self.assertRaises(ConfigError, build_config, given, NONE)
        message = str(error)
        self.assertNotIn("\n", message)
        for word in words:
            self.assertIn(word, message)

    def test_bad_values_name_option_and_value(self) -> None:
        self.assertRejected({"health-interval": "abc"}, "--health-interval", "'abc'")
        self.assertRejected({"health-interval": "0"}, "--health-interval", "'0'")
        self.assertRejected({"health-timeout": "-1"}, "--health-timeout", "'-1'")
        self.assertRejected({"fall": "0"}, "--fall", "'0'")
        self.assertRejected({"rise": "1.5"}, "--rise", "'1.5'")
        self.assertRejected({"read-timeout": "nan"}, "--read-timeout", "'nan'")
        self.assertRejected({"connect-timeout": "soon"}, "--connect-timeout", "'soon'")
        self.assertRejected({"health-path": "health"}, "--health-path", "'health'")
        self.assertRejected({"listen": "bogus:1"}, "--listen", "'bogus:1'")
        self.assertRejected({"listen": "70000"}, "--listen", "'70000'")
        self.assertRejected({"backends": "localhost"}, "--backends", "'localhost'")
        self.assertRejected({"backends": "h:1/v1"}, "--backends", "'h:1/v1'")
        self.assertRejected({"backends": "https://h:1"}, "--backends", "'https://h:1'")
        self.assertRejected({"backends": ","}, "--backends")
        self.assertRejected({"backends": "h:1,h:1"}, "--backends", "h:1", "twice")
        self.assertRejected({"backends": "h:0"}, "--backends", "'h:0'")
        self.assertRejected({"backends": "h:1#x"}, "--backends", "'h:1#x'")

    def test_error_names_the_source(self) -> None:
        error = self.assertRaises(ConfigError, build_config, {}, {"LB_HC_INTERVAL": "-1"})
        self.assertIn("--health-interval (from LB_HC_INTERVAL): '-1'", str(error))
        path = self.write("fall = 0\n")
        error = self.assertRaises(ConfigError, build_config, {"config": path}, NONE)
        self.assertIn(f"--fall (from {path}): 0", str(error))

    def test_planned_keys_accepted_with_a_warning(self) -> None:
        from txlb._config import config as _config

        self.patch(_config, "PLANNED_KEYS", frozenset({"teleport"}))
        path = self.write('teleport = 2\nfall = 4\nbackends = []\n')
        config = build_config({"config": path}, NONE)
        self.assertEqual(config.fall, 4)
        warnings = self.flushWarnings()
        self.assertEqual(len(warnings), 1)
        self.assertIn("'teleport' is not supported", str(warnings[0]["message"]))

    def test_workers(self) -> None:
        self.assertEqual(build_config({}, NONE).workers, 1)
        self.assertEqual(build_config({"workers": "2"}, NONE).workers, 2)
        path = self.write('workers = 3\nbackends = ["h:1"]\n')
        self.assertEqual(build_config({"config": path}, NONE).workers, 3)
        config = build_config({"workers": "2", "listen": "tcp6:0:interface=\\:\\:1"}, NONE)
        self.assertEqual(config.workers, 2)
        self.assertRejected({"workers": "0"}, "--workers", "'0'", "at least 1")
        self.assertRejected({"workers": "two"}, "--workers", "'two'")
        self.assertRejected({"workers": "-2"}, "--workers", "'-2'")
        self.assertRejected({"workers": "2", "listen": "unix:/tmp/lb.sock"},
                            "--workers", "tcp:", "unix:/tmp/lb.sock")
        # one worker: any endpoint, as before
        self.assertEqual(build_config({"listen": "unix:/tmp/lb.sock"}, NONE).workers, 1)

    def test_bad_files(self) -> None:
        self.assertRejected({"config": "/nonexistent/lb.toml"}, "--config", "/nonexistent/lb.toml")
        self.assertRejected({"config": self.write("listen = ")}, "--config", "not valid TOML")
        self.assertRejected({"config": self.write("lisen = 1")}, "--config", "'lisen'")
        self.assertRejected({"config": self.write("fall = true")}, "--fall", "True")
        self.assertRejected({"config": self.write("workers = 1\nlisen = 1")}, "'lisen'")
        self.assertRejected({"config": self.write('[[backends]]\nweight = 2')},
                            "backends", "'url'")
        self.assertRejected({"config": self.write('[[backends]]\nurl = "h:1"\nwieght = 2')},
                            "backends", "'wieght'")
        self.assertRejected({"config": self.write('[[backends]]\nurl = "h:1"\nweight = 0')},
                            "backends.weight", "0")
        self.assertRejected({"config": self.write('[[backends]]\nurl = "h:1"\nmodels = "m"')},
                            "backends.models", "'m'")

    def test_bytes_that_are_not_utf8_are_a_one_line_refusal(self) -> None:
        path = self.mktemp()
        with open(path, "wb") as handle:
            handle.write(b'backends = ["h:1"]\nadmin-token = "\xff"\n')
        self.assertRejected({"config": path}, "--config", "not UTF-8", "0xff", "line 2")

    def test_nesting_past_the_recursion_limit_is_a_one_line_refusal(self) -> None:
        for opening in ("[", "{a = "):
            path = self.write('backends = ["h:1"]\nx = ' + opening * 5000)
            self.assertRejected({"config": path}, "--config", "nested too deeply")

    def test_an_integer_past_pythons_digit_limit_is_a_one_line_refusal(self) -> None:
        path = self.write('backends = ["h:1"]\nfall = ' + "7" * 5000)
        self.assertRejected({"config": path}, "--config", "not valid TOML", "digits")

    def test_a_number_past_a_floats_range_names_its_option(self) -> None:
        path = self.write('backends = ["h:1"]\nread-timeout = 1' + "0" * 400)
        self.assertRejected({"config": path}, "--read-timeout", "too large")

    def test_a_path_that_is_not_a_regular_file_is_refused_without_opening_it(self) -> None:
        fifo = self.mktemp()
        os.mkfifo(fifo)  # an open for reading would wait for a writer forever
        self.assertRejected({"config": fifo}, "--config", "not a regular file", "a FIFO")
        directory = self.mktemp()
        os.mkdir(directory)
        self.assertRejected({"config": directory}, "not a regular file", "a directory")
        self.assertRejected({"config": os.devnull}, "not a regular file", "device")

    def test_a_file_past_the_size_bound_is_refused_unread(self) -> None:
        from txlb._config import MAX_CONFIG_BYTES

        path = self.write('backends = ["h:1"]\n' + "#" * MAX_CONFIG_BYTES)
        self.assertRejected({"config": path}, "--config", "larger than 4 MiB")
        # one byte under the bound is read
        exactly = self.write('backends = ["h:1"]\n' + "#" * (
            MAX_CONFIG_BYTES - len('backends = ["h:1"]\n')))
        self.assertEqual(len(build_config({"config": exactly}, NONE).backends), 1)


class MistakeWordingTests(SynchronousTestCase):
    """The mistakes new users make are answered with what to write instead."""

    def refusal(self, options: dict[str, str]) -> str:
        with self.assertRaises(ConfigError) as raised:
            build_config(options, NONE)
        return str(raised.exception)

    def test_a_pasted_base_url_is_told_to_drop_its_path(self) -> None:
        said = self.refusal({"backends": "http://127.0.0.1:8002/v1"})
        self.assertIn("has a path; give the server alone, 'http://127.0.0.1:8002'", said)

    def test_a_bad_endpoint_is_said_in_txlbs_words_not_pythons(self) -> None:
        for option in ("listen", "admin"):
            said = self.refusal({option: "tcp:abc"})
            self.assertNotIn("invalid literal", said)
            self.assertIn(f"--{option}: 'tcp:abc' is not a port or a Twisted endpoint", said)
            self.assertIn("tcp:PORT:interface=ADDRESS", said)

    def test_a_top_level_key_after_the_backend_tables_says_where_it_belongs(self) -> None:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('[[backends]]\nurl = "http://127.0.0.1:8002"\npolicy = "p2c"\n')
        said = self.refusal({"config": path})
        self.assertIn("'policy' is a top-level option", said)
        self.assertIn("write top-level keys before the first [[backends]]", said)
        with open(path, "w") as handle:  # a typo of a table key gets no such hint
            handle.write('[[backends]]\nurl = "http://127.0.0.1:8002"\nwieght = 2\n')
        self.assertNotIn("top-level", self.refusal({"config": path}))


class BackendsKeyTests(SynchronousTestCase):
    """The default fleet is for a start with nothing configured, never for a file."""

    def write(self, text: str) -> str:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write(text)
        return path

    def test_a_file_without_a_backends_key_is_refused(self) -> None:
        path = self.write("retries = 1\n")
        error = self.assertRaises(ConfigError, build_config, {"config": path}, NONE)
        self.assertIn("has no 'backends' key", str(error))
        self.assertNotIn("\n", str(error))
        error = self.assertRaises(ConfigError, build_config, {}, {"LB_CONFIG": path})
        self.assertIn("has no 'backends' key", str(error))

    def test_an_empty_file_is_refused(self) -> None:
        error = self.assertRaises(ConfigError, build_config, {"config": self.write("")}, NONE)
        self.assertIn("has no 'backends' key", str(error))

    def test_an_explicit_empty_list_is_an_empty_fleet(self) -> None:
        config = build_config({"config": self.write("backends = []\n")}, NONE)
        self.assertEqual((config.backends, config.dns_backends), ((), ()))

    def test_backends_from_the_command_line_or_environment_count(self) -> None:
        path = self.write("retries = 1\n")
        config = build_config({"config": path, "backends": "h:1"}, NONE)
        self.assertEqual([b.key for b in config.backends], ["h:1"])
        config = build_config({"config": path}, {"LB_BACKENDS": "h:2"})
        self.assertEqual([b.key for b in config.backends], ["h:2"])

    def test_an_empty_backends_option_is_still_refused(self) -> None:
        for given, environ in (({"backends": ""}, NONE), ({}, {"LB_BACKENDS": ","})):
            error = self.assertRaises(ConfigError, build_config, given, environ)
            self.assertIn("names no backend", str(error))

    def test_without_a_file_the_default_fleet_applies(self) -> None:
        self.assertEqual(len(build_config({}, NONE).backends), 8)


class OptionsTests(SynchronousTestCase):
    def setUp(self) -> None:
        saved = {k: v for k, v in os.environ.items() if k.startswith("LB_")}
        for key in saved:
            del os.environ[key]
        self.addCleanup(os.environ.update, saved)

    def test_parse(self) -> None:
        options = Options()
        options.parseOptions(["--listen", "tcp:0", "--backends", "127.0.0.1:1", "--rise", "2"])
        self.assertEqual(options.config.listen, "tcp:0")
        self.assertEqual(options.config.rise, 2)
        self.assertEqual([b.key for b in options.config.backends], ["127.0.0.1:1"])

    def test_environment(self) -> None:
        os.environ["LB_BACKENDS"] = "127.0.0.1:5"
        options = Options()
        options.parseOptions([])
        self.assertEqual([b.key for b in options.config.backends], ["127.0.0.1:5"])

    def test_bad_value_is_usage_error(self) -> None:
        error = self.assertRaises(
            usage.UsageError, Options().parseOptions, ["--health-interval", "often"]
        )
        self.assertEqual(str(error), "--health-interval: 'often' is not a number")

    def test_every_option_documented(self) -> None:
        text = str(Options())
        for name in ("listen", "backends", "config", "health-interval", "health-path",
                     "health-timeout", "fall", "rise", "connect-timeout", "read-timeout"):
            self.assertIn(f"--{name}", text)
        self.assertIn("LB_PORT", text)
        self.assertIn("LB_HC_INTERVAL", text)


class BackendHostTests(SynchronousTestCase):
    """A host the prober or the upstream client could not use is refused at start-up."""

    def test_ip_literals_and_names_are_accepted(self) -> None:
        from txlb._config import parse_backend_address
        for text, key in [("[::1]:8004", "[::1]:8004"), ("http://[fe80::1]:80/", "[fe80::1]:80"),
                          ("127.0.0.1:8002", "127.0.0.1:8002"),
                          ("vllm-0.vllm.default.svc.cluster.local:8000",
                           "vllm-0.vllm.default.svc.cluster.local:8000")]:
            self.assertEqual(parse_backend_address("backends", text).key, key)

    def test_an_ipv6_address_has_one_key_however_it_is_spelt(self) -> None:
        """
        ``[0:0::1]:8004`` is ``[::1]:8004``: without one spelling the pool took it as a
        second backend (POST /backends answered 201, not 409) and drain by key missed it.
        """
        from txlb._config import parse_backend_address
        for text in ["[0:0::1]:8004", "[0000:0000:0000:0000:0000:0000:0000:0001]:8004",
                     "http://[0::1]:8004/"]:
            self.assertEqual(parse_backend_address("backends", text).key, "[::1]:8004")
        self.assertEqual(parse_backend_address("backends", "[FE80::A]:80").key,
                         "[fe80::a]:80")
        with self.assertRaises(ConfigError):
            build_config({"backends": "[::1]:8004,[0::1]:8004"}, NONE)

    def test_unusable_hosts_are_one_line_errors(self) -> None:
        from txlb._config import parse_backend_address
        for text in ["a" * 300 + ":8002", ("b" * 64) + ".example:80", "[::1%eth0]:8002",
                     "a b:8002", "-gpu:8002", "gpu..x:80", "gpu_3:8000"]:
            with self.assertRaises(ConfigError, msg=text) as caught:
                parse_backend_address("backends", text)
            message = str(caught.exception)
            self.assertIn("--backends", message)
            self.assertNotIn("\n", message)
            self.assertLess(len(message), 250)


class PrivacyOptionTests(SynchronousTestCase):
    """The result log's privacy options: parsed, validated, and one key for all workers."""

    def test_defaults_keep_everything(self) -> None:
        config = build_config({}, NONE)
        self.assertEqual((config.log_content, config.log_user, config.log_error_body),
                         (200, "keep", None))

    def test_values(self) -> None:
        config = build_config({"log-content": "0", "log-user": "drop",
                               "log-error-body": "none"}, NONE)
        self.assertEqual((config.log_content, config.log_user, config.log_error_body),
                         (0, "drop", 0))
        self.assertEqual(build_config({"log-error-body": "120"}, NONE).log_error_body, 120)

    def test_bad_values(self) -> None:
        for option, value in (("log-content", "1001"), ("log-content", "-1"),
                              ("log-user", "md5"), ("log-error-body", "some")):
            with self.assertRaises(ConfigError) as raised:
                build_config({option: value}, NONE)
            self.assertIn(f"--{option}", str(raised.exception))

    def test_hash_key_random_per_start_unless_given(self) -> None:
        one = build_config({"log-user": "hash"}, NONE)
        two = build_config({"log-user": "hash"}, NONE)
        self.assertNotEqual(one.log_user_key, two.log_user_key)
        self.assertNotIn(str(one.log_user_key), repr(one))
        given = build_config({"log-user": "hash"}, {"LB_LOG_USER_KEY": "s" * 20})
        self.assertEqual(given.log_user_key, "s" * 20)
        with self.assertRaises(ConfigError) as raised:
            build_config({}, {"LB_LOG_USER_KEY": "short-secret"})
        self.assertNotIn("short-secret", str(raised.exception))


class ImportCostTests(SynchronousTestCase):
    """
    Building a balancer on an injected clock touches neither the global reactor nor Klein:
    importing ``twisted.internet.reactor`` installs the default one, which would pre-empt
    twistd's ``--reactor`` or an embedder's own choice.
    """

    def test_config_and_balancer_leave_the_reactor_alone(self) -> None:
        import subprocess
        import sys

        script = (
            "import sys\n"
            "from twisted.internet.task import Clock\n"
            "from txlb import LoadBalancer, build_config\n"
            "build_config({'backends': '127.0.0.1:8002', 'listen': 'tcp:8000:interface=127.0.0.1',"
            " 'admin': 'tcp:8001'}, {})\n"
            "LoadBalancer(['127.0.0.1:8002'], reactor=Clock(), log_file='none')\n"
            "print(sorted(m for m in ('klein', 'twisted.internet.reactor') if m in sys.modules))\n"
        )
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=60, check=True)
        self.assertEqual(done.stdout.strip(), "[]", done.stderr)

    def test_a_leaf_of_the_config_package_does_not_build_the_table(self) -> None:
        """
        The package re-exports its names on first use: importing ``bounds`` or ``errors``
        (as the result summary and the policies do) loads neither the option table nor the
        policy registry it reads, which import those modules themselves.
        """
        import subprocess
        import sys

        script = (
            "import sys\n"
            "import txlb._config.bounds, txlb._config.errors\n"
            "print(sorted(m for m in ('txlb._config.table', 'txlb._config.config',"
            " 'txlb._scheduling.policies.registry') if m in sys.modules))\n"
            "from txlb._config import Config, ConfigError, build_config\n"
            "print(Config.__module__, ConfigError.__module__, build_config.__module__)\n"
        )
        import txlb

        # from the tree under test (trial runs in _trial_temp, whose path has no txlb)
        tree = os.path.dirname(os.path.dirname(os.path.abspath(txlb.__file__)))
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=60, check=True, cwd=tree)
        self.assertEqual(done.stdout.split("\n")[:2],
                         ["[]", "txlb._config.config txlb._config.errors txlb._config.config"],
                         done.stderr)

    def test_a_bad_endpoint_is_still_refused(self) -> None:
        with self.assertRaises(ConfigError) as caught:
            build_config({"backends": "127.0.0.1:8002",
                          "listen": "ssl:8443:privateKey=/nonexistent/key.pem"}, {})
        self.assertIn("--listen", str(caught.exception))
