"""SGLang's operational endpoints, as its clients call them: /get_model_info,
/get_server_info, /flush_cache, /health_generate."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from runtime.engine import Engine
from runtime.request import SamplingParams
from runtime.server.errors import APIError
from runtime.server.serving import ServerContext, collect, new_id, submit

router = APIRouter()
VERSION = "0.1.0"


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    ctx: ServerContext = request.app.state.ctx
    info = ctx.info
    return {"model_path": info.args.model, "tokenizer_path": info.args.model,
            "served_model_name": ctx.model_name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": info.architecture, "architectures": [info.architecture],
            "context_length": info.context_len, "vocab_size": info.vocab_size}


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    """The server's arguments (the API key left out), as SGLang's reply carries them."""
    ctx: ServerContext = request.app.state.ctx
    engine = ctx.engine
    args = {k: v for k, v in dataclasses.asdict(engine.info.args).items() if k != "api_key"}
    stats = dataclasses.asdict(engine.stats())
    return {**args, "version": VERSION, "context_length": engine.info.context_len,
            "internal_states": [{"scheduler": stats,
                                 "compiles_after_warmup": engine.compiles_after_warmup,
                                 "grammar_cache": _grammar_stats(engine)}]}


def _grammar_stats(engine: Engine) -> dict[str, int]:
    cache = engine.grammars
    return {} if cache is None else {"hits": cache.hits, "misses": cache.misses}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """200 when the prefix cache was flushed, 400 (SGLang's status) while requests run."""
    ctx: ServerContext = request.app.state.ctx
    if await ctx.engine_loop.control(lambda e: e.flush_cache()):
        return PlainTextResponse("Cache flushed.\n")
    raise APIError(400, "cache not flushed: requests are running or waiting",
                   code="server_busy")


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy only if the engine generates a token end to end."""
    ctx: ServerContext = request.app.state.ctx
    group = await submit(ctx, new_id("health"), [[0]],
                         [SamplingParams(max_new_tokens=1, temperature=0)])
    await collect(request, ctx, group)
    return JSONResponse({"status": "ok"})
