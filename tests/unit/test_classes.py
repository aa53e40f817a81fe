"""Priority classes: the [[classes]] table, a request's class, and the queue that serves them."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from txlb._config import ConfigError, build_config
from txlb._config.classes import ClassSpec
from txlb._records.summary import summarize
from txlb._scheduling.classes import PriorityClasses

from ..helpers import ClientConnection, keep_records
from .test_scheduling import BalancerTestCase

BATCH_KEY = "sk-batch-tenant-0001"
SECRET = "sk-live-0123456789abcdef"
FAST_KEY = "sk-interactive-tenant-0002"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ConfigTests(SynchronousTestCase):
    def build(self, text: str, environ: dict[str, str] | None = None,
              **command_line: object) -> Any:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write('backends = "127.0.0.1:8002"\n' + text)
        return build_config({"config": path, **command_line}, environ or {})

    def refused(self, text: str, *words: str, **command_line: object) -> str:
        with self.assertRaises(ConfigError) as caught:
            self.build(text, **command_line)
        message = str(caught.exception)
        self.assertNotIn("\n", message)
        for word in words:
            self.assertIn(word, message)
        return message

    def test_defaults(self) -> None:
        config = self.build("")
        self.assertEqual(config.classes, ())
        self.assertEqual(config.priority_header, "X-Priority")
        self.assertEqual(config.default_class, "default")
        classes = PriorityClasses(config)
        self.assertEqual([c.name for c in classes.order], ["interactive", "default", "batch"])
        self.assertEqual([c.queue_timeout for c in classes.order], [30.0] * 3)
        self.assertEqual([c.starvation_age for c in classes.order], [None, 15.0, 15.0])

    def test_a_full_table(self) -> None:
        config = self.build(f'''
queue-timeout = 20
default-class = "standard"
priority-header = "X-Class"
[[classes]]
name = "fast"
keys = ["{digest(FAST_KEY)}"]
queue_timeout = 2
[[classes]]
name = "standard"
[[classes]]
name = "bulk"
keys = ["sha256:{digest(BATCH_KEY).upper()}"]
models = ["llama-offline"]
paths = ["/v1/embeddings"]
starvation_age = 10
shed_at = 50
''')
        self.assertEqual(config.classes, (
            ClassSpec("fast", keys=(digest(FAST_KEY),), queue_timeout=2.0),
            ClassSpec("standard"),
            ClassSpec("bulk", keys=(digest(BATCH_KEY),), models=("llama-offline",),
                      paths=("/v1/embeddings",), starvation_age=10.0, shed_at=50)))
        self.assertEqual(config.priority_header, "X-Class")
        self.assertEqual([c.queue_timeout for c in PriorityClasses(config).order],
                         [2.0, 20.0, 20.0])

    def test_header_option_from_the_environment_and_none(self) -> None:
        self.assertIsNone(self.build("", {"LB_PRIORITY_HEADER": "none"}).priority_header)
        self.assertEqual(self.build("", {"LB_PRIORITY_HEADER": "X-Tier"}).priority_header,
                         "X-Tier")
        self.refused("", "--priority-header", "'X Tier'", **{"priority-header": "X Tier"})

    def test_the_default_class_must_exist(self) -> None:
        self.refused("", "--default-class", "'standard'", **{"default-class": "standard"})
        self.refused('default-class = "batc"\n', "did you mean 'batch'")
        self.assertEqual(self.build('default-class = "batch"\n').default_class, "batch")

    def test_duplicate_names(self) -> None:
        self.refused('[[classes]]\nname = "a"\n[[classes]]\nname = "A"\n',
                     "classes.name", "'A'", "listed twice")

    def test_unknown_key_with_a_suggestion(self) -> None:
        self.refused('[[classes]]\nname = "a"\nstarvation-age = 3\n',
                     "unknown key 'starvation-age'", "class 'a'",
                     "did you mean 'starvation_age'")
        self.refused('[[classes]]\nname = "a"\nshed = 3\n', "unknown key 'shed'")

    def test_starvation_age_must_be_shorter_than_the_queue_timeout(self) -> None:
        self.refused('default-class = "a"\n'
                     '[[classes]]\nname = "a"\nqueue_timeout = 5\nstarvation_age = 5\n',
                     "classes.starvation_age", "5s", "'a'", "(5s)")
        # against --queue-timeout when the class has no timeout of its own
        self.refused('queue-timeout = 8\n[[classes]]\nname = "a"\nstarvation_age = 9\n',
                     "(8s)")
        self.refused('[[classes]]\nname = "a"\nstarvation_age = 9\n', "(8s)",
                     **{"queue-timeout": "8"})
        # the built-in classes' guards follow --queue-timeout, so any timeout is valid
        self.build("queue-timeout = 0.5\n")

    def test_empty_and_bad_names(self) -> None:
        for name in ('""', '" "', '"a b"', "3", '"-a"', '"' + "a" * 33 + '"'):
            self.refused(f'[[classes]]\nname = {name}\n', "classes.name")
        self.refused('[[classes]]\nqueue_timeout = 3\n', "classes.name", "None")

    def test_bad_types(self) -> None:
        for key, value, words in [
            ("queue_timeout", '"3"', ("classes.queue_timeout", "'3'", "'a'")),
            ("queue_timeout", "0", ("classes.queue_timeout",)),
            ("queue_timeout", "true", ("classes.queue_timeout",)),
            ("queue_timeout", "inf", ("classes.queue_timeout",)),
            ("starvation_age", "-1", ("classes.starvation_age",)),
            ("shed_at", "-1", ("classes.shed_at",)),
            ("shed_at", "1.5", ("classes.shed_at",)),
            ("shed_at", "false", ("classes.shed_at",)),
            ("models", '"llama"', ("classes.models", "not a list")),
            ("models", '[""]', ("classes.models",)),
            ("paths", '["v1"]', ("classes.paths", "'v1'")),
            ("keys", '"abc"', ("classes.keys",)),
            ("keys", '["sk-live-secret-token"]', ("classes.keys", "entry 1", "sha256")),
        ]:
            message = self.refused(f'[[classes]]\nname = "a"\n{key} = {value}\n', *words)
            self.assertNotIn("sk-live", message)  # a key pasted by mistake is not echoed
        self.refused('classes = "a"\n', "classes:", "not a list")
        self.refused("classes = [3]\n", "classes:", "not a table")
        self.refused("".join(f'[[classes]]\nname = "c{n}"\n' for n in range(17)),
                     "17 classes")

    def test_a_key_bound_to_two_classes(self) -> None:
        self.refused(f'[[classes]]\nname = "a"\nkeys = ["{digest(BATCH_KEY)}"]\n'
                     f'[[classes]]\nname = "b"\nkeys = ["{digest(BATCH_KEY)}"]\n',
                     "classes.keys", "'a'", "'b'")

    def test_the_docs_example_is_a_valid_config(self) -> None:
        from pathlib import Path

        docs = (Path(__file__).parents[2] / "docs" / "scheduling.md").read_text()
        example = docs[docs.index("### An example"):]
        example = example[example.index("```toml") + 7:]
        config = self.build(example[:example.index("```")])
        self.assertEqual([c.name for c in config.classes], ["interactive", "standard", "batch"])
        self.assertEqual(config.classes[0].keys, (digest("test"),))

    def test_the_classes_reach_workers(self) -> None:
        """--workers hands each worker the validated config, classes included."""
        from txlb._workers.wire import config_blob, config_from

        config = self.build(f'[[classes]]\nname = "default"\nkeys = ["{digest(BATCH_KEY)}"]\n'
                            'shed_at = 3\n', **{"priority-header": "X-Tier"})
        self.assertEqual(config_from(config_blob(config)), config)

    def test_a_summary_keeps_its_class_over_the_workers_wire(self) -> None:
        from txlb._records.summary import Summary
        from txlb._workers import wire

        summary = Summary(time=1.0, orid="o", backend="b:1", method="POST", path="/v1/x",
                          status=200, kind="other", outcome="ok", dur=0.5, priority="batch")
        message = json.loads(wire.summary_message(summary, True))
        self.assertEqual(wire.summary_from(message[2]).priority, "batch")

    def test_classes_are_config_file_only(self) -> None:
        from txlb._config import OPTIONS

        (spec,) = [o for o in OPTIONS if o.name == "classes"]
        self.assertFalse(spec.cli)


def request(headers: dict[bytes, bytes] | None = None) -> DummyRequest:
    dummy = DummyRequest([b"v1", b"chat", b"completions"])
    for name, value in (headers or {}).items():
        dummy.requestHeaders.setRawHeaders(name, [value])
    return dummy


class ResolutionTests(SynchronousTestCase):
    def classes(self, text: str = "", **options: object) -> PriorityClasses:
        path = self.mktemp()
        with open(path, "w") as handle:
            handle.write(text)
        return PriorityClasses(build_config(
            {"config": path, "backends": "127.0.0.1:1", **options}, {}))

    def resolve(self, classes: PriorityClasses, headers: dict[bytes, bytes] | None = None,
                path: bytes = b"/v1/chat/completions", models: tuple[str, ...] = ()) -> str:
        return classes.resolve(request(headers), path, list(models))

    def test_the_header_is_honoured_as_sent_without_keys(self) -> None:
        classes = self.classes()
        self.assertEqual(self.resolve(classes), "default")
        self.assertEqual(self.resolve(classes, {b"x-priority": b"interactive"}), "interactive")
        self.assertEqual(self.resolve(classes, {b"X-Priority": b" Batch "}), "batch")

    def test_an_unknown_or_hostile_header_is_the_default_class(self) -> None:
        classes = self.classes()
        for value in (b"urgent", b"", b"\xff\xfe", b"interactive" * 10, b"0"):
            self.assertEqual(self.resolve(classes, {b"x-priority": value}), "default")

    def test_the_header_name_is_configurable_or_ignored(self) -> None:
        tier = self.classes(**{"priority-header": "X-Tier"})
        self.assertEqual(self.resolve(tier, {b"x-tier": b"batch"}), "batch")
        self.assertEqual(self.resolve(tier, {b"x-priority": b"batch"}), "default")
        ignored = self.classes(**{"priority-header": "none"})
        self.assertEqual(self.resolve(ignored, {b"x-priority": b"batch"}), "default")

    def test_the_default_class_is_configurable(self) -> None:
        classes = self.classes(**{"default-class": "batch"})
        self.assertEqual(self.resolve(classes), "batch")
        self.assertEqual(self.resolve(classes, {b"x-priority": b"nonsense"}), "batch")

    def test_models_and_paths_match_in_order(self) -> None:
        classes = self.classes(
            '[[classes]]\nname = "chat"\nmodels = ["llama-chat"]\n'
            '[[classes]]\nname = "std"\n'
            '[[classes]]\nname = "bulk"\nmodels = ["llama-offline"]\n'
            '[[classes]]\nname = "embed"\npaths = ["/v1/embeddings"]\n'
            '[[classes]]\nname = "both"\nmodels = ["m"]\npaths = ["/v1/completions"]\n',
            **{"default-class": "std"})
        self.assertEqual(self.resolve(classes, models=("llama-chat",)), "chat")
        self.assertEqual(self.resolve(classes, models=("alias", "llama-offline")), "bulk")
        self.assertEqual(self.resolve(classes, path=b"/v1/embeddings"), "embed")
        self.assertEqual(self.resolve(classes, path=b"/v1/completions", models=("m",)), "both")
        self.assertEqual(self.resolve(classes, models=("m",)), "std")  # path must match too
        self.assertEqual(self.resolve(classes, models=("other",)), "std")
        # without keys bound, the header wins over a rule
        self.assertEqual(self.resolve(classes, {b"x-priority": b"chat"},
                                      models=("llama-offline",)), "chat")

    def keyed(self) -> PriorityClasses:
        return self.classes(
            f'[[classes]]\nname = "interactive"\nkeys = ["{digest(FAST_KEY)}"]\n'
            '[[classes]]\nname = "default"\n'
            f'[[classes]]\nname = "batch"\nkeys = ["{digest(BATCH_KEY)}"]\n')

    def test_a_key_cannot_claim_a_class_above_its_own(self) -> None:
        classes = self.keyed()
        batch = {b"authorization": f"Bearer {BATCH_KEY}".encode()}
        self.assertEqual(self.resolve(classes, batch), "batch")
        self.assertEqual(self.resolve(classes, {**batch, b"x-priority": b"interactive"}),
                         "batch")
        self.assertEqual(self.resolve(classes, {**batch, b"x-priority": b"default"}), "batch")

    def test_a_key_may_lower_its_class(self) -> None:
        classes = self.keyed()
        fast = {b"authorization": f"Bearer {FAST_KEY}".encode()}
        self.assertEqual(self.resolve(classes, fast), "interactive")
        self.assertEqual(self.resolve(classes, {**fast, b"x-priority": b"batch"}), "batch")
        self.assertEqual(self.resolve(classes, {**fast, b"x-priority": b"nonsense"}),
                         "interactive")

    def test_with_keys_bound_others_cannot_jump_ahead(self) -> None:
        classes = self.keyed()
        for headers in ({b"x-priority": b"interactive"},
                        {b"authorization": b"Bearer sk-unknown", b"x-priority": b"interactive"},
                        {b"authorization": FAST_KEY.encode(),  # not a bearer token
                         b"x-priority": b"interactive"}):
            self.assertEqual(self.resolve(classes, headers), "default")
        self.assertEqual(self.resolve(classes, {b"x-priority": b"batch"}), "batch")


class QueueCase(BalancerTestCase):
    """Two backends with max_conns = 1 (models a, b): who is served next shows the order."""

    CLASSES = (
        '[[classes]]\nname = "interactive"\nqueue_timeout = 3\n'
        '[[classes]]\nname = "default"\n'
        '[[classes]]\nname = "batch"\nstarvation_age = 6\nshed_at = 4\n'
        )

    def setUp(self) -> None:
        self.build(config_file=self.config_file(
            'queue-timeout = 10\n'
            '[[backends]]\nurl = "127.0.0.1:8002"\nmax_conns = 1\nmodels = ["a"]\n'
            '[[backends]]\nurl = "127.0.0.1:8003"\nmax_conns = 1\nmodels = ["b"]\n'
            + self.CLASSES))

    def send(self, name: str, priority: str | None = None, model: str = "a",
             key: str | None = None) -> ClientConnection:
        headers = [] if priority is None else [(b"X-Priority", priority.encode())]
        if key is not None:
            headers.append((b"Authorization", f"Bearer {key}".encode()))
        return self.post({"model": model, "n": name}, headers=headers)

    def served(self) -> list[str]:
        return [json.loads(call.body or b"")["n"] for call in self.upstream.calls]

    def status(self) -> dict[str, Any]:
        client = ClientConnection(self.site)
        client.request(b"GET", b"/__lb_status")
        result: dict[str, Any] = json.loads(client.response().body)
        return result["queue"]  # type: ignore[no-any-return]

    def release_all(self, limit: int = 20) -> None:
        """Finish each request as it reaches the backend, until none is left waiting."""
        done = 0
        while done < len(self.upstream.calls) and done < limit:
            self.finish(done)
            done += 1


class PriorityQueueTests(QueueCase):
    """The queue's rules, one by one."""

    def test_higher_classes_first_fifo_within(self) -> None:
        self.send("busy")
        for name, priority in [("b1", "batch"), ("d1", None), ("b2", "batch"),
                               ("i1", "interactive"), ("d2", "default"), ("i2", "interactive")]:
            self.send(name, priority)
        self.release_all()
        self.assertEqual(self.served(), ["busy", "i1", "i2", "d1", "d2", "b1", "b2"])

    def test_status_per_class(self) -> None:
        self.send("busy")
        self.send("b1", "batch")
        self.clock.advance(2)
        self.send("i1", "interactive")
        self.send("i2", "interactive")
        self.clock.advance(0.5)
        queue = self.status()
        self.assertEqual((queue["length"], queue["oldest_wait_s"], queue["timeout_s"]),
                         (3, 2.5, 10.0))
        self.assertEqual(queue["classes"], {
            "interactive": {"length": 2, "oldest_wait_s": 0.5, "timeout_s": 3.0},
            "default": {"length": 0, "oldest_wait_s": 0.0, "timeout_s": 10.0},
            "batch": {"length": 1, "oldest_wait_s": 2.5, "timeout_s": 10.0}})
        self.assertEqual(self.lb.router.queue_lengths(),
                         {"interactive": 2, "default": 0, "batch": 1})

    def test_a_starving_request_is_served_next(self) -> None:
        self.send("busy")
        self.send("b1", "batch")
        self.send("b2", "batch")
        self.clock.advance(5.9)
        self.send("i1", "interactive")
        self.finish(0)
        self.assertEqual(self.served()[-1], "i1")  # not starving yet: 5.9 < 6
        self.clock.advance(0.1)
        self.send("i2", "interactive")
        self.finish(1)
        self.assertEqual(self.served()[-1], "b1")  # waited 6 s: ahead of i2
        self.finish(2)
        # b2 starves too, but the last slot went to a starving request: this one goes by
        # precedence, so that starving batch requests cannot take every slot
        self.assertEqual(self.served()[-1], "i2")
        self.send("i3", "interactive")
        self.finish(3)
        self.assertEqual(self.served()[-1], "b2")  # and the next to the starving again
        self.finish(4)
        self.assertEqual(self.served()[-1], "i3")

    def test_each_class_times_out_after_its_own_queue_timeout(self) -> None:
        self.send("busy")
        fast = self.send("i1", "interactive")
        slow = self.send("d1")
        self.clock.advance(2.9)
        self.assertEqual(fast.transport.value(), b"")
        self.clock.advance(0.1)
        self.assertEqual(fast.response().status, 503)
        self.assertTrue(fast.response().header(b"retry-after"))
        self.assertEqual(slow.transport.value(), b"")
        self.clock.advance(7)
        self.assertEqual(slow.response().status, 503)

    def test_a_class_is_shed_when_the_queue_is_long(self) -> None:
        self.send("busy")
        for n in range(2):
            self.send(f"i{n}", "interactive")
        for n in range(2):
            self.send(f"b{n}", "batch")
        self.assertEqual(self.lb.router.queue_length, 4)
        shed = self.send("b2", "batch")
        response = shed.response()  # at once, not after the queue timeout
        self.assertEqual(response.status, 503)
        self.assertTrue(response.header(b"retry-after"))
        self.assertIn(b"`batch`", response.body)
        kept = self.send("i2", "interactive")  # other classes still queue
        self.assertEqual(kept.transport.value(), b"")
        self.assertEqual(self.lb.router.queue_length, 5)
        self.release_all()
        self.assertEqual(self.served(), ["busy", "i0", "i1", "i2", "b0", "b1"])

    def test_a_client_that_leaves_leaves_its_class_queue(self) -> None:
        self.send("busy")
        gone = self.send("i1", "interactive")
        self.send("b1", "batch")
        gone.disconnect()
        self.assertEqual(self.status()["classes"]["interactive"]["length"], 0)
        self.finish(0)
        self.assertEqual(self.served(), ["busy", "b1"])

    def test_waiters_whose_backends_vanished_are_answered_at_once(self) -> None:
        self.send("busy")
        self.send("busy-b", model="b")
        on_a = self.send("i1", "interactive")
        on_b = self.send("b1", "batch", model="b")
        self.lb.pool.mark_down(self.lb.pool.get("127.0.0.1:8002"), "test")
        self.assertEqual(on_a.response().status, 503)
        self.assertEqual(on_b.transport.value(), b"")  # its backend is still up
        self.assertEqual(self.lb.router.queue_lengths()["batch"], 1)

    def test_a_full_higher_class_does_not_block_a_lower_one(self) -> None:
        self.send("busy")
        self.send("busy-b", model="b")
        self.send("i1", "interactive")  # for model a
        self.send("b1", "batch", model="b")
        self.finish(1)  # b's slot frees: a's interactive waiter cannot use it
        self.assertEqual(self.served()[-1], "b1")
        self.assertEqual(self.lb.router.queue_lengths()["interactive"], 1)

    def test_a_batch_key_claiming_interactive_waits_as_batch(self) -> None:
        self.CLASSES += f'keys = ["{digest(BATCH_KEY)}"]\n'
        self.setUp()
        records = keep_records(self.lb)
        self.send("busy")
        self.send("b1", "interactive", key=BATCH_KEY)
        self.send("d1")
        self.release_all()
        self.assertEqual(self.served(), ["busy", "d1", "b1"])
        classes = {json.loads(r.request_body)["n"]: summarize(r).priority for r in records}
        self.assertEqual(classes, {"busy": "default", "d1": "default", "b1": "batch"})

    def test_the_result_log_names_the_class(self) -> None:
        records = keep_records(self.lb)
        self.send("i1", "interactive")
        self.finish(0)
        from txlb._records.resultlog import format_json, format_text

        summary = summarize(records[0])
        self.assertIn(" class=interactive", format_text(summary))
        self.assertEqual(json.loads(format_json(summary))["class"], "interactive")


class EncodedPathClassTests(QueueCase):
    """A class's paths match the percent-decoded path, as the engine routes it."""

    CLASSES = ('[[classes]]\nname = "interactive"\n'
               '[[classes]]\nname = "default"\n'
               '[[classes]]\nname = "batch"\npaths = ["/v1/completions"]\n')

    def test_an_encoded_path_is_in_its_class(self) -> None:
        records = keep_records(self.lb)
        self.send("busy")
        self.post({"model": "a", "n": "b1"}, path=b"/v1/%63ompletions")
        self.send("d1")
        self.release_all()
        self.assertEqual(self.served(), ["busy", "d1", "b1"])
        self.assertEqual([record.routing.priority for record in records],
                         ["default", "default", "batch"])


class DuplicateAuthorizationClassTests(QueueCase):
    """A second Authorization header cannot lift a key bound to a low class: 400."""

    BATCH_KEY = "sk-batch-tenant-0001"
    CLASSES = ('[[classes]]\nname = "interactive"\n'
               '[[classes]]\nname = "default"\n'
               '[[classes]]\nname = "batch"\nkeys = '
               f'["{hashlib.sha256(BATCH_KEY.encode()).hexdigest()}"]\n')

    def test_a_batch_key_cannot_climb_with_a_second_authorization(self) -> None:
        self.send("busy")
        # the backend would authenticate the batch key (the first)
        climber = self.post({"model": "a", "n": "b1"}, headers=[
            (b"Authorization", f"Bearer {self.BATCH_KEY}".encode()),
            (b"Authorization", b"Bearer nobody")])
        self.assertEqual(climber.response().status, 400)
        self.send("d1")
        self.release_all()
        self.assertEqual(self.served(), ["busy", "d1"])


class ReconfigureTests(QueueCase):
    """reconfigure(config): the queue keeps its waiters, in their places."""

    def reconfigure(self, text: str, queue_timeout: float = 10) -> None:
        path = self.config_file(f'queue-timeout = {queue_timeout}\n'
                                'backends = "127.0.0.1:8002"\n' + text)
        self.lb.classes.reconfigure(build_config({"config": path}, {}))

    def test_queued_requests_keep_their_place(self) -> None:
        self.send("busy")
        for name, priority in [("b1", "batch"), ("i1", "interactive"), ("b2", "batch")]:
            self.send(name, priority)
        # batch now ranks first
        self.reconfigure('[[classes]]\nname = "batch"\n[[classes]]\nname = "interactive"\n'
                         '[[classes]]\nname = "default"\n')
        self.assertEqual(self.lb.router.queue_length, 3)
        self.release_all()
        self.assertEqual(self.served(), ["busy", "b1", "b2", "i1"])

    def test_a_waiter_whose_class_vanished_joins_the_default_class(self) -> None:
        self.send("busy")
        self.send("b1", "batch")
        self.clock.advance(1)
        self.send("d1")
        self.clock.advance(1)
        self.send("i1", "interactive")
        self.reconfigure('[[classes]]\nname = "interactive"\n[[classes]]\nname = "default"\n')
        self.assertEqual(self.lb.router.queue_lengths(), {"interactive": 1, "default": 2})
        self.release_all()
        self.assertEqual(self.served(), ["busy", "i1", "b1", "d1"])  # b1 came first

    def test_deadlines_follow_the_new_timeouts(self) -> None:
        self.send("busy")
        short = self.send("d1")
        self.clock.advance(4)
        longer = self.send("i1", "interactive")  # 3 s of its own, 1 left
        self.reconfigure('[[classes]]\nname = "interactive"\nqueue_timeout = 8\n'
                         '[[classes]]\nname = "default"\n', queue_timeout=5)
        self.clock.advance(0.9)
        self.assertEqual(short.transport.value(), b"")  # 4.9 of its new 5
        self.clock.advance(0.1)
        self.assertEqual(short.response().status, 503)
        self.assertEqual(longer.transport.value(), b"")  # its 1 s became 8
        self.clock.advance(7)
        self.assertEqual(longer.response().status, 503)

    def test_a_deadline_already_past_expires_at_once(self) -> None:
        self.send("busy")
        waiting = self.send("d1")
        self.clock.advance(4)
        self.reconfigure("", queue_timeout=2)
        self.clock.advance(0)
        self.assertEqual(waiting.response().status, 503)
        self.assertEqual(self.lb.router.queue_length, 0)

    def test_new_requests_resolve_with_the_new_classes(self) -> None:
        self.reconfigure('priority-header = "X-Tier"\n')
        self.send("busy")
        self.send("d1", "interactive")  # X-Priority no longer read
        self.post({"model": "a", "n": "i1"}, headers=[(b"X-Tier", b"interactive")])
        self.release_all()
        self.assertEqual(self.served(), ["busy", "i1", "d1"])


class SecretsInErrorsTests(SynchronousTestCase):
    """
    classes.keys refuses an entry that is not a digest without echoing it (a pasted key),
    but the type checks before it echo the whole value -- into the log line of a refused
    reload and /status's config.last_error.
    """

    def test_a_pasted_key_is_never_echoed(self) -> None:
        for classes in ([{"name": "vip", "keys": SECRET}],
                        [{"name": "vip", "keys": [SECRET, ""]}],
                        [{"name": "vip", "keys": [SECRET, 5]}], [SECRET]):
            with self.assertRaises(ConfigError) as caught:
                build_config({"backends": "127.0.0.1:1", "classes": classes}, {})
            self.assertNotIn(SECRET, str(caught.exception))
