"""Counts XLA compilations (every lowering of a jitted function, cache hit or not).

After warm-up the count must not move: the ModelRunner calls only executables
compiled ahead of time, and `assert_no_new_compiles` turns any stray compile (an
eager op on the hot path, a new shape) into an error in strict mode.
"""

from __future__ import annotations

import threading

_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


class CompileCounter:
    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def _on_event(self, event: str, duration: float, **_: object) -> None:
        if event == _LOWERING_EVENT:
            with self._lock:
                self._count += 1

    @property
    def count(self) -> int:
        return self._count


_COUNTER: CompileCounter | None = None


def compile_counter() -> CompileCounter:
    """The process-wide counter, registered with jax.monitoring on first use."""
    global _COUNTER
    if _COUNTER is None:
        from jax import monitoring

        _COUNTER = CompileCounter()
        monitoring.register_event_duration_secs_listener(_COUNTER._on_event)
    return _COUNTER


class CompileAfterWarmupError(RuntimeError):
    pass
