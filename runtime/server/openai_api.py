"""OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models.

Choices run as separate engine requests (prompt i, choice j is choice index i * n + j);
`usage` counts each prompt once and every choice's tokens. Streaming sends one chunk per
text delta, a final chunk per choice with its finish_reason (and, when asked, the logprobs
of all its tokens), a usage chunk if `stream_options.include_usage`, then `data: [DONE]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request

from runtime import tool_calls as tools
from runtime.engine import RequestOutput
from runtime.request import SamplingParams
from runtime.server import openai_format as fmt
from runtime.server.engine_loop import RequestGroup
from runtime.server.errors import APIError, read_model
from runtime.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAISampling
from runtime.server.serving import (
    SSE_DONE,
    ServerContext,
    check_prompt,
    check_sampling,
    collect,
    new_id,
    sse,
    stream_group,
    submit,
)

router = APIRouter()

_NAMES = {"max_new_tokens": "max_tokens", "top_logprobs": "top_logprobs"}
# A grammar that fails to compile, named as the client wrote it (ebnf carries forced tool
# calls too, whose grammar comes from the tools' parameter schemas).
_CONSTRAINT_NAMES = {"json_schema": "response_format", "regex": "regex", "ebnf": "ebnf"}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    ctx: ServerContext = request.app.state.ctx
    card: dict[str, Any] = {"id": ctx.model_name, "object": "model", "created": 0,
                            "owned_by": "xlaserve"}
    if ctx.engine_loop.ready.is_set():
        card["max_model_len"] = ctx.context_len
    return {"object": "list", "data": [card]}


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    ctx: ServerContext = request.app.state.ctx
    req = await read_model(request, CompletionRequest)
    prompts = _completion_prompts(ctx, req.prompt)
    top = req.logprobs or 0
    names = _NAMES | {"top_logprobs": "logprobs"}
    samplings = _expand(ctx, req, prompts, req.max_tokens, "prompt",
                        req.logprobs is not None, top, names)
    return await _respond(request, ctx, req, prompts, samplings, fmt.CompletionFormat(
        new_id("cmpl"), ctx.model_name, ctx.tokenizer, req.logprobs is not None, top))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    ctx: ServerContext = request.app.state.ctx
    req = await read_model(request, ChatCompletionRequest)
    template = ctx.tokenizer.chat_template
    use_tools = bool(req.tools) and req.tool_choice != "none"
    tool_fmt = tools.tool_format(template) if use_tools else None
    ids = _chat_prompt(ctx, req, tool_fmt)
    top = req.top_logprobs or 0
    samplings = _expand(ctx, req, [ids], req.max_new_tokens, "messages",
                        req.logprobs, top, _NAMES)
    forced = req.forced_tools
    if forced is not None and tool_fmt is not None:
        grammar = tools.forced_call_grammar([t.model_dump(exclude_none=True) for t in forced],
                                            tool_fmt)
        samplings = [dataclasses.replace(sp, ebnf=grammar) for sp in samplings]
    return await _respond(request, ctx, req, [ids], samplings, fmt.ChatFormat(
        new_id("chatcmpl"), ctx.model_name, ctx.tokenizer, req.logprobs, top, tools=tool_fmt))


def _chat_prompt(ctx: ServerContext, req: ChatCompletionRequest,
                 tool_fmt: tools.ToolFormat | None) -> list[int]:
    """The rendered chat; tools go to the template, or to a system message where the
    template never reads them (tool_calls.template_messages)."""
    messages = [m.to_template() for m in req.messages]
    extra: dict[str, Any] = {}
    try:
        if tool_fmt is not None and req.tools:
            tool_dicts = [t.model_dump(exclude_none=True) for t in req.tools]
            if tools.template_reads_tools(ctx.tokenizer.chat_template):
                extra["tools"] = tool_dicts
            else:
                messages = tools.template_messages(messages, tool_dicts, tool_fmt)
        ids = ctx.tokenizer.apply_chat_template(messages, tokenize=True, **extra)
    except (ValueError, TypeError, KeyError) as e:
        raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from e
    assert isinstance(ids, list)
    return ids


def _completion_prompts(ctx: ServerContext, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [ctx.tokenizer.encode(prompt)]
    if not prompt:
        raise APIError(400, "prompt: the prompt list is empty", param="prompt",
                       code="invalid_value")
    if isinstance(prompt[0], str):
        return [ctx.tokenizer.encode(p) for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _expand(ctx: ServerContext, req: OpenAISampling, prompts: Sequence[list[int]],
            max_tokens: int | None, param: str, logprobs: bool,
            top: int, names: dict[str, str]) -> list[SamplingParams]:
    """Sampling of every choice, prompt-major, each checked before anything runs."""
    out = []
    for ids in prompts:
        max_new = check_prompt(ctx, ids, max_tokens, param, "max_tokens")
        for j in range(req.n):
            try:
                sp = req.to_params(max_new, j, logprobs, top)
            except ValueError as e:  # a logit_bias key that is not a token id
                raise APIError(400, str(e), param="logit_bias", code="invalid_value") from e
            check_sampling(ctx, sp, names)
            out.append(sp)
    return out


async def _respond(request: Request, ctx: ServerContext, req: OpenAISampling,
                   prompts: Sequence[list[int]], samplings: list[SamplingParams],
                   form: fmt.Formatter) -> Any:
    expanded = [ids for ids in prompts for _ in range(req.n)]
    group = await submit(ctx, form.id, expanded, samplings, _CONSTRAINT_NAMES)
    prompt_tokens = sum(len(p) for p in prompts)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _events(group, form, prompt_tokens, req.n, include_usage)
        return stream_group(ctx, group, events)
    outs = await collect(request, ctx, group)
    return form.response(outs, fmt.usage(prompt_tokens, outs, req.n))


async def _events(group: RequestGroup, form: fmt.Formatter, prompt_tokens: int, n: int,
                  include_usage: bool) -> AsyncIterator[str]:
    extra = {"usage": None} if include_usage else {}
    for index in range(len(group.rids)):
        opening = form.opening_choice(index)
        if opening is not None:
            yield sse(form.chunk([opening]) | extra)
    finals: dict[int, RequestOutput] = {}
    async for index, out in group.stream():
        if out.finished:
            finals[index] = out
        for choice in form.stream_choices(index, out):
            yield sse(form.chunk([choice]) | extra)
    if include_usage:
        outs = [finals[i] for i in range(len(group.rids))]
        yield sse(form.chunk([]) | {"usage": fmt.usage(prompt_tokens, outs, n)})
    yield SSE_DONE
