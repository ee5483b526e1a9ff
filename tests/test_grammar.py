"""Host-only tests (no jax): grammar specs and their cache, row bitmasks, a grammar's
dead end and completion as finish reasons, and tool-call formats and parsers."""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys

import numpy as np
import pytest

from runtime import tool_calls as tc
from runtime.checkpoint import default_gguf_path
from runtime.grammar import GrammarCache, GrammarError, GrammarSpec, fill_bitmask, schema_text
from runtime.request import Req, SamplingParams
from runtime.tokenizer import Tokenizer

EOS = 2


@functools.cache
def _tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path())


@functools.cache
def _cache() -> GrammarCache:
    return GrammarCache(_tok().backend.to_str(), 49152, [EOS])


def _ids(text: str) -> list[int]:
    return _tok().encode(text, add_special_tokens=False)


def _allowed(mask_row: np.ndarray, token: int) -> bool:
    return bool((mask_row[token // 32] >> (token % 32)) & 1)


def test_host_modules_do_not_import_jax():
    code = ("import sys, runtime.grammar, runtime.tool_calls, runtime.request, "
            "runtime.scheduler; assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_json_schema_walk_allows_exactly_the_grammar():
    schema = schema_text({"type": "object", "properties": {"ok": {"type": "boolean"}},
                          "required": ["ok"], "additionalProperties": False})
    g = _cache().matcher(GrammarSpec("json_schema", schema))
    for t in _ids('{"ok": true}'):
        mask = fill_bitmask([g, None], 49152)
        assert _allowed(mask[0], t) and (mask[1] == -1).all()
        assert g.accept(t)
    if not g.done:  # the object may end the grammar by itself, else only EOS may follow
        mask = fill_bitmask([g], 49152)
        assert _allowed(mask[0], EOS) and np.unpackbits(mask.view(np.uint8)).sum() == 1
        assert g.accept(EOS)
    assert g.done


def test_cache_compiles_each_spec_once_and_copies_per_request():
    cache = GrammarCache(_tok().backend.to_str(), 49152, [EOS])
    spec = GrammarSpec("regex", "(yes|no)")
    a, b = cache.matcher(spec), cache.matcher(spec)
    assert (cache.misses, cache.hits) == (1, 1)
    assert a.accept(_ids("yes")[0])
    assert not b.matcher.is_stopped() and b.accept(_ids("no")[0])  # b's state is its own


@pytest.mark.parametrize(("kind", "source", "problem"), [
    ("regex", "(abc", "unclosed group"),
    ("json_schema", '{"type": "foo"}', "foo"),
    ("ebnf", "root ::= undefined_rule", "undefined_rule"),
])
def test_bad_grammar_names_the_problem(kind, source, problem):
    with pytest.raises(GrammarError, match=problem):
        _cache().compile(GrammarSpec(kind, source))


def test_schema_text_keeps_property_order_and_is_checked():
    assert schema_text('{"b": 1,  "a": 2}') == schema_text({"b": 1, "a": 2}) == '{"b": 1, "a": 2}'
    with pytest.raises(GrammarError, match="not valid JSON"):
        schema_text("{nope")


def test_dead_end_and_completion_are_finish_reasons():
    sp = SamplingParams(regex="ab", max_new_tokens=10)
    dead = Req("r0", [1], sp, grammar=_cache().matcher(sp.grammar))
    dead.output_ids.append(_ids("zz")[0])  # sampled where the grammar allows nothing else
    reason = dead.check_finished(frozenset([EOS]), None)
    assert reason.kind == "abort" and "grammar dead end" in reason.message
    done = Req("r1", [1], dataclasses.replace(sp, ignore_eos=True),
               grammar=_cache().matcher(sp.grammar))
    for t in _ids("ab") + [EOS]:
        done.output_ids.append(t)
        reason = done.check_finished(frozenset([EOS]), None)
    assert reason is not None and reason.kind == "stop"  # even with ignore_eos


def test_sampling_params_constraint_and_bias_checks():
    with pytest.raises(ValueError, match="only one of"):
        SamplingParams(regex="a", ebnf='root ::= "a"').validate(100)
    with pytest.raises(ValueError, match=r"logit_bias.*\[-100, 100\]"):
        SamplingParams(logit_bias=((1, 101.0),)).validate(100)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingParams.from_dict({"logit_bias": {"100": 1.0}}).validate(100)


# ---- tool calls --------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
         {"type": "function", "function": {"name": "g"}}]


@pytest.mark.parametrize("fmt", [tc.HERMES, tc.LLAMA3], ids=lambda f: f.name)
def test_forced_call_grammar_accepts_a_call_and_nothing_else(fmt):
    grammar = tc.forced_call_grammar(TOOLS, fmt)
    text = fmt.prefix + json.dumps({"name": "f", fmt.args_key: {"x": 3}}) + fmt.suffix
    g = _cache().matcher(GrammarSpec("ebnf", grammar))
    for t in _ids(text):
        assert g.accept(t), (text, g.error)
    assert g.accept(EOS) and g.done
    bad = _cache().matcher(GrammarSpec("ebnf", grammar))
    assert not all(bad.accept(t) for t in _ids(fmt.prefix + '{"name": "h"'))
    content, calls = tc.parse_calls(text, fmt)
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"x": 3}'}


def test_parse_leaves_malformed_calls_as_content():
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": '
    assert tc.parse_calls(text, tc.HERMES) == (text, [])
    assert tc.parse_calls("plain", tc.HERMES) == ("plain", [])


def test_streaming_parser_deltas_rebuild_the_calls():
    text = ('I will call. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    parser = tc.StreamingToolParser(tc.HERMES)
    deltas = [d for i in range(1, len(text) + 1) for d in parser.update(text[:i], i == len(text))]
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "I will call. "
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"name": None, "arguments": ""})
            if "id" in c:
                entry["name"] = c["function"]["name"]
            entry["arguments"] += c["function"]["arguments"]
    assert calls == {0: {"name": "f", "arguments": '{"x": 1}'},
                     1: {"name": "g", "arguments": "{}"}}
    assert parser.called


def test_templates_without_tool_support_get_a_tool_system_prompt():
    assert tc.tool_format(_tok().chat_template) is tc.HERMES
    assert not tc.template_reads_tools(_tok().chat_template)
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                   "name": "f", "arguments": '{"x": 1}'}}]},
               {"role": "tool", "tool_call_id": "c", "content": "42"}]
    msgs = tc.template_messages(history, TOOLS, tc.HERMES)
    assert msgs[0]["role"] == "system" and '"name": "f"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert msgs[3]["content"] == "<tool_response>\n42\n</tool_response>"
    _tok().apply_chat_template(msgs)  # renders
