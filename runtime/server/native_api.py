"""SGLang's native API: POST /generate.

A request is one prompt (`text` or `input_ids`) or a batch of them; each runs
`sampling_params.n` times. The reply is `{text, output_ids, meta_info}` for a single prompt
with n = 1, else a list in prompt-major order (prompt i, choice j at i * n + j). Streaming
sends SSE events with the cumulative text of one member (`index` says which) and ends with
`data: [DONE]`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from runtime.engine import RequestOutput
from runtime.request import SamplingParams
from runtime.server.engine_loop import RequestGroup
from runtime.server.errors import APIError, read_model
from runtime.server.protocol import GenerateRequest, NativeSampling
from runtime.server.serving import (
    SSE_DONE,
    ServerContext,
    check_prompt,
    check_sampling,
    collect,
    finite,
    new_id,
    sse,
    stream_group,
    submit,
)
from runtime.tokenizer import Tokenizer

router = APIRouter()

# SamplingParams field -> the name a /generate client wrote.
_NAMES = {f.name: f"sampling_params.{f.name}" for f in dataclasses.fields(SamplingParams)}
_NAMES |= {"seed": "sampling_params.sampling_seed", "top_logprobs": "top_logprobs_num",
           "logprobs": "return_logprob"}
_NAMES |= {k: f"sampling_params.{k}" for k in ("json_schema", "regex", "ebnf")}


@router.post("/generate")
async def generate(request: Request) -> Any:
    ctx: ServerContext = request.app.state.ctx
    req = await read_model(request, GenerateRequest)
    prompts, samplings, rids = _members(ctx, req)
    group = await submit(ctx, rids, prompts, samplings, _NAMES)
    single = not req.is_batch and len(prompts) == 1
    tok = ctx.tokenizer if req.return_text_in_logprobs else None
    if req.stream:
        return stream_group(ctx, group, _events(group, single, tok))
    items = [_item(o, tok) for o in await collect(request, ctx, group)]
    return JSONResponse(items[0] if single else items)


def _members(ctx: ServerContext, req: GenerateRequest
             ) -> tuple[list[list[int]], list[SamplingParams], list[str]]:
    """(prompt ids, sampling, request id) of every engine request, prompt-major."""
    if req.text is not None:
        texts = req.text if isinstance(req.text, list) else [req.text]
        prompts = [ctx.tokenizer.encode(t) for t in texts]
        param = "text"
    else:
        ids = req.input_ids or []
        prompts = ids if req.is_batch else [ids]  # type: ignore[assignment]
        param = "input_ids"
    if not prompts:
        raise APIError(400, f"{param}: the batch is empty", param=param, code="invalid_value")
    per_prompt = req.sampling_params
    if isinstance(per_prompt, NativeSampling):
        per_prompt = [per_prompt] * len(prompts)
    elif len(per_prompt) != len(prompts):
        raise APIError(400, f"sampling_params has {len(per_prompt)} entries for "
                       f"{len(prompts)} prompts", param="sampling_params", code="invalid_value")
    for name in ("rid", "return_logprob", "logprob_start_len", "top_logprobs_num"):
        value = getattr(req, name)
        if isinstance(value, list) and len(value) != len(prompts):
            raise APIError(400, f"{name} has {len(value)} entries for {len(prompts)} prompts",
                           param=name, code="invalid_value")
    out_prompts, out_sampling, out_rids = [], [], []
    for i, (ids, native) in enumerate(zip(prompts, per_prompt, strict=True)):
        logprobs = req.per_prompt("return_logprob", i)
        if logprobs and req.per_prompt("logprob_start_len", i) >= 0:
            raise APIError(400, "logprob_start_len >= 0 asks for prompt-token logprobs, which "
                           "this server does not compute; send -1 (output tokens only)",
                           param="logprob_start_len", code="unsupported_value")
        try:
            sp = native.to_params(logprobs, req.per_prompt("top_logprobs_num", i)
                                  if logprobs else 0)
        except ValueError as e:  # a schema that is not JSON, a bad logit_bias key
            raise APIError(400, str(e), code="invalid_value") from e
        check_sampling(ctx, sp, _NAMES)
        check_prompt(ctx, ids, sp.max_new_tokens, param, "sampling_params.max_new_tokens")
        rid = req.per_prompt("rid", i) or new_id("gen")
        for j in range(native.n):
            seed = None if sp.seed is None else sp.seed + j  # distinct but reproducible
            out_prompts.append(list(ids))
            out_sampling.append(dataclasses.replace(sp, seed=seed))
            # SGLang's rid names the request itself; n > 1 members get a suffix.
            out_rids.append(rid if native.n == 1 else f"{rid}-{j}")
    return out_prompts, out_sampling, out_rids


def _item(out: RequestOutput, tok: Tokenizer | None) -> dict[str, Any]:
    """SGLang's reply; logprob entries are (logprob, token id, token text or None), the
    text with return_text_in_logprobs."""
    meta: dict[str, Any] = {"id": out.rid, "finish_reason": None, **out.meta_info}

    def entry(lp: float, t: int) -> list[Any]:
        return [finite(lp), t, tok.decode([t], skip_special_tokens=False) if tok else None]

    if "output_token_logprobs" in meta:
        ids = out.output_ids
        meta["output_token_logprobs"] = [entry(lp, t) for lp, t in
                                         zip(meta["output_token_logprobs"], ids, strict=False)]
        meta["output_top_logprobs"] = [
            [entry(lp, t) for t, lp in zip(top_ids, lps, strict=True)]
            for top_ids, lps in meta["output_top_logprobs"]]
    return {"text": out.text, "output_ids": list(out.output_ids), "meta_info": meta}


async def _events(group: RequestGroup, single: bool, tok: Tokenizer | None
                  ) -> AsyncIterator[str]:
    async for index, out in group.stream():
        item = _item(out, tok)
        if not single:
            item["index"] = index
        yield sse(item)
    yield SSE_DONE
