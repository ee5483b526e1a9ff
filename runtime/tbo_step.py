"""The two-batch-overlap executables: one per plain (mode, bucket) it covers, both
micro-batches padded to that bucket (runtime/two_batch_overlap.py chooses the split and
the common bucket; models/moe_overlap.py is the forward).

On a GPU they are compiled with XLA's latency-hiding scheduler on (off by default in
XLA's GPU flags; without it the async all-to-all start/done pairs have nothing scheduled
between them and XLA turns them back into synchronous ops). Per executable, through
compiler options, so nothing depends on XLA_FLAGS being set before the backend starts.

An executable takes each child's packed arrays and row slots and a merge order, and
returns the logits of the children's 2 x B padded rows gathered into the batch's row
order (real rows first), so the sampler of 2 x B rows and the host see one batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models import moe_overlap
from models.config import ModelConfig
from models.forward_batch import ForwardBatch, ForwardMode
from runtime.bucket_plan import StepKey


class TboExecutables:
    """TBO programs for `keys` (plain step keys whose bucket the children share)."""

    def __init__(self, cfg: ModelConfig, attention_backend: str, mesh: Mesh | None,
                 keys: list[StepKey], dummy_slot: int, out_kwargs: dict,
                 options: dict[str, Any]) -> None:
        self.cfg, self.backend, self.mesh, self.keys = cfg, attention_backend, mesh, keys
        self._dummy, self._out_kwargs, self.options = dummy_slot, out_kwargs, options
        self._exe: dict[str, Callable] = {}

    @property
    def names(self) -> list[str]:
        return [name(k) for k in self.keys]

    def has(self, key: StepKey) -> bool:
        return name(key) in self._exe

    def rows(self, key: StepKey) -> int:
        """Rows of the merged logits (the sampler size): both children's padded rows."""
        return 2 * (key.shape.num_extend_seqs + key.shape.num_decode_seqs)

    def lowerings(self, params: Any, kv: Any, last_tokens: Any,
                  inputs_for: Callable[[Any], tuple[dict, Any]], i32: Callable[[int], Any]
                  ) -> list[tuple[str, Callable[[], Any]]]:
        out = []
        for key in self.keys:
            arrays, slots = inputs_for(key.shape)
            lower = functools.partial(self._fn(key).lower, params, kv, last_tokens, arrays,
                                      arrays, slots, slots, i32(self.rows(key)))
            out.append((name(key), lambda lower=lower: _WithOptions(lower(), self.options)))
        return out

    def install(self, compiled: dict[str, Callable]) -> None:
        self._exe = {n: compiled[n] for n in self.names}

    def __call__(self, key: StepKey, *args: Any) -> tuple[Any, Any]:
        return self._exe[name(key)](*args)

    def _fn(self, key: StepKey) -> Callable:
        te, be = key.shape.num_extend_tokens, key.shape.num_extend_seqs
        cfg, backend, mesh, dummy = self.cfg, self.backend, self.mesh, self._dummy

        def child(arrays: dict, slots: jax.Array, last_tokens: jax.Array) -> ForwardBatch:
            # Decode inputs of -1 are the tokens their slot sampled last (overlap).
            tok_slot = jnp.concatenate([jnp.full(te, dummy, jnp.int32), slots[be:]])  # [T]
            ids = jnp.where(arrays["input_ids"] < 0, last_tokens[tok_slot], arrays["input_ids"])
            return ForwardBatch(**{**arrays, "input_ids": ids}, mode=key.mode,
                                num_extend_tokens=te, num_extend_seqs=be)

        def forward(params, kv, last_tokens, arrays_a, arrays_b, slots_a, slots_b, order):
            batches = (child(arrays_a, slots_a, last_tokens), child(arrays_b, slots_b,
                                                                   last_tokens))
            la, lb, kv = moe_overlap.forward(params, kv, batches, cfg, backend, mesh,
                                             two_chunk=key.mode != ForwardMode.DECODE)
            return jnp.concatenate([la, lb])[order], kv  # [2B, V] in the batch's row order

        return jax.jit(forward, donate_argnums=(1,), **self._out_kwargs)


def compiler_options(platform: str) -> dict[str, Any]:
    """XLA options of the TBO executables on `platform` (jax.default_backend())."""
    return {"xla_gpu_enable_latency_hiding_scheduler": True} if platform == "gpu" else {}


class _WithOptions:
    """A lowered program whose compile() passes the TBO compiler options."""

    def __init__(self, lowered: Any, options: dict[str, Any]) -> None:
        self.lowered, self.options = lowered, options

    def compile(self) -> Any:
        return self.lowered.compile(compiler_options=self.options or None)


def name(key: StepKey) -> str:
    s = key.shape
    return (f"tbo/{key.mode.value}/te{s.num_extend_tokens}_be{s.num_extend_seqs}"
            f"_bd{s.num_decode_seqs}_np{s.num_pages_per_seq}")
