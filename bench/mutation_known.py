"""
What the mutation tool knows beforehand: the bugs once let through, and the mutants no test
can kill.

``KNOWN_BUGS`` are replayed by ``python -m bench.mutation --known`` (CI runs it) to show
the suite now catches each; ``EQUIVALENT`` are the survivors that change no behaviour, each
with its reason, left out of the kill rate.  Both are records that grow one entry at a
time, apart from the machinery that uses them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KnownBug:
    """A bug once put into the code by hand that the suite at first let through."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...] = ("tests.unit.test_regressions",)


#: The nine deliberate bugs that passed the whole suite before ``tests/unit/test_regressions``.
#: ``--known`` applies each to a copy of the tree and checks the tests now fail.
KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug("lease released twice counts twice", "txlb/_cluster/slots.py",
             "        if not self._released:\n            self._released = True\n",
             "        if True:\n            self._released = True\n"),
    KnownBug("--max-body not enforced on lb.resource()", "txlb/_proxy/resource.py",
             "if self.max_body and len(record.request_body) > self.max_body:",
             "if False and len(record.request_body) > self.max_body:"),
    KnownBug("chunked body over --max-body refused only once whole", "txlb/_server/site.py",
             "        if limit and self._body_seen > limit:\n",
             "        if False:\n"),
    # (escaping moved to txlb/_log/escape.py: the escaped CR turned back into a raw one)
    KnownBug("carriage return raw in the result log", "txlb/_log/escape.py",
             "        text = _unprintable().sub(_unicode_escape, text)\n    return text\n",
             "        text = _unprintable().sub(_unicode_escape, text)\n"
             "    return text.replace('\\\\x0d', '\\r')\n"),
    # (the exchange's branch became a row of the failure table)
    KnownBug("connect timeout retried", "txlb/_proxy/failures.py",
             'Rule(Kind.CONNECT_TIMEOUT, 504, "timeout", retried=False,',
             'Rule(Kind.CONNECT_TIMEOUT, 504, "timeout", retried=True,'),
    KnownBug("retried answer read to the end (Agent)", "txlb/_upstream/agent.py",
             "        self.transport.stopProducing()  # type: ignore[attr-defined]\n",
             "        pass\n"),
    KnownBug("retried answer read to the end (own client)", "txlb/_upstream/connection.py",
             '        """Abort: the body of a 502/503 that is retried elsewhere is not worth '
             'reading."""\n        self.abort()\n',
             '        """Read it to the end."""\n'
             "        self._owner = None\n"),
    KnownBug("connection reused after bytes beyond the body", "txlb/_upstream/connection.py",
             "            self._keep_alive = False  # bytes beyond the body: never reuse "
             "this connection\n",
             "            pass\n"),
    KnownBug("probe 404 counted healthy", "txlb/_cluster/health.py",
             "        if code != 200:\n", "        if code >= 500:\n"),
    KnownBug("500 retried like 502/503", "txlb/_proxy/failures.py",
             "RETRIED_STATUSES = frozenset({502, 503})",
             "RETRIED_STATUSES = frozenset({500, 502, 503})"),
)


#: Mutants no test can kill because no behaviour can differ, each with the reason: the
#: module, cosmic-ray's operator, and text found in the mutated line (line numbers move).  They are
#: reported as ``equivalent`` and left out of the kill rate; bench/results/mutation.md
#: lists them.
EQUIVALENT: tuple[tuple[str, str, str, str], ...] = (
    ("_proxy/exchange", "ReplaceComparisonOperator_Eq_NotEq", 'elif self.state != "relaying":',
     "pauseProducing's elif: while relaying the read watchdog is always armed (it is "
     "cleared only inside _read_timed_out, which re-arms or ends), and the exchange is the "
     "client's producer only while relaying, so neither form of the branch ever runs"),
    ("_proxy/exchange", "ReplaceComparisonOperator_Gt_GtE", "if watchdog.getTime() >= now + limit:",
     "at equality, reset(limit) moves the watchdog to the time it already has"),
    ("_proxy/exchange", "ReplaceAndWithOr", "if watchdog is not None or watchdog.active():",
     "pauseProducing runs only while the exchange is the client's producer, i.e. relaying, "
     "and then the read watchdog is set and pending (see the elif's entry): both forms "
     "take the first branch"),
    ("_proxy/exchange", "ReplaceAndWithOr",
     "if self._watchdog is not None or self._watchdog.active():",
     "_retry runs in waiting, after _send armed the watchdog; it is only ever cleared to "
     "None when it fires or is cancelled (and _read_timed_out then re-arms or ends), so "
     "here it is set and pending: both forms cancel it"),
    ("_proxy/exchange", "ReplaceTrueWithFalse", "self.client_gone = False",
     "client_gone is read by _can_retry and _fail only, which run only while the state is "
     "not ended (_got_response's and _request_failed's Deferred is cancelled by _end; "
     "_retry_refused and _give_up return once ended); _client_lost sets it right before "
     "its _end, so no read ever follows the write"),
    ("_proxy/exchange", "ReplaceAndWithOr",
     "if channel is not None or channel.transport is not None:",
     "a request's channel is None only after Request.connectionLost, which fires the "
     "exchange's notifyFinish errback at once (_client_lost ends it: no _cut_client after "
     "that), and an HTTPChannel's transport is never set back to None: both forms abort"),
    ("_proxy/exchange", "NumberReplacer", "if status < 499:",
     "a 499 from the backend then also asks provoked_by_request and the client key (both "
     "pure), but Verdicts.answered resets the streak for any status under 500 whatever the "
     "client, and judge_answer returns None for it: the same outcome"),
    ("_proxy/resource", "ReplaceAndWithOr", "if budgets is not None or budgets.specs:",
     "the balancer always passes its TokenBudgets; with no [[budgets]] its admit returns "
     "ADMITTED at once, whose headers and reservation are the record's defaults"),
    ("_proxy/resource", "NumberReplacer", "context: ProxyContext, retry_after: float =",
     "ProxyResource's default: the balancer always passes max(1, ceil(--health-interval))"),
    ("_proxy/resource", "NumberReplacer", "self.retry_after = max( 0, math.ceil(retry_after))",
     "the balancer's retry_after is already at least 1 (max(1, ceil(--health-interval)))"),
    ("_proxy/resource", "NumberReplacer", 'self.affinity.split(":", 2)',
     "--affinity's header name is an HTTP token (parse_affinity), which has no colon: one "
     "split or two give the same name"),
    ("_upstream/connection", "NumberReplacer", "self._chunk_state == -1:",
     "with the one-chunk fast path off, the general walk hands on the same bytes: only "
     "speed differs"),
    ("_cluster/pool", "NumberReplacer", "outliers: OutlierRule | None = None, slow_start: float =",
     "Pool's default: the balancer always passes --slow-start"),
    ("_cluster/pool", "AddNot", "            if not backend.health.removing:",
     "in refresh and mirror the loop hands each backend to _forget_if_idle, which checks "
     "removing itself: the guard only saves the call (undrain's check, less indented, is "
     "not this one)"),
    ("_cluster/health", "ReplaceBinaryOperator_Mul_Div", "def retune(self, /,",
     "retune's one caller (the reload) passes every argument by keyword: with / the "
     "method also takes them by position, and takes every call it took before alike"),
    ("_cluster/outlier", "NumberReplacer", "base_cooldown: float =",
     "OutlierRule's default: the balancer always passes --outlier-cooldown's value"),
    ("_cluster/outlier", "NumberReplacer", "consecutive_5xx: int =",
     "OutlierRule's default: the balancer always passes --outlier-5xx's value"),
    ("_cluster/outlier", "NumberReplacer", "if status < 499 or client is None:",
     "a 499 from a client resets the streak (Verdicts.answered) to 0, under any threshold: "
     "the same None"),
    ("_scheduling/policies/least_conn", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/round_robin", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/weighted_random", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/p2c", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/peak_ewma", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/queue_depth", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/cache_aware", "NumberReplacer", "rank=",
     "the built-in ranks are 10 apart: one up or down keeps the --help order"),
    ("_scheduling/policies/cache_aware", "ReplaceTrueWithFalse", "@attrs.define(slots=False)",
     "_Prediction without __slots__: only its memory differs -- nothing sets an attribute "
     "it does not declare, pickles or copies it"),
    ("_scheduling/policies/cache_aware", "ReplaceTrueWithFalse",
     "zip(candidates, matches, strict=False)",
     "matches is built by a comprehension over candidates in choose: the two are always "
     "of one length, so strict never raises"),
    ("_scheduling/policies/cache_aware", "ReplaceAndWithOr",
     "if entry is not None or entry.request is ref:",
     "a prediction's weakref (and with it its callback) lives only as long as the "
     "prediction, which lives only in _pending (observe's and _predict's locals hold one "
     "while its request is alive): when the callback runs, the entry under the request's "
     "id is that prediction, so both forms delete it"),
    ("_scheduling/policies/cache_aware", "NumberReplacer", "chars = -1",
     "the prediction's chars is read only by BackendIndex.learned's `chars > 0`: -1 and 0 "
     "both skip the characters-per-token update"),
    ("_scheduling/policies/cache_aware", "NumberReplacer",
     "trust = index.trust if index is not None else",
     "a backend without an index matches nothing (FleetIndex.match returns 0): its worth "
     "is 0 x trust = 0 whatever the default trust"),
    ("_scheduling/prefix_index", "ReplaceComparisonOperator_Gt_GtE",
     "if predicted >= 0 and cached < predicted",
     "with nothing predicted the eviction test is cached < 0 - 1, false for any cached "
     "(clamped to 0 or more): both forms go on to the elif"),
    ("_scheduling/prefix_index", "NumberReplacer", "return max( -1, self.capacity - len(",
     "an index never lists more than its capacity (sent, learned and counted trim to it "
     "whenever either changes): capacity - len is never below 0, nor below -1"),
    ("_scheduling/prefix_index", "NumberReplacer", "if predicted > 1 and cached < predicted",
     "the eviction test's `predicted > 0` as > 1: with 1 predicted, cached < 1 - max(1, 0) "
     "is cached < 0, false for any cached (clamped to 0 or more)"),
    ("_scheduling/prefix_index", "NumberReplacer", "if predicted > -1 and cached < predicted",
     "the eviction test's `predicted > 0` as > -1: with 0 predicted, cached < 0 - max(1, 0) "
     "is cached < -1, false for any cached (clamped to 0 or more)"),
    ("_scheduling/prefix_index", "NumberReplacer", "gone = largest.trim(max( -1,",
     "len(largest) - excess is never below 0: before a sent the exact count is at most "
     "_total, at most the cap, so the excess is at most what the index just sent to grew "
     "by -- at most its length, at most the largest's; max(-1, x) is max(0, x)"),
    ("_scheduling/prefix_index", "ReplaceComparisonOperator_LtE_Lt",
     "if self._total < self.max_entries:",
     "at exactly the cap the mutant recounts (exact: nothing is over) and trims nothing, "
     "so the indexes are the same; only a recount's cost differs"),
    ("_scheduling/prefix_index", "ReplaceBinaryOperator_Sub_Add", "return len(entries) + before",
     "sent's return only feeds FleetIndex._total, which decides when to recount; an "
     "overcount (the mutant only adds) triggers a recount that sets it exact and trims "
     "only what is really over the cap, so what the indexes hold is the same"),
    ("_scheduling/prefix", "ReplaceComparisonOperator_Lt_LtE", "if self.steps <= 0:",
     "_feed's check (text()'s, the same line, is killed by test_cache_aware_prefix): _feed "
     "appends no piece, and a _feed that takes the last look is always followed by "
     "its media's text(), which the spent budget refuses: the rendered text is the same"),
    ("_scheduling/prefix", "ReplaceComparisonOperator_GtE_Gt", "if size > room:",
     "a piece that exactly fills the budget: the mutant goes on, but with no room left the "
     "next non-empty piece appends piece[:0] and stops it -- the same text (only looks at "
     "empty pieces differ)"),
    ("_scheduling/prefix", "NumberReplacer", "if self.steps < 1:",
     "_feed's check (text()'s is killed by tests) as <= 0: see the Lt_LtE entry"),
    ("_scheduling/prefix", "NumberReplacer", "if self.steps < -1:",
     "_feed's check (text()'s is killed by tests) letting one more look through: _feed "
     "appends no piece and its media's text() that follows refuses the spent budget, so "
     "the rendered text is the same"),
    ("_scheduling/prefix_index", "NumberReplacer", "self._total = 1",
     "forget_blocks' count one too high: an overcount only brings the next recount "
     "forward, which sets it exact and trims only what is really over the cap"),
    ("_scheduling/policies/registry", "NumberReplacer", 'rpartition(".")[ 1]',
     "built_in() then also imports the registry module itself, which defines no factory: "
     "the same policies are found"),
    ("_scheduling/policies/_ties", "NumberReplacer", "if len(tied) == 0:",
     "a single tied backend through the weighted walk: its current weight rises by w and "
     "falls by the total, w; it is chosen, and nothing else changes"),
    ("_scheduling/policies/p2c", "NumberReplacer", "return candidates[ -1]",
     "reached only when there is one candidate"),
    ("_records/record", "ReplaceFalseWithTrue",
     "tail: deque[bytes] = attrs.field(factory=deque, repr=True)",
     "only a RequestRecord's repr shows its tail, and nothing txlb writes uses that repr"),
    ("_records/record", "ReplaceFalseWithTrue", "count_events: bool = True",
     "events are read only by a token budget's charge, for a request it reserved for, whose "
     "count_events the proxy sets to True: counting every other request's events costs "
     "time only"),
    ("_records/summary", "ReplaceFalseWithTrue", "think: bool =",
     "think is shown only for completions, for which summarize passes it"),
    ("_scheduling/router", "ReplaceFalseWithTrue", "@attrs.define(eq=True)",
     "_Waiter compared by fields instead of identity: its fields include its own Deferred "
     "and timer, compared by identity, so two waiters are equal only if they are one"),
    ("_proxy/failures", "ReplaceOrWithAnd", "if not body and body.lstrip()[:1]",
     "the check is a shortcut: json.loads refuses every body it would have refused (an empty "
     "one, one not starting with '{'), or parses it to a value that is not a dict"),
    ("_server/site", "NumberReplacer",
     "_CONTROLS = bytes([*range(0x01, 0x09), *range(0x0B, 0x0D), *range( 13, 0x20), 0x7F])",
     "adds CR (0x0D) to the control characters: headerReceived refuses a NUL, CR or LF in a "
     "value first, with the same 400, so the control-character check never sees a CR"),
    ("_server/rules", "NumberReplacer", "VISIBLE_ASCII = bytes(range( 32, 0x7F))",
     "a request target never holds a space (0x20): SP is the request line's delimiter, and "
     "twisted.web's _parseRequestLine refuses a line with more than two (400) before the "
     "target is checked"),
    ("_server/site", "ReplaceUnaryOperator_USub_Not", "request = self.requests[not 1]",
     "refuse runs only while a head or body is parsed, and then channel.requests holds one "
     "request: twisted.web buffers a pipelined request's bytes until requestDone has removed "
     "the one before, so [0] is [-1]"),
    ("_server/site", "NumberReplacer", "request = self.requests[- 0]",
     "refuse runs only while a head or body is parsed, and then channel.requests holds one "
     "request: twisted.web buffers a pipelined request's bytes until requestDone has removed "
     "the one before, so [0] is [-1]"),
    ("_proxy/head", "NumberReplacer", "if uri[: 9].lower().startswith",
     "the longest scheme looked for, 'https://', is 8 bytes: a 9-byte prefix starts with "
     "it exactly when the 8-byte one does"),
    ("_proxy/resource", "NumberReplacer", "max_body: int =",
     "ProxyResource's default: the balancer always passes --max-body"),
    ("_upstream/heads", "ReplaceFalseWithTrue", 'return "close", None, True',
     "a close-delimited body ends with the connection (connectionLost), never in "
     "_complete, the only reader of keep_alive"),
    ("_upstream/heads", "ReplaceOrWithAnd", "isdigit() and code_bytes[0] == 48",
     "a status code with a leading 0 is below 100, which _framing refuses with the same "
     "BadResponse (only the message differs)"),
    ("_upstream/heads", "ReplaceComparisonOperator_Lt_LtE", "if len(_TITLE_CASE) <= 4096:",
     "_TITLE_CASE only memoizes _title: its bound changes how many header names are kept, "
     "never the casing written"),
    ("_upstream/heads", "ReplaceComparisonOperator_Lt_Gt", "if len(_TITLE_CASE) > 4096:",
     "_TITLE_CASE only memoizes _title: never memoizing recomputes the same casing"),
    ("_upstream/heads", "AddNot", "if not len(_TITLE_CASE) < 4096:",
     "_TITLE_CASE only memoizes _title: never memoizing recomputes the same casing"),
    ("_upstream/heads", "NumberReplacer", "if len(_TITLE_CASE) < 409",
     "_TITLE_CASE only memoizes _title: its bound changes how many header names are kept, "
     "never the casing written"),
    ("_upstream/connection", "ReplaceFalseWithTrue", "            self._paused = True",
     "resumeProducing leaving _paused set only makes a later resume call the transport's "
     "resumeProducing again while it is reading: nothing else pauses a backend socket, and "
     "resuming a reading (or aborted) transport changes nothing"),
    ("_upstream/client", "ReplaceAndWithOr", 'if (connection.state == "idle" or transport',
     "every pooled connection is idle with a connected transport (release pools it just "
     "after idle(); _expire, forget, close_idle and release's over-limit branch take it out "
     "of the pool before closing it): the check is true both ways"),
    ("_upstream/client", "ReplaceAndWithOr", "or not transport.disconnecting):",
     "every pooled connection is idle with a transport not disconnecting (release pools it "
     "just after idle(); every loseConnection of a pooled one comes after taking it out): "
     "the check is true both ways"),
    ("_upstream/client", "ReplaceAndWithOr", "if idle or connection in idle:",
     "forget is only called for a pooled connection (by _expire, whose timer take() "
     "cancels, and by connectionLost and dataReceived in the idle state, which only a "
     "pooled connection is in): its list is non-empty and holds it"),
    ("_upstream/connection", "ReplaceOrWithAnd", "if attempt is None and attempt.deferred.called:",
     "in the head state the attempt is set and not yet called: everything that fires it "
     "(the head, _bad_head, a cancel through _Attempt._cancel) first takes the connection "
     "out of that state"),
    ("_upstream/connection", "NumberReplacer", "self._remaining = 1",
     "the _remaining a response leaves is never read: _head sets it before the next body"),
    ("_upstream/connection", "NumberReplacer", "self._remaining = -1",
     "the _remaining a response leaves is never read: _head sets it before the next body"),
    ("_scheduling/policies/weighted_random", "NumberReplacer", "weights=weights)[ -1]",
     "random.choices draws one element (k=1): [0] and [-1] are the same"),
    ("_scheduling/policies/p2c", "NumberReplacer", "weights=weights)[ -1]",
     "random.choices draws one element (k=1): [0] and [-1] are the same"),
    ("_scheduling/policies/peak_ewma", "ReplaceComparisonOperator_Gt_GtE",
     "seconds >= previous.seconds:",
     "a sample equal to the estimate: replacing it or averaging it in both leave that value, "
     "stamped now"),
    ("_scheduling/policies/_ties", "NumberReplacer", "return tied[ -1]",
     "only reached when len(tied) == 1: [0] and [-1] are the same"),
    ("_records/capture", "NumberReplacer", '.split(b";", 2)[0]',
     "the chunk size is the part before the first ';' either way"),
    ("_records/capture", "NumberReplacer", "if end < 1:",
     "end is 0 only at position 0 with an empty size line, which int() refuses: the same "
     "break"),
    ("_records/capture", "ReplaceComparisonOperator_Lt_LtE", "while position <= size:",
     "at position == size find() returns -1: the same break"),
    ("_records/summary", "NumberReplacer", "tries: int =",
     "summarize always passes tries"),
    ("_records/capture", "ReplaceComparisonOperator_Lt_LtE", "if end <= 0:",
     "end is 0 only at position 0 with an empty size line, which int() refuses: the same "
     "break"),
    ("_records/capture", "NumberReplacer", "if length <= -1:",
     "after the zero-size chunk only trailer lines follow (and the capture never holds that "
     "chunk: the client's side writes it), and a 'name: value' line never parses as a size"),
    ("_records/capture", "NumberReplacer", "position = start + length + 1",
     "the byte skipped is the CR closing a chunk's data (the upstream client refuses any "
     "other framing, so the capture holds none): the next size line then starts with LF, "
     "which int() skips as whitespace"),
    ("_cluster/backend_engine", "ReplaceFalseWithTrue", "@attrs.define(eq=True)",
     "a backend's parts are never compared or hashed: each Backend holds its own for good, "
     "so value equality (and the unhashable class it makes) changes nothing that runs"),
    ("_cluster/backend_models", "ReplaceFalseWithTrue", "@attrs.define(eq=True)",
     "a backend's parts are never compared or hashed: each Backend holds its own for good, "
     "so value equality (and the unhashable class it makes) changes nothing that runs"),
    ("_records/summary", "ReplaceTrueWithFalse", "empty: bool = False",
     "empty is written only for completions, for which summarize passes it"),
    ("_records/summary", "ReplaceFalseWithTrue", "stream: bool = True",
     "stream is written only for completions, for which summarize passes it, and read by "
     "time_per_output_token only beside completion_tokens, None for every other kind"),
    ("_records/record", "ReplaceFalseWithTrue", "attrs.field(default=None, repr=True)",
     "only a RequestRecord's repr shows its routing request: nothing txlb writes uses that "
     "repr (and the request body it was made from is in it either way)"),
    ("_records/summary", "NumberReplacer", "MAX_LINE = ",
     "the bound the other limits are chosen to keep: no code reads it, the tests check "
     "lines against it"),
    ("_records/record", "NumberReplacer", "ended: float =",
     "RequestRecord's default: every record is ended (by the exchange's _end, or by the "
     "resource for what it answers itself) before it is summarized"),
    ("_records/summary", "NumberReplacer", "clen: int =",
     "clen is shown only for completions, for which summarize passes it"),
    ("_cluster/health", "ReplaceFalseWithTrue", "scrape_engine_queue: bool =",
     "HealthChecker's default: the balancer and a reload both pass "
     "scrape_engine_queue from the policy"),
    ("_cluster/health", "NumberReplacer", "started: float =",
     "_failed's default: its one caller, probe's errback, always passes the time the "
     "probe started"),
    ("_records/fields", "NumberReplacer", "if len(wire.classes) == 0:",
     "a one-class wire type then checked with `in` its one-tuple instead of `is` its class: "
     "the same answer, a little slower"),
    ("_records/fields", "NumberReplacer", "Text(",
     "a text piece's place (at) moved by one either meets its neighbour's on the same line "
     "(refused when the formatter is made, at import) or keeps the order it had"),
    ("_records/resultlog", "NumberReplacer", "self._next_check =",
     "__init__'s value is overwritten at once by _open"),
    ("_scheduling/router", "NumberReplacer", "retry_after: int =",
     "Router's default: the balancer always passes retry_after"),
    ("_scheduling/router", "NumberReplacer", "queue_timeout: float =",
     "Router's default: the balancer always passes --queue-timeout"),
    ("_scheduling/router", "ReplaceFalseWithTrue", "forward_unknown_models: bool = True",
     "Router's default: the balancer always passes --unknown-model's choice"),
    ("_scheduling/router", "NumberReplacer", "weights=weights)[ -1]",
     "random.choices draws one element (k=1): [0] and [-1] are the same"),
    ("_scheduling/router", "ReplaceBinaryOperator_Mul_Div", "def retune(self, /, policy",
     "retune's arguments keyword-only or not: its one caller (the balancer's reload) names "
     "every argument, and the mutant accepts every call the original does, alike"),
    ("_scheduling/router", "ReplaceFalseWithTrue", "queued: bool = True",
     "_Waiter's default: the one place a waiter is made (_wait) hands it to _enqueue at "
     "once, which sets queued to True before anything reads it"),
    ("_scheduling/router", "ReplaceTrueWithFalse", "zip(snapshots, skip, strict=False)",
     "skip is made as [0] * len(snapshots): the two always have one length"),
    ("_scheduling/router", "ReplaceAndWithOr", "if waiter.timer is not None or waiter.timer",
     "in _regroup every waiter is in a queue, and a queued waiter's timer is set and pending: "
     "_enqueue arms it, only _leave cancels it and _expire clears it, each taking the waiter "
     "out of its queue in the same step -- both forms cancel it"),
    ("_scheduling/router", "NumberReplacer", "current[ -1].cancel()",
     "current holds one Deferred at most (the one choice made after a refusal: answered "
     "runs once per confirmation): [0] and [-1] are the same"),
    ("_scheduling/router", "NumberReplacer", "(queue[ -1].klass, list(queue))",
     "every waiter in a class's queue holds that class: it joins the queue named by its "
     "klass, and a reload's _regroup (the classes' only listener) re-points all of them "
     "before anything else runs -- head and tail have the one starvation age"),
    ("_scheduling/router", "NumberReplacer", "skip[number] += 0",
     "a starving waiter walked again in the precedence pass was served (no longer queued), "
     "is being confirmed, was answered, or failed to take a slot (its (model, exclude) is "
     "in failed: passed over) -- the second look changes nothing"),
    ("_scheduling/router", "NumberReplacer", "oldest = -1.0",
     "there is always at least one class (the default class must exist), and each class's "
     "wait is 0.0 or more: the max is the same from -1.0 as from 0.0"),
    ("_cluster/health", "ReplaceOrWithAnd", "if running is None and waiting is None:",
     "with one gauge missing, running + waiting raises TypeError, which the same errback "
     "turns into the same fallback (engine_depth None); only the debug message differs"),
    ("_records/capture", "ReplaceComparisonOperator_LtE_Lt", "if length < 0:",
     "after the zero-size chunk only trailer lines follow, and a 'name: value' line never "
     "parses as a chunk size: the walk stops with the same payload"),
    ("_cluster/health", "ReplaceTrueWithFalse", "gatherResults(extras, consumeErrors=False)",
     "each extra ends in its own errback, so the gathered Deferreds never fail"),
    ("_cluster/health", "NumberReplacer", "rest.rsplit(None, 2)[-1]",
     "rsplit(None, 1)[-1] and rsplit(None, 2)[-1] are the same last token"),
    ("_cluster/health", "NumberReplacer", 'rest.split("}", 2)[1]',
     "the same token follows the first '}' either way unless a label value holds '}', "
     "and then neither parses as a number (the line is skipped)"),
    ("_cluster/slow_start", "NumberReplacer", "_length: float =",
     "SlowStart's default: every SlowStart txlb makes is made by the pool, which passes its "
     "--slow-start (and without a clock, as a default SlowStart has, there is no ramp)"),
    ("_cluster/slow_start", "ReplaceFalseWithTrue", "attrs.field(default=None, repr=True)",
     "only a SlowStart's repr shows its clock: nothing txlb writes uses that repr (logs, "
     "status and metrics name a backend by its key)"),
    ("_proxy/resource", "ReplaceComparisonOperator_GtE_Gt", "if request.code > 400:",
     "_answered_locally runs only for LocalAnswers' own answers, which are 200 or 405 "
     "(never 400), so >= 400 and > 400 mark the same answers proxy_error"),
    ("_records/record", "NumberReplacer", "while len(tail) > 0 and",
     "tail_size is always the sum of the tail's lengths, so with one chunk left "
     "tail_size - len(tail[0]) is 0, under TAIL_LIMIT: the loop stops there either way"),
)
