"""Execution-path observability over HTTP.

GET  /debug/execution_trace?n=64   the last n steps (mode, bucket, padding, timings, split
                                   and TBO fields, the prefill policy's `decision`;
                                   `after=S`: only steps numbered above S), their modes as
                                   run lengths (`path`), the last n finished requests
                                   (`prefill_paths`), prefill steps by path and the
                                   policy's start-up inputs, step counts and
                                   device bubbles by mode, the scheduler state;
                                   `format=perfetto` returns the Chrome trace JSON instead.
GET  /debug/trace                  the same (its older name).
POST /start_profile                {"output_dir": ...} (optional): start jax.profiler.
POST /stop_profile                 stop it; the execution trace of the profiled window is
                                   written next to the profile as execution_trace.json.
The profiler calls run on the engine thread (the server never calls jax itself); a
profile already running, or none to stop, is a 400 with a JSON error body.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

from fastapi import APIRouter, Query, Request

from runtime.engine import Engine
from runtime.exec_trace import mode_runs, padding_waste
from runtime.perfetto import chrome_trace, write_chrome_trace
from runtime.server.engine_loop import EngineUnavailable
from runtime.server.errors import APIError, read_model
from runtime.server.protocol import ProfileRequest
from runtime.server.serving import ServerContext, unavailable

router = APIRouter()


@router.get("/debug/execution_trace")
@router.get("/debug/trace")
async def execution_trace(request: Request, n: int = Query(64, ge=0, le=65536),
                          after: int = Query(-1, ge=-1),
                          format: str = Query("json", pattern="^(json|perfetto)$"),
                          ) -> dict[str, Any]:
    ctx: ServerContext = request.app.state.ctx
    stats = ctx.metrics.stats
    trace = ctx.metrics.trace
    if format == "perfetto":
        if trace is None:
            raise unavailable(ctx.engine_loop.status())
        return chrome_trace(trace.steps(n), trace.requests(n), trace.t0)
    if trace is None:  # still loading: the scheduler state is all there is
        return {"steps": [], "path": [], "requests": [], "step_counts": {}, "bubbles": {},
                "padding_waste": padding_waste([]), "tracing": False,
                "scheduler": dataclasses.asdict(stats) if stats else None}
    return {"steps": trace.last(n, after), "path": mode_runs(trace.steps(n)),
            "requests": [s.to_json(trace.t0) for s in trace.requests(n)],
            "step_counts": trace.step_counts(), "prefill_paths": trace.prefill_paths(),
            "prefill_policy": trace.policy, "bubbles": trace.bubbles(),
            "padding_waste": padding_waste(trace.steps(n)), "tracing": trace.enabled,
            "compiles_after_warmup": ctx.metrics.compiles_after_warmup,
            "scheduler": dataclasses.asdict(stats) if stats else None}


@router.post("/start_profile")
async def start_profile(request: Request) -> dict[str, Any]:
    ctx: ServerContext = request.app.state.ctx
    body = await _profile_request(request)

    def start(engine: Engine) -> str:
        out = body.output_dir or engine.info.args.trace_dir or os.path.join(
            tempfile.gettempdir(), "xlaserve_profile")
        out = os.path.abspath(os.path.expanduser(out))
        engine.start_profile(out)
        return out

    return {"status": "ok", "output_dir": await _control(ctx, start)}


@router.post("/stop_profile")
async def stop_profile(request: Request) -> dict[str, Any]:
    ctx: ServerContext = request.app.state.ctx

    def stop(engine: Engine) -> tuple[str, str]:
        out, since = engine.stop_profile()
        path = os.path.join(out, "execution_trace.json")
        return out, write_chrome_trace(engine.trace, path, since=since)

    out, path = await _control(ctx, stop)
    return {"status": "ok", "output_dir": out, "execution_trace": path}


async def _profile_request(request: Request) -> ProfileRequest:
    body = await request.body()
    if not body:
        return ProfileRequest()
    return await read_model(request, ProfileRequest)


async def _control(ctx: ServerContext, fn: Any) -> Any:
    try:
        return await ctx.engine_loop.control(fn)
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_profile_state") from e
    except EngineUnavailable as e:
        raise unavailable(str(e)) from e
