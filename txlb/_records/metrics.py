"""
Prometheus metrics, on a registry of the balancer's own.

Two kinds of metric, two sources:

* **State** (in flight, healthy, draining, ejections, probe results) is read from the
  :class:`~txlb._cluster.pool.Pool` at scrape time by :class:`PoolCollector`, so it is exact by
  construction and follows backends as they are added and removed.
* **Events** (requests by status class, duration and time-to-first-byte histograms, tokens
  generated) are observed once per finished request, from the same summary the result log
  writes.

A registry per balancer (not prometheus_client's global one) lets several balancers live in
one process, and tests scrape exactly what one balancer did.  Its scrape leaves out the
``*_created`` series prometheus_client adds to every counter and histogram (a timestamp per
series that Prometheus stores as one more time series and nobody queries); only this
registry's, since prometheus_client's own switch for it is process-wide and an embedding
application may want them in its own metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import metadata
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from txlb._cluster.pool import Pool
from txlb._records.summary import Summary
from txlb._records.tenant_metrics import TenantCounts
from txlb._scheduling.outcome import time_per_output_token

#: 10 ms to 5 min: from a cached short completion to a long reasoning generation.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
                   120.0, 300.0)
#: Bound on the label-child caches (a client varying methods must not grow them forever).
_MAX_CACHED_SERIES = 10_000
#: 5 ms to 1 s per generated token: a small model's decode on a fast GPU, to a large one's
#: under a full decode batch (or on CPU).
TOKEN_TIME_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                      0.2, 0.3, 0.5, 0.75, 1.0)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def _version() -> str:
    try:
        return metadata.version("txlb")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class PoolCollector:
    """Per-backend state, read from the pool at each scrape."""

    def __init__(self, pool: Pool, queue_length: Callable[[], int] | None = None) -> None:
        self._pool = pool
        self.queue_length = queue_length
        #: the queue per priority class (one process's; ``None`` where it is not known, in
        #: a ``--workers`` supervisor, whose workers hold the queues)
        self.queue_classes: Callable[[], Mapping[str, int]] | None = None
        self._version = _version()

    def count_queue(self, length: Callable[[], int] | None,
                    classes: Callable[[], Mapping[str, int]] | None) -> None:
        """Where ``txlb_queue_length`` (in all, and per class when known) is read from."""
        self.queue_length = length
        self.queue_classes = classes

    def describe(self) -> list[Metric]:
        return []  # dynamic label sets: nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        self._pool.refresh()  # with --workers: the counts of every worker
        backends = list(self._pool)
        gauges = {
            "in_flight": GaugeMetricFamily(
                "txlb_backend_in_flight", "Requests in flight on the backend now.",
                labels=["backend"]),
            "healthy": GaugeMetricFamily(
                "txlb_backend_healthy", "1 if the backend is healthy, else 0.",
                labels=["backend"]),
            "draining": GaugeMetricFamily(
                "txlb_backend_draining", "1 if the backend is draining, else 0.",
                labels=["backend"]),
            "max_conns": GaugeMetricFamily(
                "txlb_backend_max_conns", "The backend's in-flight cap (0 = none).",
                labels=["backend"]),
            "ejected": GaugeMetricFamily(
                "txlb_backend_outlier_ejected",
                "1 while outlier detection keeps the backend out (5xx in a row), else 0.",
                labels=["backend"]),
        }
        ejections = CounterMetricFamily(
            "txlb_backend_ejections", "Times the backend was marked down.", labels=["backend"])
        hung = CounterMetricFamily(
            "txlb_backend_hung_ejections",
            "Times the backend was marked down as hung: no byte from any of its requests "
            "in flight and no answer from its health path.", labels=["backend"])
        outlier_ejections = CounterMetricFamily(
            "txlb_backend_outlier_ejections",
            "Times outlier detection ejected the backend.", labels=["backend"])
        probes = CounterMetricFamily(
            "txlb_health_probes", "Health probes by result.", labels=["backend", "result"])
        for backend in backends:
            key = [backend.key]
            gauges["in_flight"].add_metric(key, backend.counts.active)
            gauges["healthy"].add_metric(key, 1 if backend.health.healthy else 0)
            gauges["draining"].add_metric(key, 1 if backend.health.draining else 0)
            gauges["max_conns"].add_metric(key, backend.spec.max_conns)
            gauges["ejected"].add_metric(key, 0 if backend.health.ejected_until is None else 1)
            ejections.add_metric(key, backend.health.ejections)
            hung.add_metric(key, backend.verdicts.hung_ejections)
            outlier_ejections.add_metric(key, backend.verdicts.outlier_ejections)
            probes.add_metric([backend.key, "ok"], backend.health.probes_ok)
            probes.add_metric([backend.key, "failed"], backend.health.probes_failed)
        yield from gauges.values()
        yield ejections
        yield hung
        yield outlier_ejections
        yield probes
        yield GaugeMetricFamily("txlb_backends_healthy", "Healthy backends.",
                                value=sum(1 for b in backends if b.health.healthy))
        # a gauge: no _total suffix, which Prometheus reserves for counters
        yield GaugeMetricFamily("txlb_backends", "Configured backends.", value=len(backends))
        if self.queue_length is not None:
            yield GaugeMetricFamily(
                "txlb_queue_length",
                "Requests waiting now for a backend slot (every eligible one at max_conns).",
                value=self.queue_length())
        if self.queue_classes is not None:
            per_class = GaugeMetricFamily(
                "txlb_queue_class_length",
                "Requests waiting now for a backend slot, per priority class.",
                labels=["class"])
            for name, length in self.queue_classes().items():
                per_class.add_metric([name], length)
            yield per_class
        build = GaugeMetricFamily("txlb_build_info", "The running txlb (always 1).",
                                  labels=["version"])
        build.add_metric([self._version], 1)
        yield build


class _WithoutCreated(Collector):
    """A registry's metrics without their ``*_created`` samples (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():  # fresh Metric objects on every call
            created = metric.name + "_created"
            metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


class BudgetCounts(Protocol):
    """What the budget metrics read (:class:`txlb._scheduling.budgets.TokenBudgets`)."""

    refused: dict[str, int]
    charged: dict[str, int]


class BudgetCollector(Collector):
    """
    The token budgets' counters, by budget name: read from the budgets at scrape time, so
    admission and reconciliation count with a dict increment and no metrics lock.
    """

    def __init__(self, budgets: BudgetCounts) -> None:
        self._budgets = budgets

    def collect(self) -> Iterable[Metric]:
        refused = CounterMetricFamily(
            "txlb_budget_refused", "Requests refused with 429 by a token budget, by budget.",
            labels=["budget"])
        charged = CounterMetricFamily(
            "txlb_budget_tokens",
            "Tokens charged to token budgets (usage, or the estimate when an answer had "
            "none), by budget.", labels=["budget"])
        for name, count in sorted(self._budgets.refused.items()):
            refused.add_metric([name], count)
        for name, count in sorted(self._budgets.charged.items()):
            charged.add_metric([name], count)
        return [refused, charged]


class Metrics:
    """The balancer's Prometheus registry and the per-request observations."""

    def __init__(self, pool: Pool) -> None:
        self._requests: dict[tuple[str, str, int], Any] = {}
        self._children: dict[tuple[int, str], Any] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self.state = PoolCollector(pool)
        self.registry.register(self.state)
        #: requests and tokens by tenant, and the 401s (``--auth keys``)
        self.tenants = TenantCounts()
        self.registry.register(self.tenants)
        #: where txlb_queue_length is read from: the router's queue, or under --workers
        #: every worker's (:meth:`PoolCollector.count_queue`)
        self.count_queue = self.state.count_queue
        self._scraped = _WithoutCreated(self.registry)
        self.requests = Counter(
            "txlb_requests", "Finished requests by backend, method and status class.",
            ["backend", "method", "status_class"], registry=self.registry)
        self.duration = Histogram(
            "txlb_request_duration_seconds", "Time from request arrival to its end.",
            ["backend"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttfb = Histogram(
            "txlb_time_to_first_byte_seconds",
            "Time from request arrival to the first byte of the response body.",
            ["backend"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tokens = Counter(
            "txlb_completion_tokens", "Completion tokens generated (usage.completion_tokens).",
            ["backend"], registry=self.registry)
        self.prompt_tokens = Counter(
            "txlb_prompt_tokens",
            "Prompt tokens of the answers that said them (usage.prompt_tokens, the Responses "
            "and Messages APIs' input tokens, llama.cpp's timings).",
            ["backend"], registry=self.registry)
        self.cached_prompt_tokens = Counter(
            "txlb_cached_prompt_tokens",
            "Of the prompt tokens, those the engine served from its prefix cache "
            "(usage.prompt_tokens_details.cached_tokens, llama.cpp's timings.cache_n); "
            "the prefix cache hit rate is rate(txlb_cached_prompt_tokens_total) / "
            "rate(txlb_prompt_tokens_total).",
            ["backend"], registry=self.registry)
        self.time_per_output_token = Histogram(
            "txlb_time_per_output_token_seconds",
            "Seconds per generated token after the first (from the first byte to the end, "
            "over the completion tokens but one): the decode speed, or inter-token latency.",
            ["backend"], buckets=TOKEN_TIME_BUCKETS, registry=self.registry)
        self.client_aborts = Counter(
            "txlb_client_aborts", "Requests whose client disconnected before the end.",
            ["backend"], registry=self.registry)
        self.queue_wait = Histogram(
            "txlb_queue_wait_seconds",
            "Time requests waited for a backend slot (max_conns queueing).",
            buckets=QUEUE_BUCKETS, registry=self.registry)
        self.retries = Counter(
            "txlb_retries", "Requests retried on another backend.", registry=self.registry)
        self.resumes = Counter(
            "txlb_stream_resumes",
            "Streams whose engine failed part-way: continued on another engine (resumed), "
            "or cut, by why they could not be.", ["result"], registry=self.registry)
        self.resumes.labels("resumed")
        self.config_generation = Gauge(
            "txlb_config_generation",
            "The running configuration's generation: 1 at start, one more per applied "
            "reload.", registry=self.registry)
        self.config_generation.set(1)
        self.config_reloads = Counter(
            "txlb_config_reload",
            "Reloads of the configuration (SIGHUP, POST /reload), applied (ok) or refused.",
            ["result"], registry=self.registry)
        for result in ("ok", "refused"):
            self.config_reloads.labels(result)  # both series exist from the start

    def resume_status(self) -> dict[str, object]:
        """``/status``'s ``resumes``: streams continued elsewhere, and those cut, by reason."""
        cut: dict[str, int] = {}
        resumed = 0
        for metric in self.resumes.collect():
            for sample in metric.samples:
                if not sample.name.endswith("_total"):
                    continue
                result = sample.labels["result"]
                if result == "resumed":
                    resumed = int(sample.value)
                else:
                    cut[result] = int(sample.value)
        return {"resumed": resumed, "cut": cut}

    def reloaded(self, applied: bool, generation: int) -> None:
        """One reload of the configuration, applied (now ``generation``) or refused."""
        self.config_reloads.labels("ok" if applied else "refused").inc()
        self.config_generation.set(generation)

    def watch_budgets(self, budgets: BudgetCounts) -> None:
        """Export the token budgets' refusals and charged tokens, read at scrape time."""
        self.registry.register(BudgetCollector(budgets))

    def observe(self, summary: Summary, answered: bool = True) -> None:
        """
        Count one finished request.  ``answered``: a backend's answer reached txlb, so its
        timings say something about the backend's decode speed.
        """
        backend = summary.backend
        key = (backend, summary.method, summary.status // 100)
        requests = self._requests.get(key)
        if requests is None:
            # labels() takes a lock and builds a key on every call: each series is looked
            # up once and kept (the label sets are few: backends x methods x classes)
            if len(self._requests) >= _MAX_CACHED_SERIES:
                self._requests.clear()
            requests = self._requests[key] = self.requests.labels(
                backend, summary.method, f"{summary.status // 100}xx")
        requests.inc()
        self._child(self.duration, backend).observe(summary.dur)
        if summary.ttft is not None:
            self._child(self.ttfb, backend).observe(summary.ttft)
        if summary.completion_tokens:
            self._child(self.tokens, backend).inc(summary.completion_tokens)
        if summary.prompt_tokens:
            self._child(self.prompt_tokens, backend).inc(summary.prompt_tokens)
            # the series exists from the first prompt counted, so the hit rate (their
            # ratio) of an engine that caches nothing is 0, not missing
            cached = self._child(self.cached_prompt_tokens, backend)
            if summary.cached_prompt_tokens:
                cached.inc(summary.cached_prompt_tokens)
        per_token = time_per_output_token(summary, answered)
        if per_token is not None:
            self._child(self.time_per_output_token, backend).observe(per_token)
        if summary.outcome == "client_abort":
            self._child(self.client_aborts, backend).inc()
        if summary.resumes:
            self.resumes.labels("resumed").inc(summary.resumes)
        if summary.resume_refused is not None:
            self.resumes.labels(summary.resume_refused).inc()
        self.tenants.observe(summary)

    def _child(self, metric: Any, backend: str) -> Any:
        """``metric.labels(backend)``, looked up once per metric and backend."""
        key = (id(metric), backend)
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= _MAX_CACHED_SERIES:
                self._children.clear()
            child = self._children[key] = metric.labels(backend)
        return child

    def exposition(self) -> bytes:
        return generate_latest(self._scraped)

