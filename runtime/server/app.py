"""The FastAPI app, its operational routes (/health, /metrics; the debug routes are in
debug_api.py), bearer-token auth, and `serve()`: uvicorn in the main thread, the engine
on its own thread.

Start-up order: uvicorn listens at once and /health answers 503 while the engine thread
loads and compiles; it turns 200 when warm-up is done. On SIGTERM / SIGINT uvicorn stops
accepting connections and lets in-flight responses finish (up to GRACEFUL_SHUTDOWN_S);
then the lifespan ends the engine thread, which aborts whatever is still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.config import ServerArgs
from runtime.engine import Engine
from runtime.metrics import CONTENT_TYPE, ServerMetrics
from runtime.server import debug_api, native_api, openai_api, sglang_api
from runtime.server.engine_loop import EngineLoop
from runtime.server.errors import error_body, install_error_handlers
from runtime.server.serving import RETRY_AFTER_S, ServerContext

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 30
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class BearerAuth:
    """Every route but /health needs `Authorization: Bearer <api_key>`."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: ServerMetrics) -> None:
        self._app, self._expected = app, f"Bearer {api_key}".encode()
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self._expected):  # constant time
                self._metrics.http_errors.labels("401").inc()
                body = error_body(401, "missing or invalid API key: send the header "
                                  "'Authorization: Bearer <api_key>'", code="invalid_api_key")
                reply = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                await reply(scope, receive, send)
                return
        await self._app(scope, receive, send)


def create_app(ctx: ServerContext) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.engine_loop.start(asyncio.get_running_loop())
        yield
        # In a worker thread, so the loop still delivers the final (abort) outputs.
        await asyncio.to_thread(ctx.engine_loop.stop)

    app = FastAPI(title="xlaserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ctx = ctx
    install_error_handlers(app, ctx.metrics)
    if ctx.api_key:
        app.add_middleware(BearerAuth, api_key=ctx.api_key, metrics=ctx.metrics)
    app.include_router(native_api.router)
    app.include_router(openai_api.router)
    app.include_router(debug_api.router)
    app.include_router(sglang_api.router)

    @app.get("/health")
    async def health() -> Response:
        status = ctx.engine_loop.status()
        if status == "ok":
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(503, status, code="service_unavailable"), 503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return app


def model_name(args: ServerArgs) -> str:
    """The name /v1 replies carry: --served_model_name, else from --model."""
    if args.served_model_name:
        return args.served_model_name
    if args.model == "default":
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(args.model))


def build_server(args: ServerArgs, engine_factory: Callable[[], Engine] | None = None,
                 log_level: str = "info") -> tuple[uvicorn.Server, ServerContext]:
    """The uvicorn server and its context, not started (tests run it in a thread)."""
    metrics = ServerMetrics()
    holder: list[uvicorn.Server] = []

    def on_fatal() -> None:  # the engine cannot serve: let uvicorn shut down
        holder[0].should_exit = True

    loop = EngineLoop(engine_factory or functools.partial(Engine, args), metrics,
                      on_ready=functools.partial(log_ready, args), on_fatal=on_fatal)
    ctx = ServerContext(loop, metrics, model_name(args), args.api_key,
                        args.max_queued_requests)
    config = uvicorn.Config(create_app(ctx), host=args.host, port=args.port,
                            log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    holder.append(uvicorn.Server(config))
    return holder[0], ctx


def serve(args: ServerArgs) -> int:
    """Run until SIGTERM / SIGINT; returns the process exit code."""
    server, ctx = build_server(args)
    # After its graceful shutdown uvicorn restores the handlers it found and raises the
    # signal again; the default handlers would then kill us (exit -15) or raise
    # KeyboardInterrupt. Handlers that do nothing let a clean shutdown exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if ctx.engine_loop.error is not None:
        logger.error("exiting: the engine failed (%s)", ctx.engine_loop.error)
        return 1
    return 0


def log_ready(args: ServerArgs, engine: Engine) -> None:
    info = engine.info
    cfg, pool = info.runner, info.pool
    logger.info("model %s: %s, %d layers, vocab %d, context %d, dtype %s, attention %s, "
                "matmul %s%s", model_name(args), info.architecture, info.num_layers,
                info.vocab_size, info.context_len, cfg.dtype, cfg.attention_backend, cfg.cpu_matmul,
                f" ({cfg.quantization} weights)" if cfg.quantization else
                " (bf16 weights in 12 bits)" if cfg.compress_weights else "")
    logger.info("compiled %d executables: decode buckets %s, extend token buckets %s, "
                "extend seq buckets %s, kv_len buckets %s%s", info.num_executables,
                cfg.decode_buckets, cfg.extend_token_buckets, cfg.extend_seq_buckets,
                cfg.kv_len_buckets, " (+ mixed)" if cfg.enable_mixed else "")
    logger.info("KV pool: %d pages x %d tokens = %d tokens", pool.num_pages, pool.page_size,
                pool.num_slots)
    logger.info("ready: listening on http://%s:%d", args.host, args.port)
