"""Load and lifecycle of the HTTP server.

Load: 64 concurrent streaming requests, 10 of which hang up mid-stream. The 54 that stay
must produce the tokens of Engine.generate on each prompt alone (greedy, compared up to
the reference's first near-tie as in tests/test_engine.py); afterwards the KV pool holds
nothing but evictable prefix cache and /metrics counts what was sent.
Lifecycle: /health before warm-up, and SIGTERM on a `scripts/serve.py` subprocess.
Shares the compiled tiny runner and the helpers of tests/test_server.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jax
import pytest

from runtime import checkpoint
from runtime.engine import Engine
from runtime.request import SamplingParams
from tests.test_server import (
    API_KEY,
    AUTH,
    BASE_ARGS,
    CFG,
    LiveServer,
    chat_ids,
    error_of,
    free_port,
    metric,
    sse_payloads,
    tiny_engine,
    tiny_params,
    tokenizer,
    wait_idle,
)

NUM_PROMPTS, REPEATS, NUM_HANG_UPS = 16, 4, 10
MAX_TOKENS, HANG_UP_MAX_TOKENS = 24, 150
NEAR_TIE = 1e-3  # greedy steps whose top-2 logprob gap is smaller may legitimately flip
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly brew tea".split()


def _prompts() -> list[str]:
    rng = random.Random(0)
    return [f"Request {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(2, 40)))
            for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def reference() -> list[Any]:
    """Each prompt alone through Engine.generate, with top-2 logprobs to spot near-ties."""
    eng = tiny_engine()
    sp = SamplingParams(temperature=0, max_new_tokens=MAX_TOKENS, ignore_eos=True,
                        top_logprobs=2)
    return [eng.generate([p], sp)[0] for p in _prompts()]


@pytest.fixture(params=[{}, {"enable_multiplexing": True, "split_prefill_layers": 1,
                             "multiplex_fill_fraction": 0}],
                ids=["plain", "multiplexing"])
def live(reference, request) -> Iterator[LiveServer]:
    """Function scope: one engine at a time on the shared runner (they share its KV pool).
    Multiplexed (never prefilling first, fill fraction 0), prompts prefill one layer per
    iteration between decode steps, so a client that hangs up before its first token
    (after=0) leaves in the middle of a split."""
    engine = tiny_engine(max_running_requests=16, max_queued_requests=1024, **request.param)
    with LiveServer(lambda: engine, max_queued_requests=1024) as s:
        s.wait_ready()
        yield s


async def _complete(c: httpx.AsyncClient, prompt: str) -> list[int]:
    """Stream /generate to the end; returns the final output ids."""
    body = {"text": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}
    async with c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        events = sse_payloads([line async for line in r.aiter_lines()])
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "length"}
    return events[-2]["output_ids"]


async def _hang_up(c: httpx.AsyncClient, prompt: str, after: int) -> None:
    """Stream a chat completion and close the connection after `after` content chunks
    (0: as soon as the reply starts, while the prompt is still prefilling)."""
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": HANG_UP_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    seen = 0
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        if after == 0:
            return
        async for line in r.aiter_lines():
            seen += '"content": "' in line and '"content": ""' not in line
            if seen >= after:
                return  # leaving the block closes the connection mid-stream
    pytest.fail("the stream ended before the client hung up")


async def _run_load(url: str, prompts: list[str]) -> list[tuple[int, list[int]]]:
    """(prompt index, output ids) of every request that ran to the end."""
    rng = random.Random(1)
    jobs = [("complete", i % NUM_PROMPTS) for i in range(NUM_PROMPTS * REPEATS - NUM_HANG_UPS)]
    jobs += [("hang_up", i) for i in range(NUM_HANG_UPS)]
    rng.shuffle(jobs)  # hang-ups at random places in the arrival order
    limits = httpx.Limits(max_connections=128)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, limits=limits) as c:
        coros = [_complete(c, prompts[i]) if kind == "complete"
                 else _hang_up(c, prompts[i], after=rng.randint(0, 5)) for kind, i in jobs]
        results = await asyncio.gather(*coros)
    return [(i, out) for (kind, i), out in zip(jobs, results, strict=True)
            if kind == "complete"]


def _agreeing_prefix(want: Any) -> int:
    """Tokens of the reference up to and including its first near-tie step."""
    for step, (_, lps) in enumerate(want.meta_info["output_top_logprobs"]):
        if lps[0] - lps[1] < NEAR_TIE:
            return step + 1
    return len(want.output_ids)


def test_concurrent_streams_with_hang_ups(live, reference):
    prompts = _prompts()
    with live.client() as http:  # process-wide counter: only serving must not move it
        compiled = metric(http, "xlaserve_compilations_after_warmup_total")
    completed = asyncio.run(_run_load(live.url, prompts))
    assert len(completed) == NUM_PROMPTS * REPEATS - NUM_HANG_UPS
    for i, ids in completed:
        want = reference[i]
        k = _agreeing_prefix(want)
        assert ids[:k] == want.output_ids[:k], (prompts[i], ids, want.output_ids)

    with live.client() as http:
        wait_idle(http)  # every page is back: only evictable prefix cache remains
        assert metric(http, 'xlaserve_requests_total{status="length"}') == len(completed)
        assert metric(http, 'xlaserve_requests_total{status="abort"}') == NUM_HANG_UPS
        assert metric(http, "xlaserve_e2e_request_latency_seconds_count") == len(completed)
        sent = sum(len(tokenizer().encode(prompts[i])) for i, _ in completed)
        sent += sum(len(chat_ids(p)) for p in prompts[:NUM_HANG_UPS])
        assert metric(http, "xlaserve_prompt_tokens_total") == sent
        generated = metric(http, "xlaserve_generation_tokens_total")
        assert generated >= len(completed) * MAX_TOKENS + NUM_HANG_UPS
        assert metric(http, "xlaserve_compilations_after_warmup_total") == compiled
        assert metric(http, "xlaserve_kv_pool_usage") == 0


# ---- flow control -----------------------------------------------------------------------


@pytest.fixture
def small() -> Iterator[LiveServer]:
    """4 running + 8 queued requests fit; a burst overflows it."""
    engine = tiny_engine(max_running_requests=4, max_queued_requests=8)
    with LiveServer(lambda: engine, max_queued_requests=8) as s:
        s.wait_ready()
        yield s


def test_overload_gets_503_with_retry_after(small):
    """A burst of 24 long requests: what does not fit gets 503, the rest completes."""
    body = {"text": "burst", "sampling_params": {"max_new_tokens": 80, "temperature": 0,
                                                 "ignore_eos": True}}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=small.url, headers=AUTH, timeout=60) as c:
            return await asyncio.gather(*(c.post("/generate", json=body) for _ in range(24)))

    replies = asyncio.run(burst())
    ok = [r for r in replies if r.status_code == 200]
    busy = [r for r in replies if r.status_code == 503]
    assert len(ok) + len(busy) == 24 and len(ok) >= 8 and busy
    assert all(r.json()["meta_info"]["completion_tokens"] == 80 for r in ok)
    for r in busy:
        assert r.headers["Retry-After"] == "1" and "overloaded" in error_of(r)["message"]


def test_disconnect_aborts_and_frees_pages(small):
    body = {"text": "disconnect", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with small.client() as http:
        with http.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # mid-stream: then hang up
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            http.post("/generate", json=body | {"stream": False}, timeout=0.3)
        wait_idle(http)
        assert metric(http, 'xlaserve_requests_total{status="abort"}') == 2


# ---- lifecycle --------------------------------------------------------------------------


def test_health_is_503_until_warm():
    release = threading.Event()

    def slow_factory() -> Engine:
        release.wait(30)
        raise RuntimeError("load failed")  # also checks that a failed start shuts down

    server = LiveServer(slow_factory)
    with server:
        r = httpx.get(f"{server.url}/health")
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "loading" in error_of(r)["message"]
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, headers=AUTH)
        assert r.status_code == 503 and "loading" in error_of(r)["message"]
        release.set()
        server.thread.join(30)
        assert not server.thread.is_alive()  # the failed engine stopped uvicorn
    assert isinstance(server.ctx.engine_loop.error, RuntimeError)


def test_bad_model_folder_is_one_message(caplog):
    """A model that cannot load (its error names the tensor and file) is logged as that
    message, no stack trace, and the server stops."""
    def bad_folder() -> Engine:
        raise checkpoint.CheckpointError("/m/model.safetensors: tensor 'x' has dtype 'I8'")

    server = LiveServer(bad_folder)
    with caplog.at_level(logging.ERROR, logger="runtime.server.engine_loop"), server:
        server.thread.join(30)
        assert not server.thread.is_alive()
    [rec] = [r for r in caplog.records if r.name == "runtime.server.engine_loop"]
    assert "tensor 'x' has dtype 'I8'" in rec.getMessage() and rec.exc_info is None


def _write_tiny_checkpoint(directory: str) -> str:
    path = checkpoint.save_checkpoint(directory, CFG, jax.device_get(tiny_params()))
    with open(os.path.join(path, checkpoint.TOKENIZER_FILE), "w") as f:
        json.dump({"format": "gguf", "path": checkpoint.default_gguf_path()}, f)
    return path


def _serve_command(model: str, port: int) -> list[str]:
    a = BASE_ARGS
    flags = {"model": model, "port": port, "api_key": API_KEY, "page_size": a["page_size"],
             "max_running_requests": a["max_running_requests"],
             "max_prefill_tokens": a["max_prefill_tokens"],
             "chunked_prefill_size": a["chunked_prefill_size"],
             "max_extend_seqs": a["max_extend_seqs"], "max_total_tokens": a["max_total_tokens"],
             "decode_buckets": "16", "extend_token_buckets": "128", "kv_len_buckets": "256"}
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "serve.py")
    return [sys.executable, script, *(f"--{k}={v}" for k, v in flags.items())]


def test_sigterm_finishes_in_flight_and_exits_0(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(_serve_command(_write_tiny_checkpoint(str(tmp_path / "ckpt")),
                                           port), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        body = {"text": "in flight", "stream": True,
                "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}}
        with httpx.stream("POST", f"{url}/generate", json=body, headers=AUTH) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            events = sse_payloads(lines)
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["completion_tokens"] == 150  # finished, not cut
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(f"{url}/health")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "ready: listening on" in out and "KV pool" in out and "buckets" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
