"""What every generation endpoint shares: prompt checks, submission to the engine thread,
waiting for results while watching for a client that leaves, and SSE streaming.

Whatever way a handler ends (reply sent, client gone, error), `abort` runs for the members
that have not finished, so their KV pages go back to the pool at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.engine import Engine, RequestOutput
from runtime.engine_info import EngineInfo
from runtime.grammar import GrammarError
from runtime.metrics import ServerMetrics
from runtime.request import SamplingParams
from runtime.server.engine_loop import EngineLoop, EngineUnavailable, RequestGroup
from runtime.server.errors import APIError
from runtime.tokenizer import Tokenizer

RETRY_AFTER_S = 1
_T = TypeVar("_T")


@dataclasses.dataclass
class ServerContext:
    """Per-server state the handlers share (kept on `app.state.ctx`)."""

    engine_loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    api_key: str | None
    max_queued_requests: int

    @property
    def engine(self) -> Engine:
        """The engine once it is ready (503 before)."""
        loop = self.engine_loop
        if loop.engine is None or not loop.ready.is_set():
            raise unavailable(loop.status())
        return loop.engine

    @property
    def info(self) -> EngineInfo:
        """The engine's fixed facts: model, tokenizer, context and sampling limits."""
        return self.engine.info

    @property
    def tokenizer(self) -> Tokenizer:
        tok = self.info.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer: send token ids (input_ids)")
        return tok

    @property
    def context_len(self) -> int:
        return self.info.context_len

    @property
    def max_top_logprobs(self) -> int:
        return self.info.max_top_logprobs


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="service_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_prompt(ctx: ServerContext, ids: Sequence[int], max_new_tokens: int | None,
                 param: str, max_param: str) -> int:
    """Check a tokenized prompt; returns max_new_tokens (None: the rest of the context)."""
    if not ids:
        raise APIError(400, f"{param}: the prompt is empty (it must have at least one token)",
                       param=param, code="invalid_value")
    vocab = ctx.info.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise APIError(400, f"{param}: token ids {bad[:5]} are outside [0, {vocab})",
                       param=param, code="invalid_value")
    limit = ctx.context_len
    want = limit - len(ids) if max_new_tokens is None else max_new_tokens
    if len(ids) + want > limit or want < 0:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                       f"request has {len(ids)} prompt tokens and asks for "
                       f"{max(want, 0)} more ({max_param})", param=param,
                       code="context_length_exceeded")
    return want


_SAMPLING_FIELD = re.compile(r"^sampling_params\.(\w+)=")


def check_sampling(ctx: ServerContext, sp: SamplingParams, names: dict[str, str]) -> None:
    """SamplingParams.validate, reported under the API's own field names (`names` maps
    SamplingParams fields to them)."""
    if sp.top_logprobs > ctx.max_top_logprobs:
        param = names.get("top_logprobs", "top_logprobs")
        raise APIError(400, f"{param}={sp.top_logprobs}: this server returns at most "
                       f"{ctx.max_top_logprobs} (--max_top_logprobs)", param=param,
                       code="invalid_value")
    try:
        sp.validate(ctx.info.vocab_size)
    except ValueError as e:
        m = _SAMPLING_FIELD.match(str(e))
        field = m.group(1) if m else None
        param = names.get(field, field) if field else None
        message = _SAMPLING_FIELD.sub(f"{param}=", str(e)) if param else str(e)
        raise APIError(400, message, param=param, code="invalid_value") from e


async def compile_constraints(ctx: ServerContext, samplings: Sequence[SamplingParams],
                              names: dict[str, str]) -> None:
    """Compile each distinct grammar in a worker thread (the compiler drops the GIL), so
    the engine thread only hits the cache and a slow schema stalls nobody else; a grammar
    that cannot compile is a 400 naming the problem."""
    specs = {sp.grammar for sp in samplings} - {None}
    if not specs:
        return
    cache = ctx.engine.grammars
    if cache is None:
        raise APIError(400, "constrained decoding needs a tokenizer", code="invalid_value")
    for spec in specs:
        assert spec is not None
        if cache.contains(spec):
            continue
        try:
            await asyncio.to_thread(cache.compile, spec)
        except GrammarError as e:
            param = names.get(spec.kind, spec.kind)
            raise APIError(400, f"{param}: the grammar does not compile: {e}", param=param,
                           code="invalid_grammar") from e


async def submit(ctx: ServerContext, rid: str | list[str], prompts: Sequence[list[int]],
                 samplings: Sequence[SamplingParams],
                 grammar_names: dict[str, str] | None = None) -> RequestGroup:
    """Compile the grammars (compile_constraints, `grammar_names` naming them as the client
    wrote them), then hand the prompts to the engine thread; 503 when the queue is full,
    400 when the engine refuses one (then none of them runs). `rid`: a prefix (members get
    -0, -1, ...) or every member's id."""
    await compile_constraints(ctx, samplings, grammar_names or {})
    queued, limit = ctx.engine_loop.num_queued(), ctx.max_queued_requests
    if queued + len(prompts) > limit:
        raise unavailable(f"the server is overloaded: {queued} requests are queued "
                          f"(limit {limit}); retry later")
    rids = rid if isinstance(rid, list) else [f"{rid}-{i}" for i in range(len(prompts))]
    try:
        group = ctx.engine_loop.submit(rids, prompts, samplings, time.perf_counter())
    except EngineUnavailable as e:
        raise unavailable(str(e)) from e
    try:
        await group.wait_accepted()
    except (ValueError, EngineUnavailable) as e:
        ctx.engine_loop.abort(group)  # the accepted members must not run for nobody
        if isinstance(e, ValueError):
            raise APIError(400, str(e), code="invalid_value") from e
        raise unavailable(str(e)) from e
    except BaseException:  # cancelled while waiting: the client is gone
        ctx.engine_loop.abort(group)
        raise
    return group


async def collect(request: Request, ctx: ServerContext,
                  group: RequestGroup) -> list[RequestOutput]:
    """Wait for every member's final output; if the client disconnects first, abort."""
    try:
        results = await until_disconnect(request.receive, group.collect())
        if results is None:
            # Nobody reads this reply; 499 keeps it out of the 4xx a client could cause.
            raise APIError(499, "client closed the request", code="client_closed_request")
        return results
    finally:
        ctx.engine_loop.abort(group)


async def until_disconnect(receive: Receive, work: Awaitable[_T]) -> _T | None:
    """`work`'s result, or None (with `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        task.cancel()
        gone.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def finite(logprob: float) -> float:
    """JSON has no -inf: a token cut by top-k / top-p gets OpenAI's floor instead."""
    return logprob if math.isfinite(logprob) else -9999.0


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_group(ctx: ServerContext, group: RequestGroup,
                 events: AsyncIterator[str]) -> SSEResponse:
    """`events` as server-sent events; the group's requests stop when the client leaves."""
    return SSEResponse(events, lambda: ctx.engine_loop.abort(group))


class SSEResponse(StreamingResponse):
    """Server-sent events that stop, and run `on_close`, as soon as the client leaves.

    Starlette notices a disconnect only at the next write under ASGI 2.4 servers; a request
    still queued writes nothing for a while, so this always listens for http.disconnect.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self._stream(send))
        finally:
            self._on_close()

    async def _stream(self, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:  # the client went away mid-write
            pass
