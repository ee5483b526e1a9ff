"""A fake streaming LLM server for the benchmark tests: OpenAI /v1/completions and SGLang's
/generate over SSE, with the timing of a one-batch-at-a-time engine and no model.

    python tests/fake_openai_server.py --port=8123 [--itl_ms=4 --prefill_us_per_token=200]

One loop plays the device: a waiting prompt's prefill takes prefill_us_per_token per token
and freezes every decoding stream meanwhile (what the long_during_decode scenario must
see); otherwise each step of itl_ms gives every decoding stream one token. /health is 503
for --startup_s, then 200. Unknown flags (xlaserve's or llama-server's, which the
benchmarks pass) are accepted and ignored, so it stands in for either server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


class FakeEngine:
    def __init__(self, itl_s: float, prefill_s_per_token: float) -> None:
        self.itl_s, self.prefill_s = itl_s, prefill_s_per_token
        self.waiting: list[tuple[int, asyncio.Queue]] = []
        self.decoding: list[asyncio.Queue] = []
        self.steps = 0

    async def run(self) -> None:
        while True:
            if self.waiting:
                n, q = self.waiting.pop(0)
                await asyncio.sleep(n * self.prefill_s)  # decode waits: no chunking here
                self.decoding.append(q)
            await asyncio.sleep(self.itl_s)
            self.steps += 1
            for q in self.decoding:
                q.put_nowait(self.steps)

    async def tokens(self, prompt_len: int, n: int) -> AsyncIterator[int]:
        q: asyncio.Queue = asyncio.Queue()
        self.waiting.append((prompt_len, q))
        try:
            for i in range(n):
                await q.get()
                yield i
        finally:
            if q in self.decoding:
                self.decoding.remove(q)


def _prompt_len(prompt: Any) -> int:
    return len(prompt) if isinstance(prompt, list) else len(str(prompt).split())


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def build_app(engine: FakeEngine, startup_s: float) -> FastAPI:
    app = FastAPI()
    ready = asyncio.Event()

    @app.on_event("startup")
    async def _start() -> None:
        asyncio.get_running_loop().create_task(engine.run())
        asyncio.get_running_loop().call_later(startup_s, ready.set)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"ok": ready.is_set()}, status_code=200 if ready.is_set() else 503)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        n, plen = int(body.get("max_tokens", 16)), _prompt_len(body["prompt"])
        if not body.get("stream"):
            async for _ in engine.tokens(plen, n):
                pass
            return JSONResponse({"choices": [{"index": 0, "text": " tok" * n,
                                              "logprobs": {"tokens": [" tok"] * n},
                                              "finish_reason": "length"}]})

        async def events() -> AsyncIterator[str]:
            async for _ in engine.tokens(plen, n):
                yield _sse({"object": "text_completion",
                            "choices": [{"index": 0, "text": " tok", "finish_reason": None}]})
            yield _sse({"choices": [], "usage": {"prompt_tokens": plen,
                                                 "completion_tokens": n}})
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/generate")
    async def generate(request: Request) -> StreamingResponse:
        body = await request.json()
        n = int(body["sampling_params"]["max_new_tokens"])
        plen = _prompt_len(body.get("input_ids") or body.get("text"))

        async def events() -> AsyncIterator[str]:
            async for i in engine.tokens(plen, n):
                yield _sse({"text": " tok" * (i + 1), "output_ids": list(range(i + 1)),
                            "meta_info": {"completion_tokens": i + 1, "prompt_tokens": plen}})
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--itl_ms", type=float, default=4.0)
    p.add_argument("--prefill_us_per_token", type=float, default=200.0)
    p.add_argument("--startup_s", type=float, default=0.5)
    args, _ = p.parse_known_args()
    engine = FakeEngine(args.itl_ms / 1e3, args.prefill_us_per_token / 1e6)
    uvicorn.run(build_app(engine, args.startup_s), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
