"""OpenAI response bodies built from engine outputs: choices, chunks, logprobs, usage."""

from __future__ import annotations

import itertools
import time
from typing import Any

from runtime.engine import RequestOutput
from runtime.server.serving import finite
from runtime.tokenizer import Tokenizer
from runtime.tool_calls import StreamingToolParser, ToolFormat, parse_calls


def finish_reason(out: RequestOutput) -> str | None:
    """"stop", "length", or "abort" (SGLang's name for a request ended by the server)."""
    if not out.finished:
        return None
    return (out.meta_info.get("finish_reason") or {}).get("type", "abort")


def usage(prompt_tokens: int, outs: list[RequestOutput], n: int) -> dict[str, Any]:
    """Each prompt counted once (cached tokens from its first choice), every choice's output."""
    completion = sum(len(o.output_ids) for o in outs)
    cached = sum(o.meta_info.get("cached_tokens", 0) for o in outs[::n])
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Formatter:
    """Shared shape of a completion or chat reply; subclasses fill in the choices."""

    object_name = ""
    chunk_object = ""

    def __init__(self, response_id: str, model: str, tokenizer: Tokenizer, logprobs: bool,
                 top_logprobs: int) -> None:
        self.id, self.model, self._tok = response_id, model, tokenizer
        self.logprobs, self.top_logprobs = logprobs, top_logprobs
        self.created = int(time.time())

    def response(self, outs: list[RequestOutput], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": [self.final_choice(i, o)
                                                 for i, o in enumerate(outs)],
                "usage": usage}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": choices}

    def opening_choice(self, index: int) -> dict[str, Any] | None:
        return None

    def stream_choice(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        raise NotImplementedError

    def stream_choices(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The choices to stream for one engine output (tool calls may need several)."""
        choice = self.stream_choice(index, out)
        return [] if choice is None else [choice]

    def final_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        raise NotImplementedError

    def _token(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def _token_logprobs(self, out: RequestOutput) -> list[tuple[int, float, list]]:
        """(token id, its logprob, [(top id, logprob), ...]) per output token."""
        meta = out.meta_info
        chosen = meta.get("output_token_logprobs", [])
        tops = meta.get("output_top_logprobs", [])
        return [(t, finite(lp), list(zip(ids, map(finite, lps), strict=True))[:self.top_logprobs])
                for t, lp, (ids, lps) in zip(out.output_ids, chosen, tops, strict=False)]


class CompletionFormat(Formatter):
    object_name = chunk_object = "text_completion"

    def final_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        return {"index": index, "text": out.text, "logprobs": self._logprobs(out),
                "finish_reason": finish_reason(out)}

    def stream_choice(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        if not out.finished and not out.delta:
            return None
        return {"index": index, "text": out.delta,
                "logprobs": self._logprobs(out) if out.finished else None,
                "finish_reason": finish_reason(out)}

    def _logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        entries = self._token_logprobs(out)
        tokens = [self._token(t) for t, _, _ in entries]
        offsets = list(itertools.accumulate((len(s) for s in tokens[:-1]), initial=0))
        top = [{self._token(i): lp for i, lp in alts} for _, _, alts in entries]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": top if self.top_logprobs else None,
                "text_offset": offsets if tokens else []}


class ChatFormat(Formatter):
    """Chat replies; with `tools` (a ToolFormat) replies are parsed for tool calls, which
    become `tool_calls` and finish_reason "tool_calls"."""

    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolFormat | None = None) -> None:
        super().__init__(*args)
        self.tools = tools
        self._parsers: dict[int, StreamingToolParser] = {}

    def final_choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        reason = finish_reason(out)
        if self.tools is not None:
            content, calls = parse_calls(out.text, self.tools)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message, "logprobs": self._logprobs(out),
                "finish_reason": reason}

    def stream_choices(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        if self.tools is None:
            return super().stream_choices(index, out)
        parser = self._parsers.setdefault(index, StreamingToolParser(self.tools))
        choices = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None}
                   for d in parser.update(out.text, out.finished)]
        if out.finished:
            reason = finish_reason(out)
            choices.append({"index": index, "delta": {}, "logprobs": self._logprobs(out),
                            "finish_reason": "tool_calls" if parser.called and reason == "stop"
                            else reason})
        return choices

    def opening_choice(self, index: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def stream_choice(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        if not out.finished and not out.delta:
            return None
        return {"index": index, "delta": {"content": out.delta} if out.delta else {},
                "logprobs": self._logprobs(out) if out.finished else None,
                "finish_reason": finish_reason(out)}

    def _logprobs(self, out: RequestOutput) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": [self._entry(t, lp) | {"top_logprobs": [self._entry(i, v)
                                                                   for i, v in alts]}
                            for t, lp, alts in self._token_logprobs(out)], "refusal": None}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
