"""Constrained decoding on the host (no jax): grammar specs, a compile cache, per-request
matchers and the per-row token bitmask the sampler applies.

The grammar engine is llguidance (framework-free Rust with numpy helpers; sglang-jax
uses it too). xgrammar, the other maintained engine, depends on torch and triton, which a
JAX server must not pull in (docs/structured_output.md has the numbers).

A constraint is compiled once per distinct spec into a template matcher (`GrammarCache`);
each request gets a deep copy (~20 us) that advances with its sampled tokens. Compiling
drops the GIL, so the HTTP front end compiles in a worker thread before it hands the
request to the engine thread, which then only ever hits the cache. The bitmask has one bit
per token id (`mask_width(vocab)` int32 words per row, llguidance's layout: bit i % 32 of
word i // 32); an unconstrained row is all ones (-1).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import llguidance

# llguidance is imported where a constraint is compiled or its mask filled, not here: the
# engine then runs unconstrained requests where it is not installed (the bare GPU machine
# of scripts/bench/gpu_suite.py).

GrammarKind = Literal["json_schema", "regex", "ebnf"]
# Compact JSON with json.dumps' separators: with flexible whitespace a small model can emit
# newlines forever inside an object and never close it.
_JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# OpenAI's response_format {"type": "json_object"}: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """A constraint that cannot compile; the message names the problem."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """One constraint as the client gave it: a JSON schema (text), a regex, or an EBNF
    grammar (GBNF as SGLang/xgrammar write it, or llguidance's Lark syntax)."""

    kind: GrammarKind
    source: str

    def to_llguidance(self) -> str:
        import llguidance

        try:
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    self.source, defaults=_JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            return llguidance.grammar_from("ebnf", self.source)
        except ValueError as e:  # not JSON, or GBNF that does not convert
            raise GrammarError(f"{self.kind}: {e}") from e


def mask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


class RequestGrammar:
    """One request's matcher: advanced by every token the request keeps."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Consume a sampled token; False if the grammar cannot take it (dead end)."""
        return self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar has ended (its text is complete and EOS was taken)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarCache:
    """Compiled grammars by spec (LRU), shared by every request; thread-safe.

    Two threads compiling the same new spec both compile it (the lock is not held while
    compiling, so one slow schema never blocks the others); the first result is kept.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 max_entries: int = 256) -> None:
        self._tokenizer_json, self._eos = tokenizer_json, list(eos_token_ids)
        self.vocab_size, self.max_entries = vocab_size, max_entries
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        # Built on first use (~0.5 s for a 49k vocabulary), not at start-up.
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos)
            return self._tokenizer

    def contains(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The template matcher of spec, compiled on a miss; GrammarError if it can't."""
        import llguidance

        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return template
        template = llguidance.LLMatcher(self._lltokenizer(), spec.to_llguidance(), log_level=0)
        if template.is_error():
            raise GrammarError(f"{spec.kind}: {template.get_error()}")
        with self._lock:
            self.misses += 1
            template = self._cache.setdefault(spec, template)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return template

    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        return RequestGrammar(self.compile(spec).deep_copy())


def fill_bitmask(grammars: Sequence[RequestGrammar | None], vocab_size: int) -> np.ndarray:
    """Bitmask [B, mask_width(vocab)] int32 of the tokens each row may sample next.

    None rows (unconstrained, padding) and rows whose grammar has already failed or ended
    allow everything: their token is either free or discarded when it is consumed.
    """
    mask = np.full((len(grammars), mask_width(vocab_size)), -1, np.int32)  # all ones
    for i, g in enumerate(grammars):
        if g is not None and not g.done and g.error is None:
            import llguidance.numpy as llnp

            llnp.fill_next_token_bitmask(g.matcher, mask, i)
            # A grammar that allows nothing is a dead end: the row samples freely and the
            # request ends when its grammar refuses that token (RequestGrammar.accept).
            if g.error is not None or not mask[i].any():
                mask[i] = -1
    return mask


def draft_bitmasks(grammar: RequestGrammar, draft: Sequence[int], vocab_size: int
                   ) -> np.ndarray:
    """Bitmask [len(draft) + 1, mask_width(vocab)] of a verify row's positions: what may
    follow the request's tokens, then each drafted prefix of them. The matcher consumes
    the draft and rolls it back (the caller keeps only drafts it validated)."""
    masks = np.empty((len(draft) + 1, mask_width(vocab_size)), np.int32)
    taken = 0
    for j in range(len(draft) + 1):
        masks[j] = fill_bitmask([grammar], vocab_size)[0]
        if j < len(draft):
            if not grammar.matcher.consume_token(draft[j]):
                masks[j + 1:] = -1  # unreachable: the draft was validated
                break
            taken += 1
    if taken:
        grammar.matcher.rollback(taken)
    return masks


def valid_draft(grammar: RequestGrammar, draft: list[int]) -> list[int]:
    """The longest prefix of `draft` the grammar accepts from its current state: a
    drafted token it refuses could never be sampled, so acceptance ends there."""
    if grammar.done or grammar.error is not None:
        return []
    return draft[:grammar.matcher.validate_tokens(draft)]


def schema_text(schema: object) -> str:
    """A JSON schema given as an object or as text, as compact text (the cache key)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from e
    if not isinstance(schema, dict | bool):
        raise GrammarError("json_schema must be a JSON object")
    # Key order kept: JSON output follows the order the schema lists its properties.
    return json.dumps(schema)
