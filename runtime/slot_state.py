"""Per-request device state of the sampler (one slot per running request) and the
per-row sampling columns the host packs for each step."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from runtime.grammar import fill_bitmask
from runtime.request import MAX_LOGIT_BIAS
from runtime.schedule_batch import BatchRow


@struct.dataclass
class SlotState:
    """Per-request device state, indexed by req_slot; the last slot absorbs padding rows."""

    last_tokens: jax.Array   # [S + 1] int32: token each slot sampled last (overlap inputs)
    token_counts: jax.Array  # [S + 1, V] int32: output-token counts (all three penalties)
    prompt_mask: jax.Array   # [S + 1, V] bool: prompt tokens (repetition penalty)


def sampling_columns(rows: Sequence[BatchRow | None]) -> dict[str, np.ndarray]:
    """Per-row sampling parameters; padding rows (None) are greedy and unpenalized."""
    cols: dict[str, list] = {k: [] for k in (
        "temperature", "top_k", "top_p", "min_p", "frequency_penalty", "presence_penalty",
        "repetition_penalty", "seed", "step", "logprobs")}
    for r in rows:
        sp = r.req.sampling if r is not None else None
        cols["temperature"].append(sp.temperature if sp else 0.0)
        cols["top_k"].append(sp.top_k if sp else -1)
        cols["top_p"].append(sp.top_p if sp else 1.0)
        cols["min_p"].append(sp.min_p if sp else 0.0)
        cols["frequency_penalty"].append(sp.frequency_penalty if sp else 0.0)
        cols["presence_penalty"].append(sp.presence_penalty if sp else 0.0)
        cols["repetition_penalty"].append(sp.repetition_penalty if sp else 1.0)
        cols["seed"].append(r.req.rng_seed if r is not None else 0)
        # The sampled token's position keys the row's randomness: the same request draws
        # the same token whatever its batch, bucket or overlap setting.
        cols["step"].append(r.end_pos if r is not None else 0)
        cols["logprobs"].append(bool(sp and (sp.logprobs or sp.top_logprobs)))
    return {k: np.asarray(v) for k, v in cols.items()}


def constraint_columns(rows: Sequence[BatchRow | None], vocab_size: int
                       ) -> dict[str, np.ndarray]:
    """Each row's token bitmask (from its grammar's current state: call it once the
    request's previous token is consumed) and its logit-bias entries."""
    ids = np.full((len(rows), MAX_LOGIT_BIAS), -1, np.int32)
    values = np.zeros((len(rows), MAX_LOGIT_BIAS), np.float32)
    for i, r in enumerate(rows):
        bias = r.req.sampling.logit_bias if r is not None else ()
        if bias:
            ids[i, :len(bias)] = [t for t, _ in bias]
            values[i, :len(bias)] = [b for _, b in bias]
    grammars = [r.req.grammar if r is not None and not r.req.finished else None for r in rows]
    return {"token_bitmask": fill_bitmask(grammars, vocab_size), "bias_ids": ids,
            "bias_values": values}


def init_slot(state: SlotState, slot: jax.Array, ids: jax.Array, is_out: jax.Array) -> SlotState:
    """ids [N] (-1 = padding), is_out [N] 1 for output tokens: rebuild one slot's state."""
    v = state.token_counts.shape[1]
    valid = ids >= 0
    safe = jnp.where(valid, ids, 0)
    counts = jnp.zeros(v, jnp.int32).at[safe].add(jnp.where(valid, is_out, 0))
    prompt = jnp.zeros(v, bool).at[safe].max(valid & (is_out == 0))
    return SlotState(last_tokens=state.last_tokens,
                     token_counts=state.token_counts.at[slot].set(counts),
                     prompt_mask=state.prompt_mask.at[slot].set(prompt))
