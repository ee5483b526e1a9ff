"""Prompts, lengths and arrival times of the serving benchmark, all generated locally (no
dataset download), seeded.

- prompt kinds: random token ids (from 3 up: 0-2 are unk / bos / eos in SmolLM2's
  vocabulary; both xlaserve and llama-server accept id prompts), or random pseudo-words
  (text; its token count is the tokenizer's business, so `input_len` is approximate);
- length distributions: `fixed`; `random`, uniform in [ratio * L, L] (SGLang's
  --random-range-ratio); `sharegpt`, lognormal with mean L, the heavy right tail of
  ShareGPT conversations (a few long prompts and answers among many short ones);
- arrivals: Poisson at a request rate (exponential gaps), or all at once (rate inf);
- shared prefix: groups of requests whose prompts share a long prefix (the prefix cache).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from serving_client import RequestSpec

LENGTH_DISTS = ("fixed", "random", "sharegpt")
PROMPT_KINDS = ("ids", "words")
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pe", "da", "gu", "ri", "zo")
# ShareGPT's lengths spread about a lognormal with sigma ~1 for prompts and ~0.8 for
# answers; the mean is the flag, the shape is this.
_SIGMA = {"input": 1.0, "output": 0.8}


@dataclasses.dataclass(frozen=True)
class LengthSpec:
    input_len: int
    output_len: int
    dist: str = "fixed"
    range_ratio: float = 0.5
    max_input_len: int = 4096
    max_output_len: int = 1024

    def sample(self, rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
        ins = self._draw(rng, n, self.input_len, "input", self.max_input_len)
        outs = self._draw(rng, n, self.output_len, "output", self.max_output_len)
        return list(zip(ins, outs, strict=True))

    def _draw(self, rng: np.random.Generator, n: int, mean: int, kind: str,
              cap: int) -> list[int]:
        if self.dist == "fixed":
            x = np.full(n, mean)
        elif self.dist == "random":
            x = rng.integers(max(1, int(mean * self.range_ratio)), mean + 1, n)
        elif self.dist == "sharegpt":
            s = _SIGMA[kind]
            x = rng.lognormal(math.log(mean) - s * s / 2, s, n)  # mean of lognormal = mean
        else:
            raise ValueError(f"length distribution {self.dist!r} not in {LENGTH_DISTS}")
        return [int(v) for v in np.clip(np.rint(x), 2, cap)]


def random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, n).tolist()


def random_words(rng: np.random.Generator, n: int) -> str:
    words = ("".join(rng.choice(_SYLLABLES, rng.integers(1, 4))) for _ in range(n))
    return " ".join(words)


def make_prompt(rng: np.random.Generator, n: int, kind: str, vocab: int) -> list[int] | str:
    if kind == "ids":
        return random_ids(rng, n, vocab)
    if kind == "words":
        return random_words(rng, n)
    raise ValueError(f"prompt kind {kind!r} not in {PROMPT_KINDS}")


def requests(rng: np.random.Generator, lengths: LengthSpec, n: int, kind: str, vocab: int,
             tag: str = "") -> list[RequestSpec]:
    return [RequestSpec(make_prompt(rng, i, kind, vocab), i, o, tag)
            for i, o in lengths.sample(rng, n)]


def shared_prefix_requests(rng: np.random.Generator, groups: int, per_group: int,
                           prefix_len: int, suffix_len: int, output_len: int,
                           vocab: int) -> list[RequestSpec]:
    """groups x per_group id prompts: a group's prompts share their first prefix_len ids;
    the order is shuffled so a group's requests do not arrive back to back."""
    out = []
    for g in range(groups):
        prefix = random_ids(rng, prefix_len, vocab)
        out += [RequestSpec(prefix + random_ids(rng, suffix_len, vocab),
                            prefix_len + suffix_len, output_len, f"group{g}")
                for _ in range(per_group)]
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def poisson_offsets(rng: np.random.Generator, n: int, rate: float) -> list[float]:
    """Arrival times (s) of n requests at `rate` per second; inf: all at t = 0."""
    if math.isinf(rate):
        return [0.0] * n
    return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()
