"""OpenAI tool calling: the tool-call format per model family, the grammar that forces a
call (tool_choice "required" or a named function), and parsing replies, whole or
streamed, into OpenAI `tool_calls` (host only).

Formats, with the parser names SGLang (`--tool-call-parser`) and vLLM use for them:
- "hermes" (vLLM `hermes`, SGLang `qwen25`): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`, the format of Hermes/Qwen2.5 templates and SmolLM2's function
  calling. The default.
- "llama3" (vLLM `llama3_json`, SGLang `llama3`): `<|python_tag|>{"name": ...,
  "parameters": {...}}`, chosen when the chat template is Llama 3's.
A chat template that never reads `tools` (SmolLM2's) gets them in a system message that
describes the format, so the model is told which functions exist.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    name: str
    prefix: str  # opens each call
    suffix: str  # closes each call ("" when the JSON object ends it)
    args_key: str


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments")
LLAMA3 = ToolFormat("llama3", "<|python_tag|>", "", "parameters")
PARSER_NAMES = {"hermes": HERMES, "qwen25": HERMES, "llama3": LLAMA3, "llama3_json": LLAMA3}
_NAME_AND_ARGS = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|'
                            r'parameters)"\s*:\s*(?=\S)')


def tool_format(chat_template: str | None) -> ToolFormat:
    """The model family's format, read off its chat template."""
    if chat_template and "<|python_tag|>" in chat_template:
        return LLAMA3
    return HERMES


def template_reads_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def tools_system_prompt(tools: Sequence[dict[str, Any]], fmt: ToolFormat) -> str:
    """What a template without tool support is told (Hermes' wording, shortened)."""
    example = json.dumps({"name": "<function-name>", fmt.args_key: {"<arg>": "<value>"}})
    signatures = "\n".join(json.dumps(t) for t in tools)
    return ("You may call one or more functions to answer. The functions you can call are "
            f"within <tools></tools>:\n<tools>\n{signatures}\n</tools>\nTo call a function, "
            f"reply with:\n{fmt.prefix}{example}{fmt.suffix}")


def template_messages(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]],
                      fmt: ToolFormat) -> list[dict[str, Any]]:
    """Messages for a template that ignores tools: the tools in the system message,
    assistant tool_calls written out in the format, tool results as text."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            m["content"] = (m.get("content") or "") + "".join(
                fmt.prefix + json.dumps({"name": c["function"]["name"],
                                         fmt.args_key: json.loads(c["function"]["arguments"])})
                + fmt.suffix for c in calls)
        if m["role"] == "tool":
            m.pop("tool_call_id", None)
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    system = tools_system_prompt(tools, fmt)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{system}"
    else:
        out.insert(0, {"role": "system", "content": system})
    return out


def forced_call_grammar(tools: Sequence[dict[str, Any]], fmt: ToolFormat) -> str:
    """Lark grammar (llguidance) of exactly one call to one of `tools`, its arguments
    constrained by the tool's parameter schema."""
    calls = [{"type": "object", "additionalProperties": False,
              "required": ["name", fmt.args_key],
              "properties": {"name": {"const": t["function"]["name"]},
                             fmt.args_key: t["function"].get("parameters")
                             or {"type": "object"}}} for t in tools]
    schema = {"anyOf": calls, "x-guidance": {"whitespace_flexible": False,
                                             "item_separator": ", ", "key_separator": ": "}}
    suffix = f" {json.dumps(fmt.suffix)}" if fmt.suffix else ""
    return f"start: {json.dumps(fmt.prefix)} call{suffix}\ncall: %json {json.dumps(schema)}\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the first call or None, OpenAI tool_calls). Text that is not a
    well-formed call stays content, as vLLM's parsers leave it."""
    start = text.find(fmt.prefix)
    if start < 0:
        return text, []
    calls, rest = [], text[start:]
    decoder = json.JSONDecoder()
    while rest.startswith(fmt.prefix):
        try:
            obj, end = decoder.raw_decode(rest, len(fmt.prefix))
            name, args = obj["name"], obj.get(fmt.args_key, obj.get("arguments", {}))
        except (ValueError, KeyError, TypeError):
            return text, []
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args)}})
        rest = rest[end:]
        rest = rest[len(fmt.suffix):] if rest.startswith(fmt.suffix) else rest
        rest = rest.lstrip()
    content = text[:start].strip()
    return content or None, calls


class StreamingToolParser:
    """Turns the cumulative reply text into OpenAI chat deltas as it grows: content until
    a call opens, then per call one header delta (id, name) and argument fragments.

    Argument fragments are the raw text of the arguments object as generated, cut where
    that object closes, so the fragments of a call concatenate to its JSON arguments.
    """

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._content_sent = 0  # chars of text streamed as content
        self._calls: list[dict[str, Any]] = []  # per call: start, args_start, sent, done
        self.called = False

    def update(self, text: str, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        first = text.find(self.fmt.prefix)
        content_end = len(text) if first < 0 else first
        if first < 0 and not final:  # hold back what may become the opening of a call
            content_end = _safe_content_end(text, self.fmt.prefix)
        if content_end > self._content_sent and not self._calls:
            deltas.append({"content": text[self._content_sent:content_end]})
            self._content_sent = content_end
        if first >= 0:
            deltas += self._call_deltas(text, first)
        return deltas

    def _call_deltas(self, text: str, pos: int) -> list[dict[str, Any]]:
        deltas, decoder, index = [], json.JSONDecoder(), 0
        while pos >= 0:
            body = pos + len(self.fmt.prefix)
            head = _NAME_AND_ARGS.match(text, body)
            if head is None:
                break
            if index == len(self._calls):
                self._calls.append({"sent": head.end(), "done": False})
                self.called = True
                deltas.append({"tool_calls": [{"index": index, "id": new_call_id(),
                                               "type": "function", "function": {
                                                   "name": json.loads(f'"{head.group(1)}"'),
                                                   "arguments": ""}}]})
            call = self._calls[index]
            try:
                _, end = decoder.raw_decode(text, head.end())
                complete = True
            except ValueError:
                end, complete = len(text), False
            if end > call["sent"] and not call["done"]:
                deltas.append({"tool_calls": [{"index": index, "function": {
                    "arguments": text[call["sent"]:end]}}]})
                call["sent"] = end
            call["done"] = complete
            if not complete:
                break
            pos, index = text.find(self.fmt.prefix, end), index + 1
        return deltas


def _safe_content_end(text: str, prefix: str) -> int:
    """End of the text that cannot be the start of `prefix`."""
    for k in range(min(len(prefix) - 1, len(text)), 0, -1):
        if text.endswith(prefix[:k]):
            return len(text) - k
    return len(text)
