"""Server observability: Prometheus metrics (prefix `xlaserve_`).

Each server owns a `ServerMetrics` with its own registry, so several servers (tests) can
live in one process. Counters and histograms are updated as events happen (by the engine
thread and the HTTP front end; prometheus_client is thread-safe); gauges that describe
the scheduler's state are read at scrape time from the last published `SchedulerStats`,
and step counts and device bubbles from the engine's execution trace
(runtime/exec_trace.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runtime.compile_counter import compile_counter
from runtime.exec_trace import ExecutionTrace
from runtime.executable_budget import footprint
from runtime.scheduler import SchedulerStats
from runtime.spec_decode import SpecDecoding

PREFIX = "xlaserve_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """Every metric the server exports. `stats` is the scheduler snapshot the engine thread
    publishes after each iteration (None until the engine is up)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}requests", "Finished engine requests (one per choice) "
                                "by status: stop, length or abort", ["status"], registry=r)
        self.http_errors = Counter(f"{PREFIX}http_errors", "Error replies by HTTP status code",
                                   ["code"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of accepted "
                                     "requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generated tokens",
                                         registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between two tokens "
                             "of one request", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.stats: SchedulerStats | None = None
        self.trace: ExecutionTrace | None = None  # the engine's, once it is up
        # The engine's speculative decoding (--speculative_algorithm), if on.
        self.spec: SpecDecoding | None = None
        self.compiles_after_warmup = 0
        self.executables = 0  # compiled by the model runner's warm-up
        r.register(_SchedulerCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector(Collector):
    """Scrape-time values: queue lengths, KV pool use, prefix-cache hits, compilations,
    forward steps and device bubbles by mode."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        compiles = CounterMetricFamily(f"{PREFIX}compilations", "XLA compilations in this "
                                       "process (warm-up included; growth after it is a bug)")
        compiles.add_metric([], compile_counter().count)
        yield compiles
        late = CounterMetricFamily(f"{PREFIX}compilations_after_warmup", "XLA compilations "
                                   "since the model runner's warm-up (must stay 0)")
        late.add_metric([], self._metrics.compiles_after_warmup)
        yield late
        if self._metrics.trace is not None:
            yield from _trace_metrics(self._metrics.trace)
        if self._metrics.spec is not None:
            yield from _spec_metrics(self._metrics.spec)
        # What the executables cost: each one maps memory and the kernel caps the count
        # (runtime/executable_budget.py), so the headroom is worth watching.
        fp = footprint()
        for name, doc, value in (
            ("executables", "Executables compiled at warm-up", self._metrics.executables),
            ("process_memory_mappings", "Memory mappings of the server process", fp.maps),
            ("process_max_memory_mappings", "The kernel's limit (vm.max_map_count)",
             fp.max_maps),
            ("process_resident_memory_bytes", "Resident memory of the server process",
             fp.resident_mb * 2**20),
        ):
            yield GaugeMetricFamily(f"{PREFIX}{name}", doc, value=value)
        s = self._metrics.stats
        if s is None:
            return
        hit_rate = s.prefix_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        for name, doc, value in (
            ("num_running_requests", "Requests holding a batch slot", s.num_running),
            ("num_waiting_requests", "Requests queued for admission", s.num_waiting),
            ("kv_pool_usage", "Fraction of KV pages in use, not counting evictable cache",
             s.token_usage),
            ("kv_pool_used_pages", "KV pages in use, prefix cache included", s.num_used_pages),
            ("kv_pool_total_pages", "KV pages in the pool", s.num_total_pages),
            ("prefix_cache_hit_rate", "Admitted prompt tokens served from the prefix cache",
             hit_rate),
        ):
            yield GaugeMetricFamily(f"{PREFIX}{name}", doc, value=value)
        yield CounterMetricFamily(f"{PREFIX}retractions", "Requests sent back to the queue "
                                  "for lack of KV pages", value=s.num_retractions)


def _spec_metrics(spec: SpecDecoding) -> Iterator[Metric]:
    for name, doc, value in (
        ("spec_verify_rows", "Rows of TARGET_VERIFY steps (one per request and step)",
         spec.total_steps),
        ("spec_draft_tokens", "Tokens drafted and verified", spec.total_drafted),
        ("spec_accepted_tokens", "Drafted tokens the target kept", spec.total_accepted),
        ("spec_draft_seconds", "Host time spent drafting, a draft model's DRAFT_EXTEND / "
         "DRAFT_DECODE steps and their readback included", spec.total_draft_s),
    ):
        yield CounterMetricFamily(f"{PREFIX}{name}", doc, value=value)
    rate = spec.total_accepted / spec.total_drafted if spec.total_drafted else 0.0
    yield GaugeMetricFamily(f"{PREFIX}spec_accept_rate", "Accepted / drafted tokens", value=rate)
    length = 1 + spec.total_accepted / spec.total_steps if spec.total_steps else 0.0
    yield GaugeMetricFamily(f"{PREFIX}spec_accept_length", "Tokens a verify row yields "
                            "(accepted drafts + 1)", value=length)


def _trace_metrics(trace: ExecutionTrace) -> Iterator[Metric]:
    steps = CounterMetricFamily(f"{PREFIX}forward_steps", "Forward steps launched by mode",
                                labels=["mode"])
    for mode, n in sorted(trace.step_counts().items()):
        steps.add_metric([mode], n)
    yield steps
    busy = CounterMetricFamily(f"{PREFIX}device_busy_seconds", "Device time of forward "
                               "steps (launch or previous ready, to ready) by mode",
                               labels=["mode"])
    idle = CounterMetricFamily(f"{PREFIX}device_idle_seconds", "Device bubbles: idle time "
                               "before a step while work was queued, charged to that step's "
                               "mode", labels=["mode"])
    frac = GaugeMetricFamily(f"{PREFIX}device_bubble_fraction", "idle / (busy + idle) by "
                             "mode; mode=\"all\" over every step", labels=["mode"])
    host = CounterMetricFamily(f"{PREFIX}device_host_bound_steps", "Steps the device had "
                               "finished before the host read them back: their bubbles are "
                               "not measured, so the fraction is a lower bound",
                               labels=["mode"])
    for mode, b in trace.bubbles().items():
        busy.add_metric([mode], b["busy_s"])
        idle.add_metric([mode], b["idle_s"])
        frac.add_metric([mode], b["fraction"])
        host.add_metric([mode], b["host_bound_steps"])
    yield from (busy, idle, frac, host)
