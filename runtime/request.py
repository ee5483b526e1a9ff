"""Requests: sampling parameters, finish reasons and the `Req` state machine (host only)."""

from __future__ import annotations

import dataclasses
import enum
import math
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from runtime.grammar import GrammarSpec

if TYPE_CHECKING:
    from runtime.grammar import RequestGrammar
    from runtime.prefix_cache import Node

MAX_NEW_TOKENS_LIMIT = 1 << 20
MAX_TOP_LOGPROBS = 20
# logit_bias entries per request: OpenAI's documented limit; the sampler's static width.
MAX_LOGIT_BIAS = 300
_CONSTRAINTS = ("json_schema", "regex", "ebnf")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, with SGLang's names and defaults.

    temperature 0 means greedy; top_k -1 means the whole vocabulary. `ignore_eos` ignores
    only the model's EOS ids: explicit `stop_token_ids` and `stop` strings still apply.
    At most one of `json_schema` (text), `regex` and `ebnf` constrains the output
    (runtime/grammar.py); `logit_bias` is (token id, bias) pairs added to the logits.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def grammar(self) -> GrammarSpec | None:
        for kind in _CONSTRAINTS:
            source = getattr(self, kind)
            if source is not None:
                return GrammarSpec(kind, source)  # type: ignore[arg-type]
        return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a JSON dict; unknown keys and a bare-string `stop` are handled here."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        d = dict(d)
        if isinstance(d.get("stop"), str):
            d["stop"] = (d["stop"],)
        if isinstance(d.get("logit_bias"), dict):
            d["logit_bias"] = tuple((int(k), float(v)) for k, v in d["logit_bias"].items())
        for key in ("stop", "stop_token_ids", "logit_bias"):
            if d.get(key) is None:
                d.pop(key, None)
            else:
                d[key] = tuple(d[key])
        return cls(**d)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first field that is out of range, and why."""
        first = next(self._problems(vocab_size), None)
        if first is not None:
            name, problem = first
            raise ValueError(f"sampling_params.{name}={getattr(self, name)!r}: {problem}")

    def _problems(self, vocab_size: int) -> Iterator[tuple[str, str]]:
        if not 0 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            yield "max_new_tokens", f"must be in [0, {MAX_NEW_TOKENS_LIMIT}]"
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            yield "temperature", "must be a finite number >= 0 (0 = greedy)"
        if not 0 < self.top_p <= 1:
            yield "top_p", "must be in (0, 1]"
        if self.top_k == 0 or self.top_k < -1:
            yield "top_k", "must be -1 (whole vocabulary) or >= 1"
        if not 0 <= self.min_p <= 1:
            yield "min_p", "must be in [0, 1]"
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                yield name, "must be in [-2, 2]"
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            yield "repetition_penalty", "must be a finite number > 0 (1 = off)"
        if any(not isinstance(s, str) or not s for s in self.stop):
            yield "stop", "stop strings must be non-empty strings"
        if any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            yield "stop_token_ids", f"every id must be in [0, vocab_size={vocab_size})"
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            yield "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]"
        given = [k for k in _CONSTRAINTS if getattr(self, k) is not None]
        if len(given) > 1:
            yield given[1], f"only one of {', '.join(_CONSTRAINTS)} may be set, got {given}"
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            yield "logit_bias", f"at most {MAX_LOGIT_BIAS} entries"
        if any(not 0 <= t < vocab_size for t, _ in self.logit_bias):
            yield "logit_bias", f"every token id must be in [0, vocab_size={vocab_size})"
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            yield "logit_bias", "every bias must be in [-100, 100]"


@dataclasses.dataclass(frozen=True)
class FinishReason:
    """Why a request ended. kind: "length", "stop" (matched a token id or string) or "abort"."""

    kind: str
    matched: int | str | None = None
    message: str = ""

    def trim(self, text: str) -> str:
        """Cut the output text before a matched stop string (the token stays in output_ids)."""
        if isinstance(self.matched, str):
            pos = text.find(self.matched)
            return text[:pos] if pos >= 0 else text
        return text

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.kind}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message:
            d["message"] = self.message
        return d


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Req:
    """One generation request, owned by the Scheduler.

    Token positions: the sequence is prompt_ids + output_ids, followed by `num_pending`
    tokens the device has sampled but the host has not read back yet (overlap mode). The
    KV of positions [0, kv_len) is written or in flight. While RUNNING the request holds
    `req_slot` and `pages` (pages[i] covers positions [i * page_size, (i + 1) * page_size)).
    A retracted request goes back to WAITING with pages and slot released but prompt and
    output kept; it resumes by prefilling prompt + output so far.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    req_slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    kv_len: int = 0
    # Tokens the current admission must prefill (prompt + output at admission time).
    fill_len: int = 0
    # Prefix-cache hit of the first admission, reported as meta_info.cached_tokens.
    cached_tokens: int = 0
    num_pending: int = 0
    num_retractions: int = 0
    finish_reason: FinishReason | None = None
    # Chosen-token logprob and (top ids, top logprobs) per output token, when requested.
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[tuple[list[int], list[float]]] = dataclasses.field(
        default_factory=list
    )
    # Prefix-cache node this request holds locked while running.
    prefix_node: Node | None = None
    # Sliding-window models (Scheduler._free_out_of_window): leading pages already checked
    # for falling out of the window, and the pages before the first one freed (None: none
    # freed), past which nothing of this admission may enter the prefix cache.
    window_checked_pages: int = 0
    cacheable_pages: int | None = None
    # Seed of the request's sampling randomness: the caller's seed, else a random one.
    rng_seed: int = -1
    # Split-prefill intervals its prefill (all chunks, all admissions) ran in.
    prefill_intervals: int = 0
    # The matcher of its output constraint, advanced by every token it keeps.
    grammar: RequestGrammar | None = None

    def __post_init__(self) -> None:
        if self.rng_seed < 0:
            seed = self.sampling.seed
            self.rng_seed = (seed if seed is not None else random.getrandbits(32)) & 0xFFFFFFFF

    @property
    def all_ids(self) -> list[int]:
        """Known tokens: prompt then output (excludes pending tokens)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_known(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, including pending ones."""
        return len(self.output_ids) + self.num_pending

    @property
    def is_prefilling(self) -> bool:
        return self.kv_len < self.fill_len

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def check_finished(
        self, eos_token_ids: frozenset[int], decode_fn: Callable[[list[int]], str] | None
    ) -> FinishReason | None:
        """Finish reason after the last output token, checked in SGLang's order; a grammar
        that refuses the token (a dead end) or has ended finishes the request first."""
        sp, tok = self.sampling, self.output_ids[-1]
        if self.grammar is not None:
            if not self.grammar.accept(tok):
                return FinishReason("abort", message=f"grammar dead end: {self.grammar.error}")
            if self.grammar.done:  # EOS taken, or nothing may follow: stop even if ignore_eos
                return FinishReason("stop", matched=tok if tok in eos_token_ids else None)
        if len(self.output_ids) >= sp.max_new_tokens:
            return FinishReason("length")
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in eos_token_ids):
            return FinishReason("stop", matched=tok)
        if sp.stop and decode_fn is not None:
            # A new match ends in the last token; a character can take up to 4 byte tokens.
            window = 4 * max(len(s) for s in sp.stop) + 4
            tail = decode_fn(self.output_ids[-window:])
            hits = [(tail.find(s), s) for s in sp.stop if s in tail]
            if hits:
                return FinishReason("stop", matched=min(hits)[1])
        return None
