"""Batched token sampler: one jitted trace serves any mix of per-request parameters.

Every sampling parameter is a per-row array in `SamplingBatch`, so parameter values are
data, not trace-time constants: a batch mixing greedy, temperature, top-k, top-p, min-p
and penalty rows runs one compiled program. Only the batch bucket and the static
arguments of `sample` (`num_top_logprobs`, `candidate_tiers`) select a trace.

Per row, in vLLM/SGLang order: logit bias and the grammar's token mask -> penalties ->
temperature -> top-k -> top-p -> min-p ->
categorical draw. Each filter becomes one cutoff value per row (keep scaled logits >=
cutoff), so tokens tied at a cutoff are all kept, as in vLLM. top-p keeps the shortest
head of the ranking whose mass reaches top_p (the token that crosses it included) and acts
on the distribution top-k leaves, renormalized (vLLM, HF); min-p is invariant to that.

Cost (2-vCPU CPU, B=32, V=49152): a full per-row sort takes ~270 ms (~70 ms on int32
keys), `lax.top_k` of 64 candidates ~2 ms. So exact top-k/top-p cutoffs are read from a
static ladder of candidate tiers (`candidate_tiers`, default 64 then 1024), each rung run
under `lax.cond` only if some row's cutoff lies beyond the previous one (top_k >= tier, or
a top-p nucleus of >= tier tokens); a full sort is the last rung. A batch with no
top-k/top-p row runs none of them, and an all-greedy batch (checked on the device, under
`lax.cond`) runs argmax alone; the general path gives greedy rows the same tokens.

Randomness: each row draws two uniforms from `fold_in(key(seed), step)`, where step is
the number of tokens the request has generated, and inverts its own CDF with them. A
row's token is therefore a function of its logits, parameters, seed and step alone:
never of the other rows, the batch size, or the row's position.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax import lax

# Temperatures below this are greedy (as SGLang's eps): dividing by them overflows f32.
GREEDY_TEMPERATURE = 1e-6
# Row scans (argmax, the categorical draw) run over block summaries, then inside one block:
# XLA's CPU argmax and cumsum over a whole 49152-long row are 5-10x slower than that.
_BLOCK = 256
# Column -> (neutral value, dtype). Neutral rows are greedy and unpenalized.
_COLUMNS: dict[str, tuple[float, type[np.generic]]] = {
    "temperature": (0.0, np.float32),
    "top_k": (0, np.int32),
    "top_p": (1.0, np.float32),
    "min_p": (0.0, np.float32),
    "frequency_penalty": (0.0, np.float32),
    "presence_penalty": (0.0, np.float32),
    "repetition_penalty": (1.0, np.float32),
    "seed": (0, np.uint32),
    "step": (0, np.int32),
    "logprobs": (False, np.bool_),
}
# 2-D columns [B, width]: the width is the caller's (0 = the feature is compiled out), the
# neutral value fills padding rows and missing columns. An all-ones row of the bitmask
# allows every token; a bias id of -1 is no entry (turned into V, which the scatter drops).
_WIDE_COLUMNS: dict[str, tuple[float, type[np.generic]]] = {
    "token_bitmask": (-1, np.int32),
    "bias_ids": (-1, np.int32),
    "bias_values": (0.0, np.float32),
}


@flax.struct.dataclass
class SamplingBatch:
    """Per-row sampling parameters; every field has shape [B].

    Every row is seeded: the host gives a request without a seed a random one (reduced
    to uint32) when it is admitted, so its tokens never depend on its batch.
    """

    temperature: jax.Array  # [B] f32, < GREEDY_TEMPERATURE = greedy
    top_k: jax.Array  # [B] i32, <= 0 or >= V = off
    top_p: jax.Array  # [B] f32, >= 1 = off
    min_p: jax.Array  # [B] f32, 0 = off
    frequency_penalty: jax.Array  # [B] f32, OpenAI: logit -= f * count in output
    presence_penalty: jax.Array  # [B] f32, OpenAI: logit -= p * (count in output > 0)
    repetition_penalty: jax.Array  # [B] f32, HF: seen logit > 0 -> / r, else * r; 1 = off
    seed: jax.Array  # [B] u32
    step: jax.Array  # [B] i32, tokens the request has generated so far
    logprobs: jax.Array  # [B] bool, the request wants logprobs (chosen and/or top-n)
    token_bitmask: jax.Array  # [B, W] i32, bit t % 32 of word t // 32: token t allowed
    bias_ids: jax.Array  # [B, K] i32, OpenAI logit_bias token ids; -1 = no entry
    bias_values: jax.Array  # [B, K] f32, added to those tokens' logits

    @classmethod
    def create(cls, batch_size: int, *, mask_width: int = 0, bias_slots: int = 0,
               **columns: npt.ArrayLike) -> SamplingBatch:
        """Host-side builder: given columns fill the first rows, the rest get neutral values.

        Rows past the given ones (bucket padding) are greedy, unpenalized and unconstrained.
        mask_width (words of the token bitmask) and bias_slots (logit-bias entries per row)
        are part of the trace: a runner passes the same ones every step.
        """
        unknown = sorted(set(columns) - set(_COLUMNS) - set(_WIDE_COLUMNS))
        if unknown:
            raise TypeError(f"unknown sampling columns: {unknown}")
        arrays = {}
        for name, (neutral, dtype) in _COLUMNS.items():
            given = np.asarray(columns.get(name, ()), dtype)
            if given.ndim != 1 or len(given) > batch_size:
                raise ValueError(f"{name}: expected at most {batch_size} rows, got {given.shape}")
            arrays[name] = np.full(batch_size, neutral, dtype)
            arrays[name][: len(given)] = given
        widths = {"token_bitmask": mask_width, "bias_ids": bias_slots, "bias_values": bias_slots}
        for name, (neutral, dtype) in _WIDE_COLUMNS.items():
            arrays[name] = np.full((batch_size, widths[name]), neutral, dtype)
            given = np.asarray(columns.get(name, np.zeros((0, widths[name]))), dtype)
            if given.ndim != 2 or len(given) > batch_size or given.shape[1] != widths[name]:
                raise ValueError(f"{name}: expected at most [{batch_size}, {widths[name]}], "
                                 f"got {given.shape}")
            arrays[name][: len(given)] = given
        return cls(**arrays)

    def to_words(self) -> np.ndarray:
        """Host side: every column in one int32 vector, in word_layout's order (f32 and
        u32 as their bit patterns, bool as 0/1): one host -> device transfer a step."""
        parts = []
        for name in (*_COLUMNS, *_WIDE_COLUMNS):
            a = np.asarray(getattr(self, name))
            parts.append((a.astype(np.int32) if a.dtype == np.bool_ else a).view(np.int32)
                         .ravel())
        return np.concatenate(parts)

    @classmethod
    def from_words(cls, words: jax.Array, batch_size: int, *, mask_width: int = 0,
                   bias_slots: int = 0) -> SamplingBatch:
        """to_words undone inside a trace: words [word_count] i32 -> the batch."""
        arrays = {}
        for name, (start, shape, dtype) in word_layout(batch_size, mask_width,
                                                       bias_slots).items():
            w = words[start:start + int(np.prod(shape))].reshape(shape)
            arrays[name] = (w != 0 if dtype == np.bool_ else w if dtype == np.int32
                            else lax.bitcast_convert_type(w, dtype))
        return cls(**arrays)


def word_layout(batch_size: int, mask_width: int = 0, bias_slots: int = 0
                ) -> dict[str, tuple[int, tuple[int, ...], type[np.generic]]]:
    """Column -> (first word, shape, dtype) in SamplingBatch.to_words's vector."""
    widths = {"token_bitmask": mask_width, "bias_ids": bias_slots, "bias_values": bias_slots}
    out, start = {}, 0
    for name, (_, dtype) in _COLUMNS.items():
        out[name] = (start, (batch_size,), dtype)
        start += batch_size
    for name, (_, dtype) in _WIDE_COLUMNS.items():
        out[name] = (start, (batch_size, widths[name]), dtype)
        start += batch_size * widths[name]
    return out


def word_count(batch_size: int, mask_width: int = 0, bias_slots: int = 0) -> int:
    """Length of SamplingBatch.to_words's vector."""
    return sum(int(np.prod(shape)) for _, shape, _ in
               word_layout(batch_size, mask_width, bias_slots).values())


@flax.struct.dataclass
class SampleOutput:
    """Sampled tokens and log-probabilities of the raw model distribution."""

    next_tokens: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32, log p(next_token) under the raw logits
    top_ids: jax.Array  # [B, n] i32, most likely tokens of the raw logits, best first
    top_logprobs: jax.Array  # [B, n] f32


def apply_penalties(
    logits: jax.Array,  # [B, V] f32
    params: SamplingBatch,
    token_counts: jax.Array,  # [B, V] i32, counts in the request's output so far
    prompt_mask: jax.Array,  # [B, V] bool, tokens in the prompt (output tokens optional)
) -> jax.Array:
    """Repetition, then frequency and presence penalties, in vLLM's order.

    Neutral values (r = 1, f = p = 0) leave a row bit-identical: x / 1, x * 1 and x - 0
    are exact in IEEE arithmetic.
    """
    # The repetition set is prompt | output; deriving the output part from the counts means
    # the caller only updates counts per step and sets the prompt mask once.
    seen = prompt_mask | (token_counts > 0)  # [B, V]
    rep = params.repetition_penalty[:, None]  # [B, 1]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - params.frequency_penalty[:, None] * token_counts  # [B, V]
    return logits - params.presence_penalty[:, None] * (token_counts > 0)  # [B, V]


@functools.partial(jax.jit, static_argnames=("num_top_logprobs", "candidate_tiers"))
def sample(
    logits: jax.Array,  # [B, V]
    params: SamplingBatch,
    token_counts: jax.Array,  # [S, V] i32, output-token counts per request slot
    prompt_mask: jax.Array,  # [S, V] bool, prompt tokens per request slot
    row_slots: jax.Array,  # [B] i32, each row's slot in token_counts / prompt_mask
    num_top_logprobs: int = 0,
    *,
    candidate_tiers: tuple[int, ...] = (64, 1024),
) -> SampleOutput:
    """Samples one token per row.

    Args:
      num_top_logprobs: static; the host slices each request's own count from it.
      candidate_tiers: static, increasing; candidate counts tried for the top-k/top-p
        cutoffs before a full sort. Any ladder gives the same tokens, only the cost moves.
    """
    logits = logits.astype(jnp.float32)
    constrained = constrain(logits, params)  # [B, V]
    # Most batches carry no penalty; skipping the pass saves gathering and reading two
    # [B, V] arrays. The rows' state is gathered inside the branch: gathered outside it, XLA
    # CPU gathered it every step (4.5 ms of a 45 ms B=32 bf16 decode step on 2 cores).
    penalized = lax.cond(
        jnp.any(
            (params.repetition_penalty != 1.0)
            | (params.frequency_penalty != 0.0)
            | (params.presence_penalty != 0.0)
        ),
        lambda: apply_penalties(constrained, params, token_counts[row_slots],
                                prompt_mask[row_slots]),
        lambda: constrained,
    )  # [B, V]
    # Picked at run time, so one executable serves both: start-up compiles no greedy-only
    # twin (B=32 on 2 CPU cores: argmax 3.9 ms, the general path 7.8 ms).
    tokens = lax.cond(jnp.all(params.temperature < GREEDY_TEMPERATURE),
                      lambda: _argmax(penalized),
                      lambda: _sample_rows(penalized, params, candidate_tiers))  # [B]
    # Logprobs describe the raw model distribution (vLLM's default "raw_logprobs"), before
    # bias, grammar mask, penalties, temperature and filters, so they do not move with
    # sampling parameters.
    # Computed only when some row asks (zeros otherwise): the log-sum-exp and top-n pass
    # over [B, V] cost 1.3-3.7 ms of a B=32 step on 2 CPU cores (more with top-n).
    b, n = logits.shape[0], num_top_logprobs

    def raw_logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
        lse = jax.nn.logsumexp(logits, axis=-1)  # [B]
        chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse  # [B]
        top_values, top_ids = lax.top_k(logits, n)  # [B, n], ties -> lowest id
        return chosen, top_ids, top_values - lse[:, None]

    def none() -> tuple[jax.Array, jax.Array, jax.Array]:
        return (jnp.zeros(b, jnp.float32), jnp.zeros((b, n), jnp.int32),
                jnp.zeros((b, n), jnp.float32))

    chosen, top_ids, top_logprobs = lax.cond(jnp.any(params.logprobs), raw_logprobs, none)
    return SampleOutput(tokens, chosen, top_ids, top_logprobs)


def constrain(logits: jax.Array, params: SamplingBatch) -> jax.Array:
    """Logit bias, then the token bitmask (disallowed tokens -> -inf): [B, V] -> [B, V].

    Each pass runs only when some row uses it (`lax.cond`), so unconstrained batches pay
    for neither; a width of 0 compiles the pass out. A masked logit stays -inf through
    penalties and temperature, so no later filter can bring it back.
    """
    b, vocab = logits.shape
    if params.bias_ids.shape[1]:
        ids = jnp.where(params.bias_ids < 0, vocab, params.bias_ids)  # [B, K]
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)  # [B, K]
        logits = lax.cond(jnp.any(params.bias_values != 0),
                          lambda: logits.at[rows, ids].add(params.bias_values, mode="drop"),
                          lambda: logits)
    if params.token_bitmask.shape[1]:
        def masked() -> jax.Array:
            bits = (params.token_bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
            allowed = bits.reshape(b, -1)[:, :vocab] != 0  # [B, V]
            return jnp.where(allowed, logits, -jnp.inf)

        logits = lax.cond(jnp.any(params.token_bitmask != -1), masked, lambda: logits)
    return logits


@functools.partial(jax.jit, donate_argnums=0)
def update_token_counts(
    counts: jax.Array,  # [S, V] i32, output token counts per request slot
    slots: jax.Array,  # [B] i32, slot of each row; >= S (bucket padding) is ignored
    tokens: jax.Array,  # [B] i32, the tokens just sampled
) -> jax.Array:
    """Adds each row's sampled token to its slot's counts in place (counts is donated)."""
    # mode="drop" discards out-of-range slots; negative slots would wrap, so pad with S.
    return counts.at[slots, tokens].add(1, mode="drop")  # [S, V]


def _sample_rows(
    logits: jax.Array, params: SamplingBatch, candidate_tiers: tuple[int, ...]
) -> jax.Array:
    """Temperature, filters and the seeded draw for penalized logits [B, V] -> tokens [B]."""
    greedy = params.temperature < GREEDY_TEMPERATURE  # [B]
    weights = _kept_weights(logits, params, candidate_tiers)  # [B, V]
    u = jax.vmap(_row_uniforms)(params.seed, params.step)  # [B, 2]
    # u = 0 draws the first kept token: for greedy rows the lowest id among tied maxima.
    return _categorical(weights, jnp.where(greedy[:, None], 0.0, u))


def _kept_weights(
    logits: jax.Array, params: SamplingBatch, candidate_tiers: tuple[int, ...]
) -> jax.Array:
    """Unnormalized probabilities [B, V] of the tokens temperature, top-k, top-p and min-p
    keep (a greedy row keeps its maxima only)."""
    greedy = params.temperature < GREEDY_TEMPERATURE  # [B]
    scaled = logits / jnp.where(greedy, 1.0, params.temperature)[:, None]  # [B, V]
    row_max = scaled.max(axis=-1)  # [B]
    cutoff = _top_k_top_p_cutoff(scaled, row_max, params, ~greedy, candidate_tiers)  # [B]
    # min-p keeps p >= min_p * p_max, i.e. scaled >= max + log(min_p): no sort needed.
    cutoff = jnp.maximum(cutoff, row_max + jnp.log(jnp.maximum(params.min_p, 0.0)))  # [B]
    # Clamping to the max keeps the top token even for min_p > 1; greedy keeps only the max.
    cutoff = jnp.where(greedy, row_max, jnp.minimum(cutoff, row_max))  # [B]
    return jnp.where(scaled >= cutoff[:, None], jnp.exp(scaled - row_max[:, None]), 0.0)


def kept_probs(logits: jax.Array, params: SamplingBatch,
               candidate_tiers: tuple[int, ...] = (64, 1024)) -> jax.Array:
    """The distribution `sample` draws a row's token from, [B, V] -> [B, V] summing to 1 per
    row: bias and mask, temperature, top-k, top-p, min-p. No penalties (rows that
    speculate have none)."""
    w = _kept_weights(constrain(logits.astype(jnp.float32), params), params,
                      candidate_tiers)  # [B, V]
    return w / w.sum(axis=-1, keepdims=True)


def draft_sample(logits: jax.Array, params: SamplingBatch, stochastic: jax.Array,
                 candidate_tiers: tuple[int, ...] = (64, 1024)) -> tuple[jax.Array, jax.Array]:
    """A draft model's token per row and the distribution q it was drawn from: stochastic
    rows [B] draw from kept_probs with uniforms of their own stream (_draft_uniforms), the
    others take the argmax of the raw logits (q unused: zeros). -> tokens [B], q [B, V]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]

    def drawn() -> tuple[jax.Array, jax.Array]:
        q = kept_probs(logits, params, candidate_tiers)  # [B, V]
        u = jax.vmap(lambda s, t: _stream_uniforms(s, t, _DRAFT_STREAM, 2))(
            params.seed, params.step)  # [B, 2]
        return jnp.where(stochastic, _categorical(q, u), greedy), q

    return lax.cond(jnp.any(stochastic), drawn,
                    lambda: (greedy, jnp.zeros(logits.shape, jnp.float32)))


def verify_draft(logits: jax.Array, params: SamplingBatch, q: jax.Array, drafts: jax.Array,
                 candidate_tiers: tuple[int, ...] = (64, 1024)) -> jax.Array:
    """The standard speculative rejection rule per row: draft x, drawn from q [B, V], is
    kept with probability min(1, p(x) / q(x)) (p = kept_probs of the target's logits
    [B, V]); otherwise the token is drawn from norm(max(0, p - q)). Either way the token
    is distributed as p. Uniforms come from a stream of their own (_VERIFY_STREAM), so
    they are independent of the draw of x. -> tokens [B]."""
    p = kept_probs(logits, params, candidate_tiers)  # [B, V]
    px = jnp.take_along_axis(p, drafts[:, None], axis=-1)[:, 0]  # [B]
    qx = jnp.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]  # [B]
    u = jax.vmap(lambda s, t: _stream_uniforms(s, t, _VERIFY_STREAM, 3))(
        params.seed, params.step)  # [B, 3]
    accept = u[:, 0] * qx < px  # [B]: u < p / q without dividing by q
    residual = jnp.maximum(p - q, 0.0)  # [B, V]
    # All zero only where p <= q everywhere, i.e. p == q: then every draft is kept.
    residual = jnp.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p)
    return jnp.where(accept, drafts, _categorical(residual, u[:, 1:]))


def _top_k_top_p_cutoff(
    scaled: jax.Array,  # [B, V] temperature-scaled logits
    row_max: jax.Array,  # [B]
    params: SamplingBatch,
    sampled: jax.Array,  # [B] bool, rows that are not greedy
    candidate_tiers: tuple[int, ...],
) -> jax.Array:
    """Smallest scaled logit that top-k then top-p keep per row; -inf where both are off."""
    vocab = scaled.shape[-1]
    top_k_on = (params.top_k > 0) & (params.top_k < vocab)  # [B]
    active = sampled & (top_k_on | (params.top_p < 1.0))  # [B]

    def tiered() -> jax.Array:
        # Mass of the whole row, for top-p without top-k.
        total = jnp.exp(scaled - row_max[:, None]).sum(axis=-1)  # [B]
        filters = _Filters(scaled, total, row_max, params, top_k_on)
        return _tiered_cutoff(filters, active, candidate_tiers)

    no_cutoff = jnp.full_like(row_max, -jnp.inf)  # [B]
    cutoff = lax.cond(jnp.any(active), tiered, lambda: no_cutoff)  # [B]
    return jnp.where(active, cutoff, -jnp.inf)


class _Filters(NamedTuple):
    """What the top-k/top-p cutoff of a row depends on, bundled for the tier recursion."""

    scaled: jax.Array  # [B, V]
    total: jax.Array  # [B] mass of the whole row
    row_max: jax.Array  # [B]
    params: SamplingBatch
    top_k_on: jax.Array  # [B] bool


def _tiered_cutoff(filters: _Filters, pending: jax.Array, tiers: tuple[int, ...]) -> jax.Array:
    """Cutoffs [B] for the pending rows [B] from the cheapest tier that determines them.

    Tier i reads the top tiers[i] candidates; past the last tier comes a full sort. Each
    further tier runs only if some row needs it (`lax.cond`), and a row keeps the result
    of the first tier that resolves it, which depends on that row alone.
    """
    vocab = filters.scaled.shape[-1]
    if not tiers or tiers[0] >= vocab:
        return _cutoff_from_sorted(_sort_descending(filters.scaled), filters)[0]
    candidates = lax.top_k(filters.scaled, tiers[0])[0]  # [B, C] descending
    cutoff, resolved = _cutoff_from_sorted(candidates, filters)  # [B], [B]
    return lax.cond(
        jnp.all(resolved | ~pending),
        lambda: cutoff,
        lambda: jnp.where(
            resolved, cutoff, _tiered_cutoff(filters, pending & ~resolved, tiers[1:])
        ),
    )


def _cutoff_from_sorted(
    descending: jax.Array,  # [B, C] the C largest scaled logits per row, best first
    filters: _Filters,
) -> tuple[jax.Array, jax.Array]:
    """Top-k then top-p cutoff [B], and whether the C candidates determine it exactly [B]."""
    params, top_k_on = filters.params, filters.top_k_on
    n = descending.shape[-1]
    k_index = jnp.minimum(params.top_k, n)[:, None] - 1  # [B, 1]
    k_value = jnp.take_along_axis(descending, jnp.maximum(k_index, 0), axis=-1)[:, 0]  # [B]
    k_cut = jnp.where(top_k_on, k_value, -jnp.inf)  # [B]
    in_top_k = descending >= k_cut[:, None]  # [B, C]
    w = jnp.where(in_top_k, jnp.exp(descending - filters.row_max[:, None]), 0.0)  # [B, C]
    # The top-k set lies inside the candidates whenever the row is resolved (checked below).
    mass = jnp.where(top_k_on, w.sum(axis=-1), filters.total)  # [B]
    above = jnp.cumsum(w, axis=-1) - w  # [B, C] kept mass ranked above each candidate
    top_p = params.top_p[:, None]  # [B, 1]
    in_top_p = (above < top_p * mass[:, None]) | (top_p >= 1.0)  # [B, C]
    # Both sets are prefixes of the ranking; the most likely token always survives.
    n_keep = jnp.maximum(jnp.sum(in_top_k & in_top_p, axis=-1), 1)  # [B]
    cutoff = jnp.take_along_axis(descending, n_keep[:, None] - 1, axis=-1)[:, 0]  # [B]
    # Exact only if the kept prefix and the top-k set both end before the last candidate.
    resolved = (n_keep < n) & (~top_k_on | (jnp.sum(in_top_k, axis=-1) < n))  # [B]
    return cutoff, resolved


def _sort_descending(x: jax.Array) -> jax.Array:
    """Per-row descending sort of f32 [B, V].

    Sorting the bit patterns as int32 is ~4x faster than a float sort on CPU. Flipping
    the magnitude bits of negative floats makes integer order equal float order, and the
    flip is its own inverse.
    """
    bits = lax.bitcast_convert_type(x, jnp.int32)  # [B, V]
    magnitude = jnp.int32(0x7FFFFFFF)
    keys = lax.sort(bits ^ ((bits >> 31) & magnitude), dimension=1, is_stable=False)  # [B, V]
    return lax.bitcast_convert_type(keys ^ ((keys >> 31) & magnitude), jnp.float32)[:, ::-1]


def _row_uniforms(seed: jax.Array, step: jax.Array) -> jax.Array:
    """Two uniforms in [0, 1) that depend only on (seed, step)."""
    return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), step), (2,))


# fold_in streams of a speculative position's randomness beside the plain draw's (which
# keys fold_in(key(seed), step) itself): the draft's draw, the verify step's acceptance
# and residual draw.
_DRAFT_STREAM, _VERIFY_STREAM = 1, 2


def _stream_uniforms(seed: jax.Array, step: jax.Array, stream: int, n: int) -> jax.Array:
    """n uniforms in [0, 1) that depend only on (seed, step, stream)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), stream)
    return jax.random.uniform(key, (n,))


def _blocks(x: jax.Array, fill: float) -> jax.Array:
    """[B, V] -> [B, NB, _BLOCK], the last block padded with `fill`."""
    batch, vocab = x.shape
    padded = jnp.pad(x, ((0, 0), (0, -vocab % _BLOCK)), constant_values=fill)  # [B, NB * _BLOCK]
    return padded.reshape(batch, -1, _BLOCK)


def _argmax(x: jax.Array) -> jax.Array:
    """First index of each row's maximum, [B, V] -> [B] i32 (ties -> lowest id)."""
    blocks = _blocks(x, -jnp.inf)  # [B, NB, _BLOCK]
    block = jnp.argmax(blocks.max(axis=-1), axis=-1)  # [B] first block holding the max
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, _BLOCK]
    return (block * _BLOCK + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def _categorical(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Exact draw from unnormalized weights [B, V] with uniforms u [B, 2] -> ids [B]."""
    blocks = _blocks(weights, 0.0)  # [B, NB, _BLOCK]
    # P(block) * P(token | block) = P(token), with one independent uniform per level.
    block = _inverse_cdf(blocks.sum(axis=-1), u[:, 0])  # [B]
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, _BLOCK]
    return block * _BLOCK + _inverse_cdf(inside, u[:, 1])


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """First index whose cumulative weight exceeds u * total: [B, N], [B] -> [B] i32."""
    cum = jnp.cumsum(weights, axis=-1)  # [B, N]
    total = cum[:, -1:]  # [B, 1]
    # Strictly below the total, the first index past the target always has positive weight
    # (zero weights repeat the previous cumulative value and can never be first past it).
    target = jnp.minimum(u[:, None] * total, jnp.nextafter(total, 0.0))  # [B, 1]
    return jnp.sum(cum <= target, axis=-1, dtype=jnp.int32)
