"""ModelRunner: owns weights, the KV pool and per-request device state; one AOT-compiled
executable per (mode, bucket); launches steps asynchronously.

Every executable is compiled in `warmup()`; `launch()` only ever calls those, so a
batch that fits no bucket is an error, never a silent recompile.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from tqdm import tqdm

from models import llama
from runtime import sampling
from runtime.batch_builder import BucketShape, pack_rows
from runtime.compile_counter import CompileAfterWarmupError, compile_counter
from runtime.config import CacheConfig, ModelConfig, RunnerConfig
from runtime.forward_batch import ForwardBatch, ForwardMode
from runtime.kv_pool import KVPool, init_kv_pool
from runtime.schedule_batch import BatchRow, ScheduleBatch, StepOutput

logger = logging.getLogger(__name__)


@struct.dataclass
class SlotState:
    """Per-request device state, indexed by req_slot; the last slot absorbs padding rows."""

    last_tokens: jax.Array   # [S + 1] int32: token each slot sampled last (overlap inputs)
    token_counts: jax.Array  # [S + 1, V] int32: output-token counts (all three penalties)
    prompt_mask: jax.Array   # [S + 1, V] bool: prompt tokens (repetition penalty)


@dataclasses.dataclass(frozen=True)
class StepKey:
    """Static identity of one executable."""

    mode: ForwardMode
    shape: BucketShape


def _smallest_fitting(buckets: Sequence[int], need: int, what: str) -> int:
    for b in buckets:
        if b >= need:
            return b
    raise ValueError(f"{what}={need} exceeds the largest bucket {buckets[-1]}")


class PendingStep:
    """Device results of a launched step; `result()` blocks and reads them back."""

    def __init__(self, batch: ScheduleBatch, out: sampling.SampleOutput, order: np.ndarray,
                 top_n: int) -> None:
        # order: padded-row index of each real row (extend rows, then decode rows).
        self.batch, self._out, self._order, self._top_n = batch, out, order, top_n

    def is_ready(self) -> bool:
        """Whether the device has finished this step (readback would not block)."""
        return self._out.next_tokens.is_ready()

    def result(self) -> StepOutput:
        out = jax.device_get(self._out)
        o = self._order
        top = (out.top_ids[o], out.top_logprobs[o]) if self._top_n else None
        return StepOutput(next_token_ids=out.next_tokens[o], logprobs=out.logprobs[o],
                          top_logprobs=top)


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, params: dict, cache_cfg: CacheConfig,
                 runner_cfg: RunnerConfig, max_running_requests: int) -> None:
        self.model_cfg, self.cache_cfg, self.cfg = model_cfg, cache_cfg, runner_cfg
        compile_counter()  # listen from here on, so warm-up compilations are counted too
        self.max_running = max_running_requests
        self.dtype = jnp.dtype(runner_cfg.dtype)
        self.params = jax.tree.map(lambda w: jnp.asarray(w, self.dtype), params)
        if runner_cfg.per_layer_weights:
            self.params = llama.unstack_layers(self.params)
        if runner_cfg.cpu_matmul == "packed":
            self.params = llama.pack_for_cpu(self.params)
        self.kv: KVPool = init_kv_pool(model_cfg, cache_cfg, self.dtype)
        s, v = max_running_requests + 1, model_cfg.vocab_size
        self.state = SlotState(last_tokens=jnp.zeros(s, jnp.int32),
                               token_counts=jnp.zeros((s, v), jnp.int32),
                               prompt_mask=jnp.zeros((s, v), bool))
        self._executables: dict[StepKey, Callable] = {}
        self._warm_compiles: int | None = None
        self._init_slot_exec: dict[int, Callable] = {}
        self.step_counts: dict[ForwardMode, int] = {m: 0 for m in ForwardMode}

    # ---- buckets -------------------------------------------------------------------------

    def _pages(self, kv_len: int) -> int:
        return kv_len // self.cache_cfg.page_size

    def step_keys(self) -> list[StepKey]:
        """Every executable the runner may call, fixed at start-up."""
        c = self.cfg
        nps = [self._pages(n) for n in c.kv_len_buckets]
        keys = [StepKey(ForwardMode.DECODE, BucketShape(0, 0, bd, n))
                for bd in c.decode_buckets for n in nps]
        for te in c.extend_token_buckets:
            for be in (b for b in c.extend_seq_buckets if b <= te):
                ext_nps = [0, *nps] if self._prefixless_extend else nps
                keys += [StepKey(ForwardMode.EXTEND, BucketShape(te, be, 0, n)) for n in ext_nps]
                if c.enable_mixed:
                    keys += [StepKey(ForwardMode.MIXED, BucketShape(te, be, bd, n))
                             for bd in c.decode_buckets for n in nps]
        return keys

    @property
    def _prefixless_extend(self) -> bool:
        """Whether EXTEND batches of fresh prompts (no cached prefix: the common case) get
        executables with a page table of width 0. The jnp attention scores every token
        against every row's page-table slots, masked or not (4 x 128-token prefill: the
        prefix columns were 2/3 of its attention work; "cpu" extends with it too); the
        Pallas kernels skip empty prefixes by themselves and index at least one page."""
        return self.cfg.attention_backend in ("xla", "cpu")

    def bucket_for(self, batch: ScheduleBatch) -> BucketShape:
        c = self.cfg
        ext, dec = batch.extend_rows, batch.decode_rows
        ext_tokens = sum(len(r.input_ids) for r in ext)
        # The page table lists earlier context only (this step's K/V reach attention
        # directly), so a fresh prefill takes the smallest bucket whatever its length.
        max_ctx = max(r.start_pos for r in (*ext, *dec))
        kv_len = _smallest_fitting(c.kv_len_buckets, max_ctx, "sequence length")
        if max_ctx == 0 and not dec and self._prefixless_extend:
            kv_len = 0
        te = _smallest_fitting(c.extend_token_buckets, ext_tokens, "extend tokens") if ext else 0
        be = _smallest_fitting(c.extend_seq_buckets, len(ext), "extend rows") if ext else 0
        bd = _smallest_fitting(c.decode_buckets, len(dec), "decode rows") if dec else 0
        return BucketShape(te, be, bd, self._pages(kv_len))

    @property
    def max_seq_len(self) -> int:
        return self.cfg.kv_len_buckets[-1]

    # ---- compilation ---------------------------------------------------------------------

    def _step_fn(self, key: StepKey) -> Callable:
        shape = key.shape
        te, be = shape.num_extend_tokens, shape.num_extend_seqs
        cfg, backend, top_n = self.model_cfg, self.cfg.attention_backend, self.cfg.max_top_logprobs
        dummy = self.max_running

        def step(params, kv, state, arrays, row_slots, sample_mask, sp):
            # Decode inputs of -1 are the tokens this slot sampled in the previous step,
            # which the host has not read back yet (overlap scheduling).
            tok_slot = jnp.concatenate([jnp.full(te, dummy, jnp.int32), row_slots[be:]])  # [T]
            ids = jnp.where(arrays["input_ids"] < 0, state.last_tokens[tok_slot],
                            arrays["input_ids"])
            batch = ForwardBatch(**{**arrays, "input_ids": ids}, mode=key.mode,
                                 num_extend_tokens=te, num_extend_seqs=be)
            logits, kv = llama.forward(params, kv, batch, cfg, backend)  # [B, V]
            out = sampling.sample(logits, sp, state.token_counts[row_slots],
                                  state.prompt_mask[row_slots], num_top_logprobs=top_n)
            tgt = jnp.where(sample_mask, row_slots, dummy)  # [B]
            state = SlotState(
                last_tokens=state.last_tokens.at[tgt].set(out.next_tokens),
                token_counts=sampling.update_token_counts(state.token_counts, tgt,
                                                          out.next_tokens),
                prompt_mask=state.prompt_mask)
            return out, kv, state

        return jax.jit(step, donate_argnums=(1, 2))

    def _abstract_inputs(self, shape: BucketShape):
        t = shape.num_extend_tokens + shape.num_decode_seqs
        b = shape.num_extend_seqs + shape.num_decode_seqs
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        arrays = dict(input_ids=i32(t), positions=i32(t), out_cache_loc=i32(t),
                      page_table=i32(b, shape.num_pages_per_seq), seq_lens=i32(b),
                      query_start=i32(b + 1), logits_indices=i32(b))
        sp = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          sampling.SamplingBatch.create(b))
        return arrays, i32(b), jax.ShapeDtypeStruct((b,), bool), sp

    def warmup(self, progress: bool = True) -> float:
        """Compile every executable (persistent cache makes repeats fast); returns seconds.

        Tracing and lowering hold the GIL while XLA's compilation (or loading from the
        persistent cache) releases it, so a worker thread compiles executable i while
        the main thread lowers i + 1: start-up costs about max(lowering, compiling)
        instead of their sum (warm cache, 72 executables, 2 cores: 47 -> 33 s).
        """
        t0 = time.perf_counter()
        keys = self.step_keys()
        abstract = functools.partial(jax.tree.map, lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=getattr(a, "sharding", None)))
        bar = tqdm(total=len(keys), desc="compiling buckets", disable=not progress,
                   unit="trace")
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            futures = {}
            for key in keys:
                lowered = self._step_fn(key).lower(abstract(self.params), abstract(self.kv),
                                                   abstract(self.state),
                                                   *self._abstract_inputs(key.shape))
                futures[key] = pool.submit(lowered.compile)
                futures[key].add_done_callback(lambda _: bar.update())
            self._executables = {key: f.result() for key, f in futures.items()}
        bar.close()
        for n in self.cfg.kv_len_buckets:
            self._init_slot_exec[n] = jax.jit(_init_slot, donate_argnums=(0,)).lower(
                abstract(self.state), jax.ShapeDtypeStruct((), jnp.int32),
                jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32),
            ).compile()
        self._warm_compiles = compile_counter().count
        secs = time.perf_counter() - t0
        logger.info("compiled %d executables in %.1f s", len(keys), secs)
        return secs

    @property
    def compiles_after_warmup(self) -> int:
        """Compilations in this process since warm-up (0 before it)."""
        if self._warm_compiles is None:
            return 0
        return compile_counter().count - self._warm_compiles

    def check_no_compiles(self) -> None:
        """In strict mode, fail if anything compiled since warm-up."""
        if self.cfg.strict_compile and self.compiles_after_warmup:
            raise CompileAfterWarmupError(
                f"{self.compiles_after_warmup} compilation(s) after warm-up")

    # ---- execution -----------------------------------------------------------------------

    def init_slots(self, rows: Sequence[BatchRow]) -> None:
        """Rebuild the penalty state of each newly admitted (or resumed) request that uses
        penalties: output-token counts and prompt mask. Requests without penalties never
        read their slot's state, so they skip this."""
        for row in rows:
            req, sp = row.req, row.req.sampling
            if not row.new_slot or (sp.frequency_penalty == 0 and sp.presence_penalty == 0
                                    and sp.repetition_penalty == 1):
                continue
            n = _smallest_fitting(self.cfg.kv_len_buckets, req.num_known, "sequence length")
            ids = np.full(n, -1, np.int32)
            ids[:req.num_known] = req.all_ids
            is_out = np.zeros(n, np.int32)
            is_out[len(req.prompt_ids):req.num_known] = 1
            self.state = self._init_slot_exec[n](self.state, np.int32(req.req_slot), ids,
                                                 is_out)

    def launch(self, batch: ScheduleBatch) -> PendingStep:
        """Dispatch one step asynchronously; the returned PendingStep reads it back."""
        shape = self.bucket_for(batch)
        exe = self._executables[StepKey(batch.mode, shape)]
        self.init_slots(batch.extend_rows)
        arrays = pack_rows(batch.extend_rows, batch.decode_rows, shape, self.cache_cfg.page_size)
        b = shape.num_extend_seqs + shape.num_decode_seqs
        row_slots = np.full(b, self.max_running, np.int32)
        sample_mask = np.zeros(b, bool)
        padded: list[BatchRow | None] = [None] * b
        for i, r in enumerate(batch.extend_rows):
            padded[i] = r
        for i, r in enumerate(batch.decode_rows):
            padded[shape.num_extend_seqs + i] = r
        for i, r in enumerate(padded):
            if r is not None:
                row_slots[i] = r.req.req_slot
                sample_mask[i] = r.sample
        sp = sampling.SamplingBatch.create(b, **_sampling_columns(padded))
        out, self.kv, self.state = exe(self.params, self.kv, self.state, arrays,
                                       row_slots, sample_mask, sp)
        self.step_counts[batch.mode] += 1
        self.check_no_compiles()
        # Rows come back in padded order; compact them to extend rows then decode rows.
        order = np.r_[np.arange(len(batch.extend_rows)),
                      shape.num_extend_seqs + np.arange(len(batch.decode_rows))]
        return PendingStep(batch, out, order, self.cfg.max_top_logprobs)


def _sampling_columns(rows: Sequence[BatchRow | None]) -> dict[str, np.ndarray]:
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


def _init_slot(state: SlotState, slot: jax.Array, ids: jax.Array, is_out: jax.Array) -> SlotState:
    """ids [N] (-1 = padding), is_out [N] 1 for output tokens: rebuild one slot's state."""
    v = state.token_counts.shape[1]
    valid = ids >= 0
    safe = jnp.where(valid, ids, 0)
    counts = jnp.zeros(v, jnp.int32).at[safe].add(jnp.where(valid, is_out, 0))
    prompt = jnp.zeros(v, bool).at[safe].max(valid & (is_out == 0))
    return SlotState(last_tokens=state.last_tokens,
                     token_counts=state.token_counts.at[slot].set(counts),
                     prompt_mask=state.prompt_mask.at[slot].set(prompt))
