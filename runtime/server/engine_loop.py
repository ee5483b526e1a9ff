"""The engine thread: the only thread that touches the Engine.

The Engine is not thread-safe, and a step blocks on the device, so it runs on a thread of
its own. The asyncio front end talks to it through a command queue (add / abort / stop);
results flow back through `loop.call_soon_threadsafe`, one callback per engine step, into
each HTTP request's `RequestGroup`. The front end never waits on the engine thread. Other
engine calls (the profiler) go through the same queue as `_Control` commands and answer
through a future.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from runtime.engine import Engine, RequestOutput
from runtime.metrics import ServerMetrics
from runtime.perfetto import TraceDirWriter
from runtime.request import SamplingParams

logger = logging.getLogger(__name__)


class RequestGroup:
    """The asyncio side of one HTTP request: its engine requests (prompts x n), whether each
    was accepted, and their outputs as (index, RequestOutput) in arrival order."""

    def __init__(self, rids: Sequence[str], loop: asyncio.AbstractEventLoop) -> None:
        self.rids = list(rids)
        self.accepted = [loop.create_future() for _ in self.rids]
        self.outputs: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.finished: set[int] = set()

    async def wait_accepted(self) -> None:
        """Raise the first member's ValueError if the engine refused any of them."""
        await asyncio.wait(self.accepted)
        errors = [f.exception() for f in self.accepted]  # retrieves every one: no warnings
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while len(self.finished) < len(self.rids):
            index, out = await self.outputs.get()
            if out.finished:
                self.finished.add(index)
            yield index, out

    async def collect(self) -> list[RequestOutput]:
        """Every member's final output, in member order."""
        final: dict[int, RequestOutput] = {}
        async for index, out in self.stream():
            if out.finished:
                final[index] = out
        return [final[i] for i in range(len(self.rids))]

    def unfinished(self) -> list[str]:
        return [rid for i, rid in enumerate(self.rids) if i not in self.finished]


@dataclasses.dataclass
class _Live:
    """Engine-thread bookkeeping of one accepted request (timing for the metrics)."""

    group: RequestGroup
    index: int
    arrival: float
    num_tokens: int = 0
    last_token: float | None = None
    last: RequestOutput | None = None


@dataclasses.dataclass(frozen=True)
class _Add:
    group: RequestGroup
    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: float


@dataclasses.dataclass(frozen=True)
class _Abort:
    rid: str


@dataclasses.dataclass(frozen=True)
class _Control:
    """Run fn(engine) on the engine thread; its result or exception settles `future`."""

    fn: Callable[[Engine], Any]
    future: asyncio.Future


_STOP = object()


class EngineUnavailable(RuntimeError):
    """The engine is still loading, has stopped, or has failed."""


class EngineLoop:
    """Owns the engine thread. `engine_factory` runs on that thread (loading and warm-up
    happen there, so the HTTP server answers /health while the model compiles)."""

    def __init__(self, engine_factory: Callable[[], Engine], metrics: ServerMetrics,
                 on_ready: Callable[[Engine], None] | None = None,
                 on_fatal: Callable[[], None] | None = None) -> None:
        self._factory = engine_factory
        self.metrics = metrics
        self._on_ready, self._on_fatal = on_ready, on_fatal
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._pending_adds = 0  # adds queued but not applied yet
        self._closed = False  # no more commands are read: submit refuses
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.engine: Engine | None = None  # set once built; read-only outside the thread
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._trace_writer: TraceDirWriter | None = None  # engine thread only

    # ---- asyncio side --------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, rids: Sequence[str], prompts: Sequence[list[int]],
               samplings: Sequence[SamplingParams], arrival: float) -> RequestGroup:
        """Queue one engine request per prompt; the group reports acceptance and outputs."""
        if self._loop is None or not self.ready.is_set():
            raise EngineUnavailable(self.status())
        group = RequestGroup(rids, self._loop)
        # Under the lock, so the engine thread's final drain sees every add or none.
        with self._lock:
            if self._closed:
                raise EngineUnavailable("the server is shutting down")
            self._pending_adds += len(rids)
            for i, (ids, sp) in enumerate(zip(prompts, samplings, strict=True)):
                self._commands.put(_Add(group, i, ids, sp, arrival))
        return group

    async def control(self, fn: Callable[[Engine], Any]) -> Any:
        """fn(engine) on the engine thread, between steps; raises what fn raised."""
        if self._loop is None or not self.ready.is_set():
            raise EngineUnavailable(self.status())
        future = self._loop.create_future()
        with self._lock:  # as in submit: the final drain sees this command or it is refused
            if self._closed:
                raise EngineUnavailable("the server is shutting down")
            self._commands.put(_Control(fn, future))
        return await future

    def abort(self, group: RequestGroup) -> None:
        """Abort the members that have not finished (client gone, or an error)."""
        for rid in group.unfinished():
            self._commands.put(_Abort(rid))

    def status(self) -> str:
        """Why the engine does not take requests, or "ok"."""
        if self.error is not None:
            return "the engine has failed"
        if self.engine is None:
            return "the model is still loading"
        return "ok" if self.ready.is_set() else "the server is shutting down"

    def num_queued(self) -> int:
        """Requests not yet running: queued adds plus the scheduler's waiting queue."""
        stats = self.metrics.stats
        with self._lock:
            return self._pending_adds + (stats.num_waiting if stats else 0)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, end the thread and wait for it."""
        self._commands.put(_STOP)
        # Still loading: nothing to finish, and the daemon thread dies with the process.
        if self._thread is not None and self.engine is not None:
            self._thread.join(timeout)

    # ---- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory()
        except ValueError as e:  # bad flags or model files (CheckpointError): the message
            logger.error("engine failed to start: %s", e)  # says what, no stack trace
            self._die(e)
            self._close()
            return
        except BaseException as e:  # reported through /health and on_fatal
            logger.exception("engine failed to start")
            self._die(e)
            self._close()
            return
        self.engine = engine
        self.metrics.stats = engine.stats()
        self.metrics.trace = engine.trace
        self.metrics.spec = engine.spec
        if engine.info.args.trace_dir:
            self._trace_writer = TraceDirWriter(engine.trace, engine.info.args.trace_dir)
        self.metrics.compiles_after_warmup = engine.compiles_after_warmup
        self.metrics.executables = engine.info.num_executables
        self.ready.set()
        if self._on_ready is not None:
            self._on_ready(engine)
        try:
            self._serve(engine)
        except Exception as e:  # a bug in a step: fail the requests rather than hang them
            logger.exception("engine step failed; the server stops serving")
            self._die(e)
            self._finish_all("internal error: the engine failed")
        finally:
            self._close()
            self._flush_traces(engine)
            engine.close()  # a multi-process mesh's other ranks stop with it

    def _flush_traces(self, engine: Engine) -> None:
        """At shutdown: stop a profile left running, write the last --trace_dir file."""
        if engine.profiling:
            logger.info("stopped the profile left running (%s)", engine.stop_profile()[0])
        if self._trace_writer is not None:
            logger.info("execution trace written to %s", self._trace_writer.write(final=True))

    def _close(self) -> None:
        """Refuse further commands and answer the adds still queued."""
        self.ready.clear()
        with self._lock:
            self._closed = True
        for cmd in self._take(block=False):
            if isinstance(cmd, _Add):
                self._call(_settle, cmd.group.accepted[cmd.index],
                           EngineUnavailable("the server is shutting down"))
            elif isinstance(cmd, _Control):
                self._call(_settle, cmd.future, EngineUnavailable("the server is shutting down"))

    def _die(self, error: BaseException) -> None:
        self.error = error
        if self._on_fatal is not None:
            self._call(self._on_fatal)

    def _serve(self, engine: Engine) -> None:
        while True:
            for cmd in self._take(block=not engine.has_work()):
                if cmd is _STOP:
                    self._finish_all("the server is shutting down")
                    return
                self._apply(engine, cmd)
            if engine.has_work():
                self._publish(engine.step())
                if self._trace_writer is not None:
                    self._trace_writer.maybe_write()
            self.metrics.stats = engine.stats()
            self.metrics.compiles_after_warmup = engine.compiles_after_warmup

    def _take(self, block: bool) -> list[Any]:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, engine: Engine, cmd: _Add | _Abort | _Control) -> None:
        if isinstance(cmd, _Control):
            try:
                result = cmd.fn(engine)
            except Exception as e:  # the caller turns it into an error reply
                self._call(_settle, cmd.future, e)
            else:
                self._call(_settle, cmd.future, None, result)
            return
        if isinstance(cmd, _Abort):
            live = self._live.pop(cmd.rid, None)
            if live is not None:
                engine.abort(cmd.rid)
                self.metrics.requests.labels("abort").inc()
            return
        with self._lock:
            self._pending_adds -= 1
        rid = cmd.group.rids[cmd.index]
        future = cmd.group.accepted[cmd.index]
        try:
            engine.add_request(cmd.prompt_ids, cmd.sampling, rid=rid)
        except Exception as e:  # ValueError: bad input (400); anything else fails only this
            self._call(_settle, future, e)
            return
        self._live[rid] = _Live(cmd.group, cmd.index, cmd.arrival)
        self.metrics.prompt_tokens.inc(len(cmd.prompt_ids))
        self._call(_settle, future, None)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        batch = []
        for out in outputs:
            live = self._live.get(out.rid)
            if live is None:
                continue
            self._observe(live, out, now)
            batch.append((live.group, live.index, out))
            if out.finished:
                del self._live[out.rid]
        if batch:
            self._call(_deliver, batch)

    def _observe(self, live: _Live, out: RequestOutput, now: float) -> None:
        m = self.metrics
        new = len(out.output_ids) - live.num_tokens
        if new > 0:
            if live.last_token is None:
                m.ttft.observe(now - live.arrival)
            else:
                m.itl.observe((now - live.last_token) / new)
            m.generation_tokens.inc(new)
            live.num_tokens, live.last_token = len(out.output_ids), now
        live.last = out
        if out.finished:
            reason = out.meta_info.get("finish_reason") or {}
            m.requests.labels(reason.get("type", "abort")).inc()
            m.e2e.observe(now - live.arrival)

    def _finish_all(self, message: str) -> None:
        """End every live request with an abort output (shutdown or a failed engine)."""
        batch = []
        for rid, live in self._live.items():
            last = live.last
            meta = dict(last.meta_info) if last else {}
            meta["finish_reason"] = {"type": "abort", "message": message}
            batch.append((live.group, live.index, RequestOutput(
                rid=rid, text=last.text if last else "", finished=True, meta_info=meta,
                output_ids=list(last.output_ids) if last else [])))
            self.metrics.requests.labels("abort").inc()
        self._live.clear()
        if batch:
            self._call(_deliver, batch)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():  # nobody is left to tell once the loop is gone
            self._loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
    """Resolve a future unless its HTTP request already gave up on it."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _deliver(batch: list[tuple[RequestGroup, int, RequestOutput]]) -> None:
    for group, index, out in batch:
        group.outputs.put_nowait((index, out))
