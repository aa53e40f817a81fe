"""
The docs and the programs agree: every option ``twistd -n llmlb --help`` lists is in
docs/usage.md, and every ``--option`` the docs mention is an option of the program it is
given to.
"""

from __future__ import annotations

import re
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from ..processes import ROOT, clean_environment, twistd_command

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

#: Flags of programs that are not txlb's, as the docs pass them.
OTHER_PROGRAMS = {
    "--user", "--now",  # systemctl, journalctl, loginctl
    "--port", "--model", "--max-num-seqs",  # vllm serve (the simulator takes them too)
    "--served-model-name", "--api-key",  # vllm serve
    "--enable-prompt-tokens-details", "--enable-force-include-usage",  # vllm serve
    "--enable-cache-report",  # SGLang's launch_server
    "--alias", "--metrics", "--no-prefill-assistant",  # llama.cpp's llama-server
    "--save", "--appendonly", "--requirepass",  # redis-server
    "--from-literal",  # kubectl create secret
}
#: Written wrong on purpose: the docs show what txlb answers to a mistyped option.
MISTYPED_ON_PURPOSE = {"--helth-interval"}


def options_of(*command: str) -> set[str]:
    """The long options a program's ``--help`` lists."""
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60,
                          env=clean_environment(), cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return set(OPTION.findall(done.stdout))


class DocsMatchOptionsTests(SynchronousTestCase):
    def setUp(self) -> None:
        # the real process, as an operator runs it (twistd_command adds -n and --pidfile=)
        self.llmlb = options_of(*twistd_command())

    def test_every_llmlb_option_is_in_usage(self) -> None:
        usage = (ROOT / "docs" / "usage.md").read_text()
        self.assertGreater(len(self.llmlb), 30)
        missing = sorted(o for o in self.llmlb if not re.search(re.escape(o) + r"(?![\w-])",
                                                                 usage))
        self.assertEqual(missing, [], "options of twistd llmlb missing from docs/usage.md")

    def test_every_option_the_docs_mention_exists(self) -> None:
        twistd = twistd_command()[0]
        python = sys.executable
        known = (self.llmlb | options_of(twistd) | options_of(twistd, "vllm-sim")
                 | options_of(python, "-m", "txlb.nginx") | options_of(python, "-m", "txlb.demo")
                 | options_of(python, "-m", "txlb.keys")
                 | options_of(python, "-m", "bench", "relay") | options_of(python, "-m", "bench.ab")
                 | options_of(python, "-m", "bench.fuzz")
                 | options_of(python, "-m", "bench.prefix")
                 | options_of(python, "-m", "bench.policies")
                 | options_of(python, "-m", "bench.shared_state")
                 | options_of(python, "-m", "bench.body_memory")
                 | options_of(python, "-m", "bench.hostile_json")
                 | options_of(python, "-m", "bench.hostile_redis")
                 | {"--index"}  # txlb._workers.main, as it shows in ps
                 | OTHER_PROGRAMS | MISTYPED_ON_PURPOSE)
        unknown = sorted({f"{path.name}: {option}" for path in DOCS
                          for option in OPTION.findall(path.read_text())
                          if option not in known})
        self.assertEqual(unknown, [], "--options in the docs that no program takes")


class HelpReadsWellTests(SynchronousTestCase):
    """``twistd llmlb --help`` says what docs/usage.md says, in words an operator reads."""

    def setUp(self) -> None:
        done = subprocess.run([*twistd_command(), "--help"], capture_output=True, text=True,
                              timeout=60, env=clean_environment(), cwd=ROOT)
        self.help = done.stdout

    def test_no_python_none_and_no_default_said_twice(self) -> None:
        self.assertNotIn("Default: None", self.help)
        flat = " ".join(self.help.split())
        for option in re.findall(r"--[a-z0-9-]+=.*?(?= --[a-z0-9-]+[= ]|$)", flat):
            self.assertLessEqual(option.lower().count("default:"), 1, option)

    def test_no_address_is_cut_across_lines(self) -> None:
        lines = [line.strip() for line in self.help.splitlines()]
        for line, after in zip(lines, lines[1:], strict=False):
            cut = re.search(r"\d[\d.:]*$", line) and re.match(r"[\d.:]", after)
            self.assertFalse(cut, f"{line!r} / {after!r}")

    def test_the_shared_state_url_is_written_as_in_usage(self) -> None:
        usage = (ROOT / "docs" / "usage.md").read_text()
        form = "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]"
        self.assertIn(form, usage)
        self.assertIn(form, " ".join(self.help.split()))


class DocsSpeakToUsersTests(SynchronousTestCase):
    """The docs describe txlb to its users, not the project's internal material."""

    INTERNAL = re.compile(r"\bthe contract\b|\bcontract's\b|\bthe issue\b|\bissue's\b|"
                          r"\bas the \w+ issue\b|\bin this version\b|\bdoes not yet\b|"
                          r"\bthe lead\b", re.IGNORECASE)

    def test_no_internal_references(self) -> None:
        found = [f"{path.name}: {match.group(0)}" for path in DOCS
                 for match in self.INTERNAL.finditer(path.read_text())]
        self.assertEqual(found, [])
