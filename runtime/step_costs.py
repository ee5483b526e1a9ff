"""Device time of each launched executable, measured while serving (no jax import).

Launches are asynchronous and the device runs them one after another in launch order
(each step reads the KV pool the previous one wrote). A watcher thread waits on each
launch's output in that order and charges it the time from when the device could start
it (its launch, or the previous launch finishing, whichever is later) to when its output
is ready. Per key (an executable's name) it keeps an exponential moving average, which
the multiplexing loop's interval policy reads.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from typing import Any, Protocol


class _Awaitable(Protocol):
    def block_until_ready(self) -> Any: ...


class DeviceCosts:
    """Moving-average device seconds per key, fed by a daemon watcher thread."""

    def __init__(self, smoothing: float = 0.3) -> None:
        self._alpha = smoothing
        self._cost: dict[str, float] = {}
        self._lock = threading.Lock()
        # (key, launch time, output, per, base); None stops the watcher.
        self._queue: queue.SimpleQueue[
            tuple[str, float, _Awaitable, float, str | None] | None] = queue.SimpleQueue()
        self._last_ready = 0.0
        self._thread: threading.Thread | None = None

    def record(self, key: str, seconds: float) -> None:
        with self._lock:
            old = self._cost.get(key)
            self._cost[key] = seconds if old is None else old + self._alpha * (seconds - old)

    def get(self, key: str) -> float | None:
        with self._lock:
            return self._cost.get(key)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._cost)

    def watch(self, key: str, output: _Awaitable, per: float = 1.0,
              base: str | None = None) -> None:
        """Charge `key` for the device work that produces `output`, launched just now,
        divided by `per` (an interval of k layers records its cost per unit of layer work).
        `base`: charge only what the launch took beyond key `base`'s cost (a fused decode +
        interval step charges its interval the difference to the decode step alone;
        nothing is recorded until `base` has a cost)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="device-costs", daemon=True)
            self._thread.start()
            # A daemon thread still waiting on the runtime when the interpreter tears it
            # down aborts the process ("terminate called ..."): stop it first.
            atexit.register(self.close)
        self._queue.put((key, time.perf_counter(), output, per, base))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the watcher after the launches it already has (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, launched, output, per, base = item
            try:
                output.block_until_ready()
            except Exception:  # a failed step is reported by its reader, not here
                continue
            ready = time.perf_counter()
            took = ready - max(launched, self._last_ready)
            self._last_ready = ready
            base_cost = 0.0 if base is None else self.get(base)
            if base_cost is not None:
                self.record(key, max(took - base_cost, 0.0) / per)
