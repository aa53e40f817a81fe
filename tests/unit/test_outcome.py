"""RequestOutcome: the numbers every consumer that learns from a request reads."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from txlb._records.summary import Summary
from txlb._scheduling.outcome import RequestOutcome


def summary(**fields: object) -> Summary:
    base: dict[str, object] = dict(time=0.0, orid="r1", backend="127.0.0.1:8001",
                                   method="POST", path="/v1/chat/completions", status=200,
                                   kind="completion", outcome="ok", dur=2.0, stream=True)
    base.update(fields)
    return Summary(**base)  # type: ignore[arg-type]


class OutcomeTests(SynchronousTestCase):
    def test_decode_speed_is_the_time_after_the_first_token_per_later_token(self) -> None:
        outcome = RequestOutcome.of(summary(ttft=0.5, completion_tokens=11), True, "10.0.0.1")
        self.assertEqual((outcome.backend, outcome.status, outcome.ttfb, outcome.duration,
                          outcome.client), ("127.0.0.1:8001", 200, 0.5, 2.0, "10.0.0.1"))
        self.assertAlmostEqual(outcome.time_per_output_token or 0, 0.15)

    def test_no_decode_speed_from_one_token_or_without_an_answer(self) -> None:
        self.assertIsNone(RequestOutcome.of(summary(ttft=0.5, completion_tokens=1), True)
                          .time_per_output_token)
        self.assertIsNone(RequestOutcome.of(summary(ttft=0.5, completion_tokens=9), False)
                          .time_per_output_token)
        self.assertIsNone(RequestOutcome.of(summary(completion_tokens=9), True)
                          .time_per_output_token)

    def test_no_decode_speed_from_an_answer_that_was_not_streamed(self) -> None:
        """A plain JSON answer's first byte comes with its last: no first-token time."""
        self.assertIsNone(RequestOutcome.of(summary(ttft=1.99, completion_tokens=11,
                                                    stream=False), True)
                          .time_per_output_token)

    def test_prompt_tokens_are_carried(self) -> None:
        outcome = RequestOutcome.of(summary(kind="embedding", prompt_tokens=7), True)
        self.assertEqual((outcome.prompt_tokens, outcome.cached_prompt_tokens), (7, None))
