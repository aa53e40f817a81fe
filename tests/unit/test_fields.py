"""
The result log's field table (txlb._records.fields): that it describes every field of a
Summary once, and that the two formats are made from it -- a row added, moved or left out
changes both formats and nothing else.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import attrs
from twisted.trial.unittest import SynchronousTestCase

from bench.formats import variety
from txlb._records.fields import (
    ALL,
    COMPLETION,
    EMBEDDING,
    ERROR,
    FIELDS,
    INT,
    KINDS,
    OTHER,
    STR,
    BadSummary,
    Field,
    Text,
    count,
    from_wire,
    json_formatter,
    text_formatter,
    to_wire,
    wire_reader,
    wire_writer,
)
from txlb._records.resultlog import format_json, format_text
from txlb._records.summary import Summary
from txlb._workers.wire import Finished, decode, summary_from, summary_message


@attrs.frozen
class Wider(Summary):
    """A summary with one more field, the way a new field arrives."""

    novel: int | None = None


def _is_none(value: object) -> bool:
    return value is None


NOVEL = Field("novel", INT.optional(), text=(Text(900, " novel=", count, omit=_is_none),))


def summaries() -> list[Summary]:
    """One summary of every kind, each with the optional fields shown."""
    common: dict[str, Any] = dict(time=0.0, orid="o", backend="b:1", method="POST",
                                  status=200, outcome="timeout", dur=1.0, ttft=0.5,
                                  tries=2, resumes=1, resumed_backend="c:2",
                                  resume_refused="n", truncated=True,
                                  priority="batch", tenant="search")
    return [
        Summary(kind="completion", path="/v1/messages", finish="stop", completion_tokens=3,
                max_tokens=9, clen=4, preview="abcd", empty=False, prompt_tokens=12,
                cached_prompt_tokens=8, **common),
        Summary(kind="error", path="/v1/completions", req_keys=["a"], err_body="no",
                **{**common, "status": 400}),
        Summary(kind="embedding", path="/v1/embeddings", count=2, prompt_tokens=5, **common),
        Summary(kind="other", path="/v1/models", **common),
    ]


class UTCTestCase(SynchronousTestCase):
    """Text lines start with a local time: tests read them in UTC."""

    def setUp(self) -> None:
        old = os.environ.get("TZ")
        os.environ["TZ"] = "UTC"
        time.tzset()

        def restore() -> None:
            if old is None:
                os.environ.pop("TZ", None)
            else:
                os.environ["TZ"] = old
            time.tzset()

        self.addCleanup(restore)


class TableTests(SynchronousTestCase):
    def test_every_summary_attribute_has_one_row(self) -> None:
        attributes = [field.attribute for field in FIELDS]
        self.assertEqual(sorted(attributes), sorted(a.name for a in attrs.fields(Summary)))
        names = [field.name for field in FIELDS]
        self.assertEqual(len(set(names)), len(names))

    def test_every_row_names_kinds_there_are(self) -> None:
        for field in FIELDS:
            self.assertLessEqual(field.kinds, ALL, field.name)
            for text in field.text:
                kinds = field.kinds if text.kinds is None else text.kinds
                self.assertTrue(kinds, field.name)
                self.assertLessEqual(kinds, field.kinds, field.name)

    def test_the_log_formats_are_the_tables(self) -> None:
        """resultlog's two formatters are made from FIELDS, not written by hand."""
        self.assertEqual(format_text.__source__, text_formatter(FIELDS).__source__)
        self.assertEqual(format_json.__source__, json_formatter(FIELDS).__source__)
        self.assertIn("made from the field", format_text.__doc__ or "")

    def test_two_fields_in_one_place_are_refused(self) -> None:
        clash = Field("novel", INT.optional(), text=(Text(50, " novel="),))
        with self.assertRaises(ValueError) as caught:
            text_formatter((*FIELDS, clash))
        self.assertIn("completion", str(caught.exception))


class NewFieldTests(UTCTestCase):
    """What adding a row does: the seam the next result-log fields go through."""

    def test_a_new_row_reaches_both_formats_of_every_kind(self) -> None:
        text, as_json = text_formatter((*FIELDS, NOVEL)), json_formatter((*FIELDS, NOVEL))
        for summary in summaries():
            wider = Wider(**attrs.asdict(summary, recurse=False), novel=7)
            line = text(wider)
            before = format_text(summary)
            if " | " in before:  # before the free text, after every other field
                head, tail = before.split(" | ", 1)
                if head.endswith(" ERR_BODY"):
                    head = head[:-len(" ERR_BODY")]
                    tail = "ERR_BODY | " + tail
                    self.assertEqual(line, f"{head} novel=7 {tail}")
                else:
                    self.assertEqual(line, f"{head} novel=7 | {tail}")
            else:
                self.assertEqual(line, before + " novel=7")
            self.assertEqual(json.loads(as_json(wider)),
                             {**json.loads(format_json(summary)), "novel": 7})
            self.assertEqual(list(json.loads(as_json(wider)))[-1], "novel")

    def test_a_new_row_is_omitted_as_it_says(self) -> None:
        text = text_formatter((*FIELDS, NOVEL))
        for summary in summaries():
            wider = Wider(**attrs.asdict(summary, recurse=False))
            self.assertEqual(text(wider), format_text(summary))

    def test_a_row_for_some_kinds_only(self) -> None:
        only = Field("novel", INT.optional(), kinds=frozenset({"embedding"}),
                     text=(Text(155, " novel=", count),))
        text, as_json = text_formatter((*FIELDS, only)), json_formatter((*FIELDS, only))
        for summary in summaries():
            wider = Wider(**attrs.asdict(summary, recurse=False))
            if summary.kind == "embedding":
                self.assertIn(" n=2 novel=- ptok=5 ", text(wider))  # by its place, 155
                self.assertIsNone(json.loads(as_json(wider))["novel"])
            else:
                self.assertEqual(text(wider), format_text(summary))
                self.assertNotIn("novel", json.loads(as_json(wider)))

    def test_json_keys_keep_the_row_order_around_an_omitted_field(self) -> None:
        """A field that may be left out, then one that never is: the order holds."""
        maybe = Field("novel", INT.optional(), json_omit=_is_none)
        always = Field("shown", STR, attr="orid")
        as_json = json_formatter((*FIELDS[:3], maybe, always))
        wider = Wider(**attrs.asdict(summaries()[0], recurse=False), novel=1)
        self.assertEqual(list(json.loads(as_json(wider))),
                         ["time", "orid", "backend", "novel", "shown"])
        self.assertEqual(list(json.loads(as_json(attrs.evolve(wider, novel=None)))),
                         ["time", "orid", "backend", "shown"])

    def test_a_first_field_that_may_be_left_out_is(self) -> None:
        """Even ahead of every field that is always there: no row's place lifts its omit."""
        maybe = Field("novel", INT.optional(), json_omit=_is_none)
        as_json = json_formatter((maybe, *FIELDS[:3]))
        wider = Wider(**attrs.asdict(summaries()[0], recurse=False), novel=None)
        self.assertEqual(list(json.loads(as_json(wider))), ["time", "orid", "backend"])
        self.assertEqual(list(json.loads(as_json(attrs.evolve(wider, novel=2)))),
                         ["novel", "time", "orid", "backend"])

    def test_a_json_only_row(self) -> None:
        """``kind`` has no text piece: the line's shape says it."""
        (kind,) = [field for field in FIELDS if field.name == "kind"]
        self.assertEqual(kind.text, ())
        for summary in summaries():
            words = format_text(summary).split(" | ")[0].split()
            self.assertNotIn(summary.kind, words)
            self.assertFalse([word for word in words if word.startswith("kind=")])
            self.assertEqual(json.loads(format_json(summary))["kind"], summary.kind)

    def test_a_lead_is_written_as_it_is(self) -> None:
        """Braces, quotes and backslashes in a lead are text, not code."""
        odd = Field("novel", INT.optional(), text=(Text(900, ' {"c\\a}\n='),))
        line = text_formatter((*FIELDS, odd))(
            Wider(**attrs.asdict(summaries()[3], recurse=False), novel=3))
        self.assertTrue(line.endswith(' {"c\\a}\n=3'), line)

    def test_an_unknown_kind_is_written_as_an_other_line(self) -> None:
        other = summaries()[3]
        odd = attrs.evolve(other, kind="surprise")
        self.assertEqual(format_text(odd), format_text(other))
        self.assertEqual(json.loads(format_json(odd)),
                         {**json.loads(format_json(other)), "kind": "surprise"})

    def test_each_kind_has_its_branch(self) -> None:
        """Each kind's line is its own (none falls through to another's)."""
        lines = {summary.kind: format_text(summary) for summary in summaries()}
        self.assertEqual(set(lines), set(KINDS))
        self.assertIn(" ctok=3/9 ", lines["completion"])
        self.assertIn(" ERR_BODY | no", lines["error"])
        self.assertIn(" n=2 ptok=5 ", lines["embedding"])
        self.assertEqual(lines["other"], "01-01 00:00:00 orid=o b:1 POST /v1/models "
                                         "status=200 dur=1.000 end=timeout tries=2 resumed=1 "
                                         "resumed_on=c:2 unresumed=n trunc=True "
                                         "class=batch tenant=search")


class UnchangedTests(UTCTestCase):
    def test_both_formats_are_what_the_hand_written_formatters_wrote(self) -> None:
        """
        3,000 seeded summaries reaching every branch of both formats (bench/formats.py's
        ``variety``), written in UTC: the digest of their lines is the one the formatters
        had before the table made them.  A deliberate change to a format changes it too.
        """
        digest = hashlib.sha256()
        for summary in variety(3000):
            line = format_text(summary) + "\n" + format_json(summary) + "\n"
            digest.update(line.encode("utf-8", "backslashreplace"))
        self.assertEqual(digest.hexdigest(),
                         "4cbc8e935ab22bffef329475f2bafb4c06bacb8fd2e0808bb15c4d48b7fcb02d")


class WireFormTests(SynchronousTestCase):
    """A summary on the --workers wire: keyed by the table's names, and checked on arrival."""

    def message(self, summary: Summary | None = None) -> dict[str, Any]:
        (fields,) = [json.loads(summary_message(summary or summaries()[0], True))[2]]
        assert isinstance(fields, dict)
        return fields

    def test_every_kind_travels_whole(self) -> None:
        for summary in [*summaries(), *variety(200)]:
            kind, answered, fields = json.loads(summary_message(summary, False))
            self.assertEqual((kind, answered), ("end", False))
            self.assertEqual(summary_from(fields), summary)
            self.assertEqual(decode(summary_message(summary, False)), Finished(summary, False))

    def test_the_message_is_keyed_by_the_fields_names(self) -> None:
        fields = self.message()
        self.assertEqual(list(fields), [field.name for field in FIELDS])
        self.assertEqual((fields["end"], fields["ctok"], fields["trunc"]),
                         ("timeout", 3, True))

    def test_a_number_sent_without_its_point_is_still_a_float(self) -> None:
        fields = {**self.message(), "time": 2, "dur": 0}
        summary = summary_from(fields)
        self.assertEqual((summary.time, summary.dur), (2.0, 0.0))
        self.assertIs(type(summary.dur), float)

    def assertRefused(self, message: object, *words: str) -> None:
        with self.assertRaises(BadSummary) as caught:
            summary_from(message)
        self.assertIsInstance(caught.exception, ValueError)
        for word in words:
            self.assertIn(word, str(caught.exception))

    def test_not_an_object_is_refused(self) -> None:
        """The old positional form, or anything else that is not a JSON object."""
        self.assertRefused(list(self.message().values()), "JSON object", "a list")
        self.assertRefused(None, "JSON object", "null")
        self.assertRefused("end", "JSON object", "a string")

    def test_a_missing_or_unknown_field_is_refused(self) -> None:
        fields = self.message()
        del fields["dur"]
        self.assertRefused(fields, "missing ['dur']", "unknown none")
        self.assertRefused({**self.message(), "novel": 1}, "missing none",
                           "unknown ['novel']")
        self.assertRefused({}, "missing ['backend', 'cached', 'class', 'clen',")

    def test_a_field_of_the_wrong_type_is_refused(self) -> None:
        for name, value, words in [
            ("orid", 3, ("'orid'", "a string", "an integer")),
            ("status", "200", ("'status'", "an integer", "a string")),
            ("status", True, ("'status'", "a boolean")),
            ("status", 200.0, ("'status'", "a number")),
            ("status", None, ("'status'", "null")),
            ("dur", "1", ("'dur'", "a number")),
            ("ttft", [], ("'ttft'", "a number or null", "a list")),
            ("trunc", 1, ("'trunc'", "true or false")),
            ("req_keys", ["a", 1], ("'req_keys'", "a list of strings or null")),
            ("req_keys", {"a": 1}, ("'req_keys'", "an object")),
            ("kind", "surprise", ("'kind'", "one of completion, embedding, error, other")),
            ("kind", [], ("'kind'", "a list")),  # unhashable: refused, not a TypeError
            ("ctok", 1.5, ("'ctok'", "an integer or null")),
        ]:
            self.assertRefused({**self.message(), name: value}, *words)

    def test_an_optional_field_takes_null_or_its_type_only(self) -> None:
        for value in (None, 3):
            self.assertEqual(summary_from({**self.message(), "ctok": value}).completion_tokens,
                             value)
        self.assertRefused({**self.message(), "ctok": "3"}, "an integer or null, not a string")
        self.assertRefused({**self.message(), "clen": None}, "'clen' must be an integer, not null")
        self.assertRefused({**self.message(), "dur": False}, "'dur' must be a number")
        self.assertIsNone(summary_from({**self.message(), "req_keys": None}).req_keys)

    def test_what_may_be_null_may_be(self) -> None:
        nulls = [field.name for field in FIELDS if type(None) in field.wire.classes]
        self.assertEqual(nulls, ["backend", "ttft", "finish", "ctok", "max_tokens", "n",
                                 "ptok", "cached", "req_keys", "resumed_on", "unresumed", "class",
                                 "tenant"])
        summary = summary_from({**self.message(), **dict.fromkeys(nulls)})
        self.assertIsNone(summary.completion_tokens)


#: for every field, values of a class its wire type refuses (or that its check refuses)
_WRONG: dict[str, list[object]] = {
    field.name: [value for value in (True, 3, 2.5, "x", None, [1], {"a": 1})
                 if value.__class__ not in field.wire.classes]
    + ([["a", 1]] if field.name == "req_keys" else [])
    + (["surprise"] if field.name == "kind" else [])
    for field in FIELDS
}


def walked(message: dict[str, Any]) -> Summary | None:
    """What reading ``message`` by walking the table, field by field, gives."""
    values = {}
    for field in FIELDS:
        wire, value = field.wire, message[field.name]
        if value.__class__ not in wire.classes or (wire.check and not wire.check(value)):
            return None
        values[field.attribute] = value if wire.convert is None else wire.convert(value)
    return Summary(**values)


class WireCodeTests(SynchronousTestCase):
    """
    The wire's two functions are written out from the table (as the formatters are): they
    must give what walking the table gives, for every field and every wrong type.
    """

    def test_the_writer_writes_every_field_by_name_in_row_order(self) -> None:
        for summary in [*summaries(), *variety(200)]:
            self.assertEqual(list(to_wire(summary).items()),
                             [(field.name, getattr(summary, field.attribute))
                              for field in FIELDS])

    def test_the_reader_reads_what_the_writer_wrote(self) -> None:
        for summary in [*summaries(), *variety(200)]:
            message = json.loads(json.dumps(to_wire(summary)))
            self.assertEqual(wire_reader()(message), walked(message))
            self.assertEqual(wire_reader()(message), summary)

    def test_the_reader_refuses_each_field_of_a_wrong_type(self) -> None:
        message = to_wire(summaries()[0])
        read = wire_reader()
        for name, values in _WRONG.items():
            self.assertTrue(values, name)
            for value in values:
                wrong = {**message, name: value}
                self.assertIsNone(walked(wrong), (name, value))
                self.assertIsNone(read(wrong), (name, value))
                with self.assertRaises(BadSummary) as caught:
                    from_wire(wrong)
                self.assertIn(repr(name), str(caught.exception))

    def test_the_reader_converts_as_the_type_says(self) -> None:
        message = {**to_wire(summaries()[0]), "time": 2, "dur": 0, "ttft": 1}
        summary = wire_reader()(message)
        self.assertEqual((summary.time, summary.dur, summary.ttft), (2.0, 0.0, 1.0))
        self.assertEqual({type(summary.time), type(summary.dur), type(summary.ttft)}, {float})

    def test_a_table_of_its_own(self) -> None:
        """Both are made from the table given: a field it lacks is neither written nor read."""
        table = tuple(field for field in FIELDS if field.name != "orid")
        written = wire_writer(table)(summaries()[0])
        self.assertNotIn("orid", written)
        self.assertEqual(len(written), len(FIELDS) - 1)
        self.assertNotIn("'orid'", wire_reader(table).__source__)  # type: ignore[attr-defined]
        self.assertIn("'trunc'", wire_reader(table).__source__)  # type: ignore[attr-defined]


DOCS = Path(__file__).resolve().parents[2] / "docs" / "result-log.md"
_KIND_WORDS = {"completion": COMPLETION, "embedding": EMBEDDING, "error": ERROR,
               "other": OTHER}


def documented_fields() -> dict[str, tuple[str, str]]:
    """docs/result-log.md's "Every field" table: each name's text and JSON cells."""
    section = DOCS.read_text(encoding="utf-8").split("\n## Every field\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            name, text, on, _ = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[name.strip("`")] = (text, on)
    return rows


def _kinds_named(cell: str) -> frozenset[str]:
    """The kinds of line a cell names, outside code (``/v1/completions`` names none)."""
    prose = re.sub(r"`[^`]*`", "", cell)
    return frozenset(kind for word, kind in _KIND_WORDS.items()
                     if re.search(rf"\b{word}\b", prose))


class DocsTests(SynchronousTestCase):
    """docs/result-log.md lists every field of the table, as the table writes it."""

    def test_the_docs_list_every_field_and_no_other(self) -> None:
        self.assertEqual(list(documented_fields()), [field.name for field in FIELDS])

    def test_the_docs_say_how_the_text_line_writes_each_field(self) -> None:
        docs = documented_fields()
        for field in FIELDS:
            text, _ = docs[field.name]
            if not field.text:
                self.assertIn("not written", text, field.name)
            for piece in field.text:
                lead = piece.lead.strip()
                if lead.endswith("="):
                    self.assertIn(f"`{lead}", text, field.name)
                elif lead.endswith("|"):
                    self.assertIn(f"after `{lead.replace('|', chr(92) + '|')}`", text,
                                  field.name)
                elif lead == "/":
                    self.assertIn("`/`", text, field.name)
                elif piece.at == 0:
                    self.assertIn("first", text, field.name)
                else:
                    self.assertIn("bare", text, field.name)
                if piece.omit is not None:
                    self.assertTrue(re.search(r"\b(unless|only when|except)\b", text),
                                    field.name)
                if piece.kinds is not None and piece.kinds != field.kinds:
                    self.assertLessEqual(piece.kinds, _kinds_named(text), field.name)

    def test_the_docs_say_which_lines_have_each_field_in_json(self) -> None:
        docs = documented_fields()
        for field in FIELDS:
            _, on = docs[field.name]
            if field.kinds == ALL:
                self.assertTrue(on.startswith("every line"), field.name)
            else:
                self.assertEqual(_kinds_named(on), field.kinds, field.name)
            self.assertEqual("only when" in on, field.json_omit is not None, field.name)


class FormatsAgreeTests(UTCTestCase):
    """The lines have the table's fields: in JSON each by name, in text each by its lead."""

    def test_a_json_line_has_its_kinds_fields(self) -> None:
        for summary in summaries():  # every optional field shown
            self.assertEqual(list(json.loads(format_json(summary))),
                             [field.name for field in FIELDS if summary.kind in field.kinds])

    def test_a_text_line_has_its_kinds_pieces_in_place(self) -> None:
        for summary in summaries():
            line = format_text(summary)
            position = 0
            pieces = sorted((piece.at, piece.lead) for field in FIELDS for piece in field.text
                            if summary.kind in (piece.kinds or field.kinds))
            for _, lead in pieces:
                if lead.strip():
                    found = line.find(lead, position)
                    self.assertGreaterEqual(found, position, (summary.kind, lead, line))
                    position = found + len(lead)
