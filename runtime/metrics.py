"""Server observability: Prometheus metrics (prefix `xlaserve_`) and the execution-path trace.

Each server owns a `ServerMetrics` with its own registry, so several servers (tests) can
live in one process. Counters and histograms are updated as events happen (by the engine
thread and the HTTP front end; prometheus_client is thread-safe); gauges that describe
the scheduler's state are read at scrape time from the last published `SchedulerStats`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runtime.compile_counter import compile_counter
from runtime.executable_budget import footprint
from runtime.scheduler import SchedulerStats

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
        self.forward_steps = Counter(f"{PREFIX}forward_steps", "Forward steps launched by mode",
                                     ["mode"], registry=r)
        self.stats: SchedulerStats | None = None
        self.compiles_after_warmup = 0
        self.executables = 0  # compiled by the model runner's warm-up
        r.register(_SchedulerCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector(Collector):
    """Scrape-time values: queue lengths, KV pool use, prefix-cache hits, compilations."""

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


@dataclasses.dataclass(frozen=True)
class TraceStep:
    """One launched forward: its mode, its rows, and the bucket shape it was padded to."""

    step: int
    time: float
    mode: str
    extend_rows: int
    decode_rows: int
    extend_tokens: int
    bucket: dict[str, int]


class ExecutionTrace:
    """The last `maxlen` forward steps, appended by the engine thread, read by HTTP."""

    def __init__(self, maxlen: int = 1024) -> None:
        self._steps: collections.deque[TraceStep] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._count = 0

    def record(self, mode: str, extend_rows: int, decode_rows: int, extend_tokens: int,
               bucket: dict[str, int]) -> None:
        with self._lock:
            self._steps.append(TraceStep(self._count, time.time(), mode, extend_rows,
                                         decode_rows, extend_tokens, bucket))
            self._count += 1

    def last(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            steps = list(self._steps)[-n:] if n > 0 else []
        return [dataclasses.asdict(s) for s in steps]
