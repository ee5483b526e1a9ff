"""Split prefill (ForwardMode.SPLIT_PREFILL): an extend batch advanced a few decoder
layers per call, so decode steps can run between its calls (runtime/multiplexing.py).

One split prefill is three kinds of executable, all compiled at warm-up per extend
bucket: `embed` (ids -> hidden [T, D]), `interval` (layers [s, s + k) over the carried
hidden state, s traced and k static, writing those layers' K/V as it goes) and `head`
(final norm + logits of the sampled rows; the runner's shared sampler follows). The
interval sizes k are the even numbers from 2 to 8 below the depth, the depth and an
optional fixed size (1 only where parity needs it), so any remaining run of layers is a
sum of compiled sizes and no remainder needs a trace of its own. Extend buckets below
RunnerConfig.split_min_tokens get no split programs: such a prefill is cheap enough to
run whole (MultiplexLoop launches it as an EXTEND step).

`SplitPrefill` is the carried state of one batch in flight: the host's packed inputs,
the device handle of the hidden state, and where it stands. It belongs to the loop that
runs it, never to the runner or a global.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from models.config import ModelConfig
from models.forward_batch import ForwardBatch, ForwardMode, real_row_mask
from models.registry import model_module
from runtime.batch_builder import BucketShape
from runtime.schedule_batch import ScheduleBatch
from runtime.sharding import MeshPlacement

# Largest interval compiled besides the depth: while streams decode, an interval is sized
# to fit beside a decode step, which on SmolLM2 at 256-512 prefill tokens per chunk is 2-8
# layers; bigger remainders run as several intervals. Every even size up to it is compiled
# (not only powers of two): with 2, 4, 8 the policy could only jump from 4 layers to 8,
# and slowdown targets of 2.5x and 3x the decode step ran the same 4-layer intervals.
_MAX_EVEN = 8


def interval_sizes(num_layers: int, fixed: int | None = None) -> list[int]:
    """Compiled interval sizes: the even numbers from 2 up to _MAX_EVEN below the depth,
    the depth itself (a prefill with nothing to interleave runs in one call), a fixed size
    if one is asked for (--split_prefill_layers), and 1 only where parity needs it (an odd
    depth or fixed size), so every remainder is a sum of compiled sizes.

    Why not 1 otherwise: on XLA CPU a one-layer interval (a scan of trip count 1) runs
    ~30x slower per layer than longer ones (SmolLM2, 512 tokens: 30 one-layer calls
    92.6 s against 3.2-3.4 s for calls of 2, 4, 8 or 30 layers, measured side by side),
    so the policy's smallest step is two layers."""
    if fixed is not None and not 1 <= fixed <= num_layers:
        raise ValueError(f"split_prefill_layers={fixed} must be in [1, {num_layers}]")
    sizes = {num_layers} | {k for k in range(2, min(num_layers, _MAX_EVEN + 1), 2)}
    if fixed is not None:
        sizes.add(fixed)
    if num_layers % 2 or (fixed is not None and fixed % 2):
        sizes.add(1)
    return sorted(sizes)


def next_interval(remaining: int, want: int, sizes: list[int]) -> int:
    """The compiled size to run next: the largest one <= min(want, remaining), at least
    the smallest compiled size; repeated calls cover `remaining` exactly (sizes are all
    even unless 1 is among them, and remaining then stays even)."""
    cap = max(min(sizes), min(want, remaining))
    return max(k for k in sizes if k <= cap)


def layer_work(cfg: ModelConfig, tokens: int, rows: list) -> float:
    """Relative device work of one decoder layer of a split prefill, in token-equivalents:
    the matmuls run on `tokens` (every padded token, or on the packed CPU matmul, which
    skips the padding, the real ones); attention runs on the real rows' (query, key)
    pairs, each costing what its FLOPs are worth next to one token's matmul FLOPs. A chunk
    over a long prefix costs more per layer than the first chunk of the same bucket (on
    SmolLM2 a 512-token chunk over 1,536 cached tokens ~1.5x), and the interval policy's
    measured per-layer cost must follow that, or the first interval of each later chunk
    overshoots its inter-token-latency target."""
    heads_dim = cfg.num_heads * cfg.head_dim
    linear = 2 * cfg.hidden_size * (2 * heads_dim + 2 * cfg.num_kv_heads * cfg.head_dim) \
        + 6 * cfg.hidden_size * cfg.intermediate_size  # FLOPs per token: q, o, k, v, mlp
    pairs = sum(len(r.input_ids) * (r.start_pos + (len(r.input_ids) + 1) / 2) for r in rows)
    return tokens + pairs * 4 * heads_dim / linear  # QK^T + PV: 4 FLOPs per pair-dim


@dataclasses.dataclass
class SplitPrefill:
    """One extend batch in flight through its layers.

    arrays: the packed ForwardBatch inputs (host numpy; re-sent with every call, so a row
      aborted mid-way can be redirected to the padding page before the next interval).
    hidden: device handle of the hidden state [T, D] between calls.
    intervals: (start layer, layers) of every interval launched so far.
    """

    batch: ScheduleBatch
    shape: BucketShape
    arrays: dict[str, np.ndarray]
    hidden: Any
    num_layers: int
    next_layer: int = 0
    intervals: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.num_layers - self.next_layer

    @property
    def done(self) -> bool:
        return self.next_layer >= self.num_layers

    def advance(self, k: int) -> None:
        self.intervals.append((self.next_layer, k))
        self.next_layer += k

    def drop_finished_rows(self) -> None:
        """Redirect the rest of an aborted row's K/V writes (redirect_finished)."""
        redirect_finished(self.arrays, self.batch.extend_rows)


def redirect_finished(arrays: dict[str, np.ndarray], rows: list) -> None:
    """Point the K/V writes of finished (aborted) extend rows at page 0, the padding sink:
    their pages went back to the pool at once and may already belong to another request,
    which later intervals must not overwrite."""
    q = arrays["query_start"]
    for i, row in enumerate(rows):
        if row.req.finished:
            arrays["out_cache_loc"][q[i]:q[i + 1]] = 0


class SplitExecutables:
    """The compiled embed / interval / head programs of split prefill, for every extend
    bucket the runner plans, and the calls that run them on a SplitPrefill."""

    def __init__(self, cfg: ModelConfig, attention_backend: str, shapes: list[BucketShape],
                 fixed_layers: int | None = None, placement: MeshPlacement | None = None
                 ) -> None:
        self.cfg, self.backend, self.shapes = cfg, attention_backend, shapes
        self.sizes = interval_sizes(cfg.num_layers, fixed_layers)
        self.place = placement or MeshPlacement()
        self._exe: dict[str, Callable] = {}

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._programs()]

    def _programs(self) -> list[tuple[str, tuple]]:
        """(name, (kind, shape, k)) of every program, embeds and heads once per size."""
        out: dict[str, tuple] = {}
        for s in self.shapes:
            te, be = s.num_extend_tokens, s.num_extend_seqs
            out[f"split_embed/te{te}"] = ("embed", s, 0)
            out[f"split_head/te{te}_be{be}"] = ("head", s, 0)
            for k in self.sizes:
                out[_interval_name(s, k)] = ("interval", s, k)
        return list(out.items())

    def lowerings(self, params: Any, kv: Any, arrays_for: Callable[[BucketShape], dict],
                  dtype: Any) -> list[tuple[str, Callable[[], Any]]]:
        """(name, lower) for every program; abstract params / pool / packed inputs in."""
        i32, place = self.place.i32, self.place
        out = []
        for name, (kind, s, k) in self._programs():
            hidden = place.abstract((s.num_extend_tokens, self.cfg.hidden_size), dtype)
            if kind == "embed":
                args: tuple = (params, i32(s.num_extend_tokens))
                # (params, ids [T]) -> [T, D]
                fn = jax.jit(model_module(self.cfg).embed, **place.out(place.replicated))
            elif kind == "head":
                rows = i32(s.num_extend_seqs)
                args, fn = (params, hidden, rows, rows), self._head()
            else:
                args = (params, kv, hidden, arrays_for(s), i32())
                fn = self._interval(s, k)
            out.append((name, functools.partial(fn.lower, *args)))
        return out

    def install(self, compiled: dict[str, Callable]) -> None:
        self._exe = {name: compiled[name] for name in self.names}

    def _interval(self, shape: BucketShape, k: int) -> Callable:
        cfg, backend, model = self.cfg, self.backend, model_module(self.cfg)
        te, be = shape.num_extend_tokens, shape.num_extend_seqs
        place = self.place

        def interval(params, kv, hidden, arrays, start):
            batch = ForwardBatch(**arrays, mode=ForwardMode.EXTEND, num_extend_tokens=te,
                                 num_extend_seqs=be)
            return model.run_layers(params, kv, hidden, batch, cfg, start=start, num_layers=k,
                                    attention_backend=backend, mesh=place.mesh)  # [T, D], pool

        return jax.jit(interval, donate_argnums=(1,), **place.out(place.replicated, place.kv))

    def _head(self) -> Callable:
        cfg, model, place = self.cfg, model_module(self.cfg), self.place
        def head(params, hidden, logits_indices, seq_lens):
            return model.compute_logits(params, hidden, logits_indices, cfg,
                                        real_row_mask(seq_lens))

        return jax.jit(head, **place.out(place.replicated))

    # ---- running ----

    def embed(self, params: Any, shape: BucketShape, arrays: dict[str, np.ndarray]) -> Any:
        return self._exe[f"split_embed/te{shape.num_extend_tokens}"](params, arrays["input_ids"])

    def interval(self, params: Any, kv: Any, split: SplitPrefill, k: int) -> tuple[Any, Any]:
        """Launch layers [next_layer, next_layer + k) of split: (hidden, pool)."""
        exe = self._exe[_interval_name(split.shape, k)]
        return exe(params, kv, split.hidden, split.arrays, np.int32(split.next_layer))

    def logits(self, params: Any, split: SplitPrefill) -> Any:
        s = split.shape
        exe = self._exe[f"split_head/te{s.num_extend_tokens}_be{s.num_extend_seqs}"]
        return exe(params, split.hidden, split.arrays["logits_indices"],
                   split.arrays["seq_lens"])  # [B, V]


def _interval_name(s: BucketShape, k: int) -> str:
    return (f"split_prefill/te{s.num_extend_tokens}_be{s.num_extend_seqs}"
            f"_np{s.num_pages_per_seq}_k{k}")
