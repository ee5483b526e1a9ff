"""Structured output, tool calling and SGLang's native fields on the real SmolLM2-135M
server (one server for the module): JSON schema / regex / EBNF constraints, OpenAI
response_format and tools through the official openai client, logit_bias, the exact
payloads SGLang's and vLLM's benchmark clients send, and no compilation after warm-up.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from runtime.config import ServerArgs
from runtime.engine import Engine
from tests.test_server import API_KEY, LiveServer, error_of, sse_payloads

# Small buckets: the real model compiles in ~a minute on 2 cores (less with the cache).
ARGS: dict[str, Any] = dict(model="default", page_size=16, max_running_requests=32,
                            max_prefill_tokens=256, chunked_prefill_size=256,
                            max_extend_seqs=4, decode_buckets=(32,),
                            extend_token_buckets=(256,), kv_len_buckets=(512,),
                            max_total_tokens=16384, strict_compile=True)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
PEOPLE = ["a pilot", "a chef", "a student", "a doctor", "a farmer", "a poet", "a nurse",
          "a judge", "a baker", "a diver"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string", "maxLength": 24}}, "required": ["timezone"]}}}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with LiveServer(lambda: Engine(_args()), **ARGS) as s:
        s.wait_ready(timeout=600)
        yield s
    assert s.ctx.engine_loop.error is None


def _args() -> ServerArgs:
    return ServerArgs(**ARGS)


@pytest.fixture
def http(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=300) as c:
        yield c


@pytest.fixture
def oai(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=300)


def _engine(live: LiveServer) -> Engine:
    engine = live.ctx.engine_loop.engine
    assert engine is not None
    return engine


def _chat_prompt(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def _generate_many(http: httpx.Client, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """POST /generate for every body at once (they batch on the server)."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: http.post("/generate", json=b), bodies))
    for r in replies:
        assert r.status_code == 200, r.text
    return [r.json() for r in replies]


@pytest.mark.parametrize("temperature", [
    0.0, pytest.param(0.8, marks=pytest.mark.slow)], ids=["greedy", "sampled"])
def test_twenty_json_schema_requests_validate(http, temperature):
    bodies = [{"text": _chat_prompt(f"Describe {PEOPLE[i % len(PEOPLE)]} as JSON."),
               "sampling_params": {"max_new_tokens": 160, "temperature": temperature,
                                   "sampling_seed": i, "json_schema": json.dumps(PERSON)}}
              for i in range(20)]
    for out in _generate_many(http, bodies):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), PERSON)


def test_response_format_through_the_openai_client(oai):
    r = oai.chat.completions.create(
        model="m", temperature=0, max_tokens=160,
        messages=[{"role": "user", "content": "Describe a pilot as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = oai.chat.completions.create(
        model="m", temperature=0, max_tokens=60, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with a color."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_and_ebnf_on_generate(http):
    regex, ebnf = _generate_many(http, [
        {"text": _chat_prompt("Is the sky blue?"),
         "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                             "regex": r"(Yes|No), (it is|it is not)\."}},
        {"text": _chat_prompt("List three colors."),
         "sampling_params": {"max_new_tokens": 32, "temperature": 0.7, "sampling_seed": 1,
                             "ebnf": 'root ::= color ", " color ", " color\n'
                                     'color ::= "red" | "green" | "blue" | "black"'}}])
    assert re.fullmatch(r"(Yes|No), (it is|it is not)\.", regex["text"]), regex
    assert re.fullmatch(r"((red|green|blue|black), ){2}(red|green|blue|black)", ebnf["text"])


def _check_call(name: str, arguments: str, tools: list[dict[str, Any]]) -> None:
    tool = next(t for t in tools if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_returns_a_tool_call(oai, stream):
    tools = [WEATHER_TOOL, TIME_TOOL]
    kw: dict[str, Any] = dict(model="m", temperature=0, max_tokens=80, tools=tools,
                              tool_choice="required",
                              messages=[{"role": "user", "content": "Weather in Paris?"}])
    if not stream:
        choice = oai.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        _check_call(call.function.name, call.function.arguments, tools)
        return
    name, args, ids, reasons = None, "", set(), []
    for chunk in oai.chat.completions.create(**kw, stream=True):
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        for delta in choice.delta.tool_calls or []:
            assert delta.index == 0
            if delta.id:
                ids.add(delta.id)
                name = delta.function.name
            args += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls" and len(ids) == 1
    assert name is not None
    _check_call(name, args, tools)


def test_named_tool_choice_calls_that_tool(oai):
    r = oai.chat.completions.create(
        model="m", temperature=0, max_tokens=80, tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}])
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_call("get_time", call.function.arguments, [TIME_TOOL])


def test_tool_choice_none_is_plain_chat(oai):
    r = oai.chat.completions.create(
        model="m", temperature=0, max_tokens=8, tools=[WEATHER_TOOL], tool_choice="none",
        messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_free_requests_batched_with_constrained_ones_keep_their_tokens(http):
    free = {"text": _chat_prompt("Tell me about the sea."),
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    seeded = {"text": _chat_prompt("Tell me about the sky."),
              "sampling_params": {"max_new_tokens": 24, "temperature": 0.9,
                                  "sampling_seed": 5, "ignore_eos": True}}
    alone = _generate_many(http, [free, seeded])
    constrained = [{"text": _chat_prompt(f"Describe {p} as JSON."),
                    "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                        "json_schema": json.dumps(PERSON)}}
                   for p in PEOPLE[:6]]
    mixed = _generate_many(http, constrained[:3] + [free, seeded] + constrained[3:])
    assert [m["output_ids"] for m in mixed[3:5]] == [a["output_ids"] for a in alone]


def test_logit_bias(oai):
    token = 504  # "The"
    r = oai.completions.create(model="m", prompt="Once upon a time", max_tokens=4,
                               temperature=0, logit_bias={str(token): 100})
    assert r.choices[0].text == "The" * 4
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        oai.completions.create(model="m", prompt="x", max_tokens=1,
                               logit_bias={"49152": 1})


def test_grammar_that_does_not_compile_is_a_400(http):
    r = http.post("/generate", json={"text": "x", "sampling_params": {"regex": "(abc"}})
    err = error_of(r)
    assert r.status_code == 400 and err["param"] == "sampling_params.regex"
    assert "unclosed group" in err["message"]
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "foo"}}}}}})
    assert r.status_code == 400 and "foo" in error_of(r)["message"]
    r = http.post("/generate", json={"text": "x", "sampling_params": {"json_schema": "{no"}})
    assert r.status_code == 400 and "not valid JSON" in error_of(r)["message"]


@pytest.mark.parametrize("body", ["[" * 20000 + "]" * 20000,
                                  '{"text": ' + "[" * 100 + "]" * 100 + "}",
                                  '{"text": ' + "1" * 5000 + "}"],
                         ids=["20000_levels", "100_levels", "5000_digit_int"])
def test_body_too_deep_or_too_large_for_the_parser_is_a_400(http, body):
    r = http.post("/generate", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"


# ---- exact client payloads (recorded from their sources) --------------------------------

def _sse_ok(resp: httpx.Response) -> list[Any]:
    assert resp.status_code == 200, resp.text
    events = sse_payloads(resp.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_sglang_bench_serving_generate_payload(http):
    """sglang/bench_serving.py async_request_sglang_generate, --backend sglang."""
    for prompt_key, prompt in (("text", "Hello, my name is"), ("input_ids", [504, 3575])):
        payload = {
            prompt_key: prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
            "stream": True,
            "lora_path": None,
            "return_logprob": False,
            "logprob_start_len": -1,
        }
        with http.stream("POST", "/generate", json=payload) as resp:
            events = _sse_ok(resp)
        assert events[-1]["meta_info"]["completion_tokens"] == 8


def test_sglang_native_fields(http):
    """GenerateReqInput's rid, return_logprob, logprob_start_len, top_logprobs_num,
    return_text_in_logprobs (the shape of SGLang's documented logprob example)."""
    out = http.post("/generate", json={
        "text": "The capital of France is", "rid": "my-request-1",
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 2,
        "return_text_in_logprobs": True}).json()
    meta = out["meta_info"]
    assert meta["id"] == "my-request-1"
    lp, tok, text = meta["output_token_logprobs"][0]
    assert tok == out["output_ids"][0] and isinstance(text, str) and lp <= 0
    assert len(meta["output_top_logprobs"][0]) == 2
    batch = http.post("/generate", json={"text": ["a", "b"], "rid": ["r-a", "r-b"],
                                         "return_logprob": [True, False],
                                         "sampling_params": {"max_new_tokens": 2}}).json()
    assert [b["meta_info"]["id"] for b in batch] == ["r-a", "r-b"]
    assert "output_token_logprobs" in batch[0]["meta_info"]
    assert "output_token_logprobs" not in batch[1]["meta_info"]
    for bad, word in (({"lora_path": "my-adapter"}, "LoRA"), ({"image_data": "x.png"}, "image"),
                      ({"return_logprob": True, "logprob_start_len": 0}, "prompt-token")):
        r = http.post("/generate", json={"text": "x", **bad})
        assert r.status_code == 400 and word in error_of(r)["message"], r.text


def test_vllm_benchmark_payloads(http):
    """vllm/benchmarks/lib/endpoint_request_func.py: openai-completions and openai-chat
    (with --ignore-eos)."""
    completions = {
        "model": "m", "prompt": "Hello, my name is", "repetition_penalty": 1.0,
        "max_tokens": 6, "logprobs": None, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=completions) as resp:
        events = _sse_ok(resp)
    assert events[-1]["usage"]["completion_tokens"] == 6
    chat = {
        "model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hello"}]}],
        "max_completion_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=chat) as resp:
        events = _sse_ok(resp)
    assert events[-1]["usage"]["completion_tokens"] == 6


def test_sglang_operational_endpoints(http):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"] == "default"
    server = http.get("/get_server_info").json()
    assert "api_key" not in server and server["max_running_requests"] == 32
    assert server["internal_states"][0]["grammar_cache"]["misses"] >= 1
    assert http.post("/flush_cache").status_code == 200
    assert http.get("/health_generate").status_code == 200


def test_no_compilation_after_warmup(live):
    """Last in the module: every constrained, biased and plain batch above ran the
    executables compiled at start-up (strict mode would have failed the engine)."""
    engine = _engine(live)
    assert engine.runner.compiles_after_warmup == 0
    assert live.ctx.engine_loop.error is None
