"""Streaming HTTP client of the serving benchmark: one request = one streamed completion
whose every chunk's arrival time is recorded.

Two protocols (both SSE, `data: {...}` lines ending with `data: [DONE]`):
  openai    POST /v1/completions, `stream: true`, `stream_options.include_usage` (the
            last chunk carries the token count); xlaserve and llama-server both speak it;
  generate  SGLang's native POST /generate, `stream: true`; every event carries the
            cumulative text and `meta_info.completion_tokens`.
A chunk counts as a token arrival when it adds output (text, or a higher token count).
Detokenizers hold back half a UTF-8 character, so one chunk can carry two tokens: the
ITL list has one entry per chunk gap, as SGLang's bench_serving has. No jax here: the load
generator must stay light next to the server it measures, so the streams go through
aiohttp (C-parsed HTTP, as SGLang's bench_serving uses), not httpx: with 16 streams
decoding beside a long prefill (one run each), one step's 16 chunks reached the client over
1.6 ms (p50; p99 8.1) through httpx and 0.3 ms (p99 5.8) through aiohttp.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

import aiohttp
import httpx
from tqdm import tqdm

BACKENDS = ("openai", "generate")
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class ClientError(RuntimeError):
    """The benchmark cannot run against this target as asked."""


def check_loopback(base_url: str) -> str:
    """The load generator targets this machine only: a benchmark must never load someone
    else's server."""
    host = urlparse(base_url).hostname
    if host not in LOOPBACK:
        raise ClientError(f"--base_url {base_url!r}: only loopback hosts "
                          f"({', '.join(sorted(LOOPBACK))}) may be targeted")
    return base_url.rstrip("/")


@dataclasses.dataclass
class RequestSpec:
    """What to send: token ids (or text) and how many tokens to make (EOS ignored)."""

    prompt: list[int] | str
    input_len: int
    output_len: int
    tag: str = ""
    json_schema: str | None = None  # constrain the output (SGLang's /generate only)


@dataclasses.dataclass
class RequestResult:
    tag: str
    input_len: int
    output_len: int  # requested
    send_t: float  # perf_counter seconds
    chunk_t: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    ok: bool = False
    cancelled: bool = False
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_t[0] - self.send_t if self.chunk_t else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_t[-1] - self.send_t if self.chunk_t else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_t, self.chunk_t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Decode time per output token after the first (None below two tokens)."""
        if len(self.chunk_t) < 2 or self.output_tokens < 2:
            return None
        return (self.chunk_t[-1] - self.chunk_t[0]) / (self.output_tokens - 1)

    def to_json(self, t0: float) -> dict[str, Any]:
        """Times relative to the scenario's start t0 (seconds), rounded to microseconds."""
        return {"tag": self.tag, "input_len": self.input_len, "output_len": self.output_len,
                "send_s": round(self.send_t - t0, 6),
                "chunk_s": [round(t - t0, 6) for t in self.chunk_t],
                "output_tokens": self.output_tokens, "ok": self.ok,
                "cancelled": self.cancelled, "error": self.error}


def _payload(backend: str, spec: RequestSpec, model: str) -> tuple[str, dict[str, Any]]:
    if backend == "openai":
        if spec.json_schema is not None:
            raise ClientError("constrained requests need --backend=generate")
        return "/v1/completions", {
            "model": model, "prompt": spec.prompt, "max_tokens": spec.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    key = "text" if isinstance(spec.prompt, str) else "input_ids"
    sampling: dict[str, Any] = {"max_new_tokens": spec.output_len, "temperature": 0.0,
                                "ignore_eos": True}
    if spec.json_schema is not None:
        sampling["json_schema"] = spec.json_schema
    return "/generate", {key: spec.prompt, "stream": True, "sampling_params": sampling}


class _Progress:
    """Counts tokens per event so both protocols report arrivals the same way."""

    def __init__(self, backend: str, result: RequestResult) -> None:
        self.backend, self.r = backend, result
        self.text_len = 0

    def event(self, obj: dict[str, Any], now: float) -> None:
        if "error" in obj:
            raise ClientError(f"server error: {obj['error']}")
        if self.backend == "openai":
            self._openai(obj, now)
        else:
            self._generate(obj, now)

    def _openai(self, obj: dict[str, Any], now: float) -> None:
        usage = obj.get("usage")
        if usage:
            self.r.output_tokens = int(usage.get("completion_tokens", self.r.output_tokens))
        for choice in obj.get("choices") or []:
            if choice.get("text"):
                self.r.chunk_t.append(now)
                if not usage:  # until the usage chunk: one token per chunk
                    self.r.output_tokens = max(self.r.output_tokens, len(self.r.chunk_t))

    def _generate(self, obj: dict[str, Any], now: float) -> None:
        n = int((obj.get("meta_info") or {}).get("completion_tokens", 0))
        text_len = len(obj.get("text") or "")
        if n > self.r.output_tokens or text_len > self.text_len:
            self.r.chunk_t.append(now)
        self.r.output_tokens = max(n, self.r.output_tokens)
        self.text_len = max(text_len, self.text_len)


def new_result(spec: RequestSpec) -> RequestResult:
    return RequestResult(spec.tag, spec.input_len, spec.output_len, time.perf_counter())


async def send(client: aiohttp.ClientSession, backend: str, base_url: str,
               spec: RequestSpec, model: str = "default", timeout_s: float = 600.0,
               result: RequestResult | None = None) -> RequestResult:
    """One streamed request. Never raises for the server's faults (they land in
    `error`); a cancelled task records `cancelled` and closes the stream, which makes the
    server abort the request. `result` (from new_result) lets the caller watch the
    arrivals while the request runs."""
    path, body = _payload(backend, spec, model)
    r = result if result is not None else new_result(spec)
    r.send_t = time.perf_counter()
    progress = _Progress(backend, r)
    try:
        async with asyncio.timeout(timeout_s):
            async with client.post(base_url + path, json=body) as resp:
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    r.error = f"HTTP {resp.status}: {text[:300]}"
                    return r
                async for raw in resp.content:  # one line per iteration
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        r.ok = True
                        break
                    progress.event(json.loads(data), time.perf_counter())
    except asyncio.CancelledError:
        r.cancelled = True
    except (aiohttp.ClientError, ClientError, TimeoutError, ValueError) as e:
        # ValueError: a malformed JSON event (json.JSONDecodeError) or a line over
        # read_bufsize
        r.error = f"{type(e).__name__}: {e}"
    return r


def make_client(max_connections: int) -> aiohttp.ClientSession:
    # No read timeout: a request waits in the server's queue as long as the load says;
    # `send` bounds each request's total time instead. Lines (one SSE event each) up to
    # 1 MiB: a /generate event carries the whole text so far.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0),
        read_bufsize=1 << 20, trust_env=False)


async def run_at(client: aiohttp.ClientSession, backend: str, base_url: str,
                 specs: Sequence[RequestSpec], offsets_s: Sequence[float], model: str,
                 timeout_s: float, progress: str = "") -> list[RequestResult]:
    """Send specs[i] at offsets_s[i] seconds after now; wait for all of them. A
    `progress` label shows a bar of finished requests (long runs)."""
    t0 = time.perf_counter()
    bar = tqdm(total=len(specs), desc=progress, leave=False) if progress else None

    async def one(spec: RequestSpec, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        r = await send(client, backend, base_url, spec, model, timeout_s)
        if bar is not None:
            bar.update()
        return r

    try:
        return list(await asyncio.gather(*(one(s, a) for s, a in
                                           zip(specs, offsets_s, strict=True))))
    finally:
        if bar is not None:
            bar.close()


def wait_healthy(base_url: str, timeout_s: float, alive: Any = None) -> float:
    """Poll GET /health until 200; seconds waited. `alive()` (if given) returning False
    stops the wait early (the server process died)."""
    t0 = time.perf_counter()
    with httpx.Client(timeout=5.0, trust_env=False) as c:
        while time.perf_counter() - t0 < timeout_s:
            if alive is not None and not alive():
                raise ClientError(f"server at {base_url} exited before it was healthy")
            try:
                if c.get(base_url + "/health").status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise ClientError(f"server at {base_url} not healthy after {timeout_s:.0f} s")
