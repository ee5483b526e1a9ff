"""The fused multiplexed step: one executable in which the decode rows run all L layers
and a split prefill's tokens run layers [s, s + k) of the same layer loop, so for those k
layers both share one read of the weights (decode rides the prefill interval, as MIXED
batches ride a prefill chunk along the token axis). The alternative is two calls per
iteration (a DECODE step, then an interval); runtime/multiplexing.py runs either.

Layout: the inputs are a MIXED packing (the split's extend rows, then the decode rows) at
the widest page table; the decode rows alone go through [0, s) and [s + k, L) in while
loops (the model module's run_layer_range, which only reads the pool; their K/V are
written after both) and join the prefill tokens for [s, s + k).

Count: the largest split token bucket's sequence buckets x decode buckets x interval sizes
below the depth (runtime/paths/fused.py), so it is opt-in (--multiplex_fused):
48 executables at the default flags; smaller chunks (a prompt's last) run as two calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from models import layers
from models.config import ModelConfig
from models.forward_batch import ForwardBatch, ForwardMode, real_row_mask
from models.registry import model_module
from runtime.batch_builder import BucketShape
from runtime.sharding import MeshPlacement


class FusedExecutables:
    """Fused decode + interval programs for (extend bucket, decode bucket, k)."""

    def __init__(self, cfg: ModelConfig, attention_backend: str, shapes: list[BucketShape],
                 sizes: list[int], placement: MeshPlacement | None = None) -> None:
        self.cfg, self.backend = cfg, attention_backend
        self.place = placement or MeshPlacement()
        self.shapes, self.sizes = shapes, [k for k in sizes if k < cfg.num_layers]
        self._exe: dict[str, Callable] = {}

    @property
    def names(self) -> list[str]:
        return [_name(s, k) for s in self.shapes for k in self.sizes]

    def has(self, shape: BucketShape, k: int) -> bool:
        return _name(shape, k) in self._exe

    def lowerings(self, params: Any, kv: Any, last_tokens: Any,
                  arrays_for: Callable[[BucketShape], dict], dtype: Any
                  ) -> list[tuple[str, Callable[[], Any]]]:
        i32 = self.place.i32
        out = []
        for s in self.shapes:
            hidden = self.place.abstract((s.num_extend_tokens, self.cfg.hidden_size), dtype)
            b = s.num_extend_seqs + s.num_decode_seqs
            for k in self.sizes:
                fn = self._fused(s, k)
                out.append((_name(s, k), functools.partial(
                    fn.lower, params, kv, last_tokens, hidden, arrays_for(s), i32(b), i32())))
        return out

    def install(self, compiled: dict[str, Callable]) -> None:
        self._exe = {name: compiled[name] for name in self.names}

    def __call__(self, shape: BucketShape, k: int, *args: Any) -> tuple[Any, Any, Any]:
        return self._exe[_name(shape, k)](*args)

    def _fused(self, shape: BucketShape, k: int) -> Callable:
        cfg, backend, model = self.cfg, self.backend, model_module(self.cfg)
        te, be = shape.num_extend_tokens, shape.num_extend_seqs
        place = self.place
        mesh = place.mesh

        def fused(params, kv, last_tokens, hidden, arrays, row_slots, start):
            # Decode inputs of -1 are the tokens their slot sampled last (overlap).
            dec_ids = arrays["input_ids"][te:]
            dec_ids = jnp.where(dec_ids < 0, last_tokens[row_slots[be:]], dec_ids)  # [B_d]
            mixed = ForwardBatch(**{**arrays, "input_ids": arrays["input_ids"].at[te:].set(
                dec_ids)}, mode=ForwardMode.MIXED, num_extend_tokens=te, num_extend_seqs=be)
            dec = ForwardBatch(
                input_ids=dec_ids, positions=arrays["positions"][te:],
                out_cache_loc=arrays["out_cache_loc"][te:], page_table=arrays["page_table"][be:],
                seq_lens=arrays["seq_lens"][be:], query_start=arrays["query_start"][be:] - te,
                logits_indices=arrays["logits_indices"][be:] - te, mode=ForwardMode.DECODE,
                num_extend_tokens=0, num_extend_seqs=0)
            h_dec = model.embed(params, dec_ids)  # [B_d, D]
            # The decode rows' K/V of the layers outside the interval: written once, after
            # both loops (a pool carried through them is copied every trip on XLA CPU).
            kv_shape = (cfg.num_layers, h_dec.shape[0], cfg.num_kv_heads)
            new_kv = tuple(jnp.zeros((*kv_shape, p.shape[-1]), p.dtype)
                           for p in (kv.k, kv.v))  # [L, B_d, Hkv, Dh] (MLA's V: Dh 0)
            h_dec, new_kv = model.run_layer_range(params, kv, h_dec, dec, cfg, jnp.int32(0),
                                                  start, new_kv, backend, mesh)
            h, kv = model.run_layers(params, kv, jnp.concatenate([hidden, h_dec]), mixed, cfg,
                                     start=start, num_layers=k, attention_backend=backend,
                                     mesh=mesh)
            hidden, h_dec = h[:te], h[te:]  # [T_e, D], [B_d, D]
            h_dec, new_kv = model.run_layer_range(params, kv, h_dec, dec, cfg, start + k,
                                                  jnp.int32(cfg.num_layers), new_kv, backend,
                                                  mesh)
            # The interval's layers were written with the MIXED batch: index L drops them.
            ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            ids = jnp.where((ids >= start) & (ids < start + k), cfg.num_layers, ids)
            kv = layers.write_step_kv(kv, ids, dec.out_cache_loc, *new_kv, mesh, backend)
            logits = model.compute_logits(params, h_dec, dec.logits_indices, cfg,
                                          real_row_mask(dec.seq_lens))
            return logits, hidden, kv

        return jax.jit(fused, donate_argnums=(1,),
                       **place.out(place.replicated, place.replicated, place.kv))


def _name(s: BucketShape, k: int) -> str:
    return (f"fused/te{s.num_extend_tokens}_be{s.num_extend_seqs}_bd{s.num_decode_seqs}"
            f"_np{s.num_pages_per_seq}_k{k}")
