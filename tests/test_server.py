"""HTTP server end to end: a real uvicorn server on a free localhost port, a tiny random
model with the real SmolLM2 tokenizer, clients httpx and the official `openai` package.

One ModelRunner is compiled per test session (tiny_runner, shared with
test_server_load.py); each module builds its own Engine and server around it. The tiny
model's final norm is scaled up so its logits are decisive: greedy runs then agree across
batch compositions instead of flipping on near-ties.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jax
import openai
import pytest

from models import llama
from runtime import checkpoint
from runtime.config import ServerArgs
from runtime.engine import Engine
from runtime.model_runner import ModelRunner
from runtime.request import SamplingParams
from runtime.server import build_server
from runtime.tokenizer import Tokenizer
from tests.model_utils import TINY

CFG = dataclasses.replace(TINY, vocab_size=49152, max_position_embeddings=256, num_layers=2)
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Small buckets: six executables (greedy or not x decode / 1-row / 4-row extend).
BASE_ARGS: dict[str, Any] = dict(
    page_size=16, max_running_requests=16, max_prefill_tokens=128, chunked_prefill_size=128,
    max_extend_seqs=4, decode_buckets=(16,), extend_token_buckets=(128,),
    kv_len_buckets=(256,), max_total_tokens=4096, max_top_logprobs=5)
CONTEXT = 256


def tiny_params() -> dict:
    params = llama.init_params(CFG, jax.random.key(0))
    params["final_norm"] = params["final_norm"] * 20  # logits ~ N(0, 20^2): few near-ties
    return params


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(checkpoint.default_gguf_path())


@functools.cache
def tiny_runner() -> ModelRunner:
    # Split-prefill executables too, for the multiplexing engines of test_server_load.
    return Engine(ServerArgs(**BASE_ARGS, enable_split_prefill=True),
                  model=(CFG, tiny_params()), tokenizer=tokenizer()).runner


def tiny_engine(**overrides: Any) -> Engine:
    """A fresh engine (empty prefix cache) on the shared runner."""
    return Engine(ServerArgs(**BASE_ARGS | overrides), runner=tiny_runner(),
                  tokenizer=tokenizer())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn in a background thread for the length of a `with`. The engine comes from
    `engine_factory`; `overrides` set the front end's ServerArgs (queue limit, key)."""

    def __init__(self, engine_factory, **overrides: Any) -> None:
        self.port = free_port()
        args = ServerArgs(**BASE_ARGS | {"port": self.port, "api_key": API_KEY} | overrides)
        self.server, self.ctx = build_server(args, engine_factory, log_level="warning")
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started, "uvicorn did not start"
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        assert self.ctx.engine_loop.ready.wait(timeout), "engine not ready"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=AUTH, timeout=60, **kw)


def sse_payloads(lines: Iterator[str]) -> list[Any]:
    """The `data:` payloads of an SSE stream; "[DONE]" stays a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def error_of(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    return err


def chat_ids(content: str) -> list[int]:
    return tokenizer().apply_chat_template([{"role": "user", "content": content}],
                                           tokenize=True)


GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
PROMPTS = ["What is the capital of France?", "Once upon a time", "def fib(n):"]


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """Engine.generate outputs (greedy) for the prompts the HTTP tests send."""
    eng = tiny_engine()
    texts = eng.generate(PROMPTS, GREEDY)
    chat = eng.generate([chat_ids(PROMPTS[0])], GREEDY)[0]
    return {"texts": texts, "chat": chat}


@pytest.fixture(scope="module")
def live(reference) -> Iterator[LiveServer]:
    engine = tiny_engine()
    with LiveServer(lambda: engine) as s:
        s.wait_ready()
        yield s


@pytest.fixture
def http(live) -> Iterator[httpx.Client]:
    with live.client() as c:
        yield c


@pytest.fixture
def oai(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)


def scheduler_state(http: httpx.Client) -> dict[str, Any]:
    return http.get("/debug/trace", params={"n": 0}).json()["scheduler"]


def wait_idle(http: httpx.Client, timeout: float = 10) -> dict[str, Any]:
    """Scheduler state once nothing runs or waits and only evictable cache holds pages."""
    deadline = time.monotonic() + timeout
    while True:
        s = scheduler_state(http)
        idle = s["num_running"] == 0 and s["num_waiting"] == 0
        if idle and s["num_used_pages"] == s["num_evictable_pages"]:
            return s
        assert time.monotonic() < deadline, f"not idle: {s}"
        time.sleep(0.02)


def metric(http: httpx.Client, name: str) -> float:
    """A sample's value from /metrics (`name` includes labels), 0 when absent."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


# ---- operational routes and auth --------------------------------------------------------


def test_health_models_and_auth(live):
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}  # no key needed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{live.url}/v1/models", headers=headers)
        assert r.status_code == 401
        assert error_of(r)["code"] == "invalid_api_key"
    r = httpx.post(f"{live.url}/generate", json={"text": "hi"})
    assert r.status_code == 401
    models = httpx.get(f"{live.url}/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert models["data"][0]["max_model_len"] == CONTEXT


def test_metrics_and_trace(http):
    # The counter is process-wide and other test modules compile after the shared runner's
    # warm-up, so what must not move is the count while this server serves.
    compiled = metric(http, "xlaserve_compilations_after_warmup_total")
    http.post("/generate", json={"text": "metrics", "sampling_params": {"max_new_tokens": 3}})
    text = http.get("/metrics").text
    for name in ("xlaserve_requests_total", "xlaserve_prompt_tokens_total",
                 "xlaserve_generation_tokens_total", "xlaserve_time_to_first_token_seconds",
                 "xlaserve_inter_token_latency_seconds", "xlaserve_e2e_request_latency_seconds",
                 "xlaserve_num_running_requests", "xlaserve_num_waiting_requests",
                 "xlaserve_kv_pool_usage", "xlaserve_prefix_cache_hit_rate",
                 'xlaserve_forward_steps_total{mode="decode"}', "xlaserve_compilations_total"):
        assert name in text, name
    trace = http.get("/debug/trace", params={"n": 3}).json()
    assert len(trace["steps"]) == 3
    for step in trace["steps"]:
        assert step["mode"] in ("extend", "decode", "mixed")
        # A fresh prompt's extend step needs no page table (width 0); the rest use the
        # single KV bucket.
        fresh_extend = step["mode"] == "extend" and step["bucket"]["num_pages_per_seq"] == 0
        assert fresh_extend or step["bucket"]["num_pages_per_seq"] == CONTEXT // 16
    assert trace["step_counts"]["decode"] >= 2
    assert metric(http, "xlaserve_compilations_total") > 0  # warm-up compiled the buckets
    assert metric(http, "xlaserve_compilations_after_warmup_total") == compiled


# ---- native /generate -------------------------------------------------------------------


def test_generate_matches_engine(http, reference):
    want = reference["texts"][0]
    body = {"sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    by_text = http.post("/generate", json=body | {"text": PROMPTS[0]}).json()
    ids = tokenizer().encode(PROMPTS[0])
    by_ids = http.post("/generate", json=body | {"input_ids": ids}).json()
    for got in (by_text, by_ids):
        assert got["output_ids"] == want.output_ids
        assert got["text"] == want.text
        meta = got["meta_info"]
        assert meta["id"].startswith("gen-")
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 12
        assert meta["finish_reason"] == {"type": "length"}
        assert meta["e2e_latency"] > 0 and meta["cached_tokens"] >= 0


def test_generate_batch_n_and_stream(http, reference):
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "n": 2}
    items = http.post("/generate", json={"text": PROMPTS[:2], "sampling_params": sp}).json()
    assert [i["output_ids"] for i in items] == [
        o.output_ids for o in reference["texts"][:2] for _ in range(2)]
    with http.stream("POST", "/generate", json={"text": PROMPTS[:2], "sampling_params": sp,
                                                "stream": True}) as r:
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    last = {e["index"]: e for e in events[:-1]}  # text and ids are cumulative
    assert [last[i]["text"] for i in range(4)] == [i["text"] for i in items]
    assert all(last[i]["meta_info"]["finish_reason"] == {"type": "length"} for i in range(4))


def test_generate_logprobs(http):
    r = http.post("/generate", json={"text": PROMPTS[1], "return_logprob": True,
                                     "top_logprobs_num": 2,
                                     "sampling_params": {"max_new_tokens": 5,
                                                         "temperature": 0}}).json()
    meta = r["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == r["output_ids"]
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                                 strict=True):
        assert len(top) == 2 and top[0][1] == tok and top[0][0] == pytest.approx(lp)
        assert top[0][0] >= top[1][0]


# ---- OpenAI API with the official client ------------------------------------------------


def test_chat_matches_engine_and_usage(oai, reference):
    want = reference["chat"]
    r = oai.chat.completions.create(model="any", max_tokens=12, temperature=0,
                                    messages=[{"role": "user", "content": PROMPTS[0]}],
                                    extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == "length"
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(chat_ids(PROMPTS[0])), 12)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_stream_with_usage(oai, reference):
    chunks = list(oai.chat.completions.create(
        model="any", max_completion_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": PROMPTS[0]}]))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_n2_logprobs_usage(oai):
    r = oai.completions.create(model="any", prompt=PROMPTS[2], n=2, max_tokens=6, seed=7,
                               temperature=20, logprobs=2, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text != r.choices[1].text  # choice j samples with seed + j
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    prompt_len = len(tokenizer().encode(PROMPTS[2]))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_len, 12)


def test_completions_stream_matches_non_stream(oai, reference):
    kw = dict(model="any", prompt=PROMPTS[1], max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    chunks = list(oai.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == reference["texts"][1].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_logprobs(oai):
    r = oai.chat.completions.create(model="any", max_tokens=5, temperature=0, logprobs=True,
                                    top_logprobs=3,
                                    messages=[{"role": "user", "content": "logprobs"}])
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the top token
        assert entry.bytes == list(entry.token.encode())


def test_stop_strings(oai, http):
    prompt = "stop strings"
    kw = dict(model="any", prompt=prompt, max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    full = oai.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.find(stop)]
    r = oai.completions.create(stop=[stop, "\x00never"], **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        stop=stop, stream=True, **kw))
    assert streamed == want  # no part of the stop string is ever streamed
    native = http.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": stop}}).json()
    assert native["text"] == want
    assert native["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_seed_reproducibility(oai):
    def sample(seed: int) -> str:
        return oai.chat.completions.create(
            model="any", max_tokens=12, temperature=20, seed=seed,
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "seeds"}]).choices[0].message.content

    first = sample(123)
    assert sample(123) == first
    assert sample(124) != first


# ---- bad input --------------------------------------------------------------------------

C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    # (endpoint, JSON body or raw bytes, param, part of the message): all get a 400
    (C, b'{"prompt": "hi", ', None, "not valid JSON"),
    (C, b"[1, 2]", None, "JSON object"),
    (C, b"\xff\xfe", None, "not valid JSON"),
    (C, {}, "prompt", "required"),
    (C, {"prompt": "hi", "max_tokens": "ten"}, "max_tokens", "integer"),
    (C, {"prompt": "hi", "temperature": "hot"}, "temperature", "number"),
    (C, {"prompt": "hi", "stream": "yes"}, "stream", "boolean"),
    (C, {"prompt": 5}, "prompt", ""),
    (C, {"prompt": "hi", "foo": 1}, "foo", "Unrecognized request argument"),
    (C, {"prompt": "hi", "max_tokens": -1}, "max_tokens", "greater than or equal"),
    (C, {"prompt": "hi", "max_tokens": 10**9}, "prompt", "maximum context length"),
    (C, {"prompt": "hi", "temperature": -0.5}, "temperature", "greater than or equal"),
    (C, {"prompt": "hi", "top_p": 0}, "top_p", "greater than 0"),
    (C, {"prompt": "hi", "top_p": 1.5}, "top_p", "less than or equal"),
    (C, {"prompt": "hi", "n": 0}, "n", "greater than or equal"),
    (C, {"prompt": "hi", "n": 10**6}, "n", "less than or equal"),
    (C, {"prompt": ""}, "prompt", "empty"),
    (C, {"prompt": []}, "prompt", "empty"),
    (C, {"prompt": "word " * 300}, "prompt", "maximum context length"),
    (C, {"prompt": [1, 10**6]}, "prompt", "outside"),
    (C, {"prompt": [-1]}, "prompt", "outside"),
    (C, {"prompt": "hi", "logprobs": 10}, "logprobs", "at most 5"),
    (C, {"prompt": "hi", "top_k": 0}, "top_k", "must be"),
    (C, {"prompt": "hi", "stop_token_ids": [10**6]}, "stop_token_ids", "vocab"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, None, "stream"),
    (C, {"prompt": "hi", "echo": True}, None, "echo"),
    (CHAT, {"messages": []}, "messages", "at least 1"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", ""),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type", ""),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, None, "logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 10**6}, "messages",
     "maximum context length"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, "tools.0.function",
     "required"),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, None, "needs `tools`"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format",
     "schema is required"),
    (C, {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    (GEN, {"text": "hi", "input_ids": [1]}, None, "exactly one"),
    (GEN, {"text": "hi", "sampling_params": {"max_tokens": 5}},
     "sampling_params.max_tokens", "Unrecognized"),
    (GEN, {"text": "hi", "sampling_params": {"top_k": 0}}, "sampling_params.top_k",
     "must be"),
    (GEN, {"text": "hi", "sampling_params": {"max_new_tokens": 10**7}},
     "sampling_params.max_new_tokens", "must be in"),
    (GEN, {"input_ids": [[1], []]}, "input_ids", "empty"),
    (GEN, {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "2 prompts"),
]


@pytest.mark.parametrize("path,body,param,message", BAD_INPUTS,
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_INPUTS)])
def test_bad_input(http, path, body, param, message):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param, err
    assert message in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_http_errors_and_oversize_body(http):
    r = http.post(C, content=b"x" * (9 << 20))
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    assert http.get(C).status_code == 405 and error_of(http.get(C))
    assert http.get("/nope").status_code == 404 and error_of(http.get("/nope"))


def test_still_serving_after_bad_input(oai, http):
    """Runs after the bad-input table: the server answers normally and leaked nothing."""
    r = oai.completions.create(model="any", prompt="still alive", max_tokens=4)
    assert r.usage.completion_tokens <= 4 and r.choices[0].finish_reason in ("length", "stop")
    assert http.get("/health").status_code == 200
    wait_idle(http)
