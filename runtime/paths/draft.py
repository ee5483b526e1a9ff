"""A draft model for speculative decoding (--speculative_algorithm=standalone): a smaller
model of the target's vocabulary with its own weights, its own paged KV pool and page
allocator, and its own programs, compiled at warm-up with the runner's:

  DRAFT_EXTEND  one per plain EXTEND bucket: the draft catches up on the tokens of a row
                it has not seen (the prompt, tokens decoded plainly, the target's bonus
                token); K/V only, no logits.
  DRAFT_DECODE  one per DECODE bucket: k one-token steps in one program (the multi-step
                decode scan of runtime/multi_step.py), fed the row's last token; out:
                [k, rows] drafted tokens. A sampled row (temperature > 0, no grammar)
                draws each draft from the draft's distribution q under the request's
                temperature / top-k / top-p / min-p / bias, and the program writes those
                q rows into `q`, [slots, k, vocab] on the device, at the row's req_slot,
                where the TARGET_VERIFY program reads them; other rows take the argmax.

The scheduler asks for drafts through draft_batch (the SpecDecoding drafter protocol), so
it never sees this module's device arrays. Which draft K/V is valid is decided from tokens,
not from events: a row remembers the tokens whose K/V sit in its draft pages, and each
draft call keeps the common prefix of those and the row's tokens now. So a rejection
(the drafts past the kept ones differ), plain decode steps between drafts, a retraction
(the tokens survive) all roll the draft cache back to what matches; pages past it are
freed, and release() frees a finished or aborted row's pages.

Greedy rows draft the argmax and are verified with the one-hot rule; sampled rows with
the standard rejection rule over q (runtime/spec_decode.py). draft_batch records which
rows drew their drafts (`sampled`), so the verify step knows which q rows are valid.
Launches are recorded in the engine's execution trace (`trace`) as draft_extend /
draft_decode steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.forward_batch import ForwardBatch
from models.forward_mode import ForwardMode
from models.kv_pool import init_kv_pool
from models.registry import model_module
from runtime import sampling
from runtime.batch_builder import BucketShape, input_layout, pack_flat, unflatten_inputs
from runtime.bucket_plan import StepKey, key_name, smallest_fitting
from runtime.config import CacheConfig, RunnerConfig
from runtime.exec_trace import ExecutionTrace, StepRecord, step_record
from runtime.executable_budget import FORWARD_COST, MULTI_STEP_COST, PlanPart
from runtime.grammar import mask_width
from runtime.kv_cache import PageAllocator, pages_for
from runtime.multi_step import multi_step_fn, pack_steps
from runtime.paths.base import ExecPath, Lowering
from runtime.request import MAX_LOGIT_BIAS, Req
from runtime.schedule_batch import BatchRow, ScheduleBatch


class _Drafted(NamedTuple):
    next_tokens: jax.Array  # [B]
    q: jax.Array  # [B, V] the distribution a sampled row drew from (zeros for the others)


class _NoSlots(NamedTuple):
    """multi_step_fn reads last_tokens for PREV_TOKEN inputs; draft rows never feed one."""

    last_tokens: jax.Array  # [1]


@dataclasses.dataclass
class _DraftRow:
    """A request's share of the draft pool: its pages and the tokens whose K/V they hold
    (position i holds tokens[i])."""

    pages: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)


def prepare_weights(model: Any, params: dict, cfg: RunnerConfig) -> dict:
    """The draft's weights in the runner's layout (dtype, per-layer, fused or packed), as
    the target's, so the same model code and kernels run both."""
    params = jax.tree.map(lambda w: jnp.asarray(w, jnp.dtype(cfg.dtype)), params)
    if cfg.per_layer_weights:
        params = model.unstack_layers(params)
    if cfg.fuse_projections and cfg.cpu_matmul != "packed":
        params = model.fuse_projections(params)
    if cfg.cpu_matmul == "packed":
        params = model.pack_for_cpu(params, cfg.quantization, compress=cfg.compress_weights)
    return params


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class DraftPath(ExecPath):
    name = "draft"

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        cfg, params = runner.draft_model
        if cfg.vocab_size != runner.model_cfg.vocab_size:
            raise ValueError(f"the draft model's vocab_size={cfg.vocab_size} is not the "
                             f"target's {runner.model_cfg.vocab_size}: a draft must share "
                             "the target's tokenizer")
        if runner.mesh is not None:
            raise ValueError("a draft model runs on one device, not on a mesh")
        rc = runner.cfg
        self.k = rc.speculative_num_draft_tokens
        self.model_cfg: ModelConfig = cfg
        self.model = model_module(cfg)
        self.params = prepare_weights(self.model, params, rc)
        self.page = runner.cache_cfg.page_size
        # As many pages as the target's pool: a draft row never holds more tokens than its
        # target row plus k, and a row the pool cannot hold just does not draft.
        pool = CacheConfig(page_size=self.page, num_pages=runner.cache_cfg.num_pages)
        self.kv = init_kv_pool(cfg, pool, jnp.dtype(rc.kv_dtype), None)
        self.allocator = PageAllocator(pool.num_pages)
        self.buckets = runner.buckets
        self.extend_keys = [k for k in runner.step_keys() if k.mode is ForwardMode.EXTEND]
        width = self.buckets.decode_widths()[-1]
        self.decode_keys = [StepKey(ForwardMode.DECODE, BucketShape(0, 0, b, width))
                            for b in rc.decode_buckets]
        self.rows: dict[str, _DraftRow] = {}
        self._exe: dict[str, Callable] = {}
        # Per request slot (the last absorbs padding rows), the distributions its k drafts
        # were drawn from: written by DRAFT_DECODE for sampled rows, read by TARGET_VERIFY.
        self.q = jnp.zeros((runner.max_running + 1, self.k, cfg.vocab_size), jnp.float32)
        # rid -> the drafts the last draft_batch drew from q (sampled rows only).
        self.sampled: dict[str, list[int]] = {}
        self.trace: ExecutionTrace | None = None  # the engine's, where it speculates

    # ---- plan, lowering, install ---------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [self._name(k) for k in (*self.extend_keys, *self.decode_keys)]

    def _name(self, key: StepKey) -> str:
        if key.mode is ForwardMode.EXTEND:
            return "draft_" + key_name(key)
        return f"draft_decode/K{self.k}_bd{key.shape.num_decode_seqs}" \
               f"_np{key.shape.num_pages_per_seq}"

    def plan_parts(self) -> list[PlanPart]:
        c = self.runner.cfg
        return [PlanPart("DRAFT_EXTEND", len(self.extend_keys), FORWARD_COST,
                         "--speculative_algorithm=standalone: the EXTEND buckets"),
                PlanPart("DRAFT_DECODE", len(self.decode_keys), MULTI_STEP_COST,
                         f"--speculative_algorithm=standalone: {len(c.decode_buckets)} "
                         "decode_buckets, --speculative_num_draft_tokens steps each")]

    def lowerings(self, params: Any, kv: Any, state: Any) -> Iterable[Lowering]:
        """Over the draft's own weights and pool (the target's are not its inputs)."""
        r = self.runner
        def abstract(tree: Any) -> Any:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

        dp, dkv, dq = abstract(self.params), abstract(self.kv), abstract(self.q)
        for key in self.extend_keys:
            yield self._name(key), lambda key=key: self._extend_program(key).lower(
                dp, dkv, r.flat_input(key.shape))
        for key in self.decode_keys:
            b = key.shape.num_decode_seqs
            n = r.flat_input(key.shape).shape[0] + b
            flat = jax.ShapeDtypeStruct((n,), jnp.int32)
            words = r.abstract_sample_inputs(b)[1]
            yield self._name(key), lambda key=key, flat=flat, words=words: \
                self._decode_program(key).lower(dp, dkv, dq, flat, words)

    def install(self, compiled: Mapping[str, Callable]) -> None:
        self._exe = {n: compiled[n] for n in self.names}

    # ---- programs ------------------------------------------------------------------------

    def _extend_program(self, key: StepKey) -> Callable:
        model, cfg = self.model, self.model_cfg
        backend = self.runner.cfg.attention_backend
        shape = key.shape
        layout = input_layout(shape)

        def extend(params, kv, flat):
            arrays = unflatten_inputs(flat, layout)
            arrays.pop("row_slots")
            batch = ForwardBatch(**arrays, mode=ForwardMode.EXTEND,
                                 num_extend_tokens=shape.num_extend_tokens,
                                 num_extend_seqs=shape.num_extend_seqs)
            h = model.embed(params, batch.input_ids)  # [T, D]
            _, kv = model.run_layers(params, kv, h, batch, cfg, attention_backend=backend,
                                     mesh=None)
            return kv

        return jax.jit(extend, donate_argnums=(1,))

    def _decode_program(self, key: StepKey) -> Callable:
        model, cfg = self.model, self.model_cfg
        backend = self.runner.cfg.attention_backend
        b = key.shape.num_decode_seqs

        mask_w = mask_width(cfg.vocab_size)
        layout = sampling.word_layout(b, mask_w, MAX_LOGIT_BIAS)

        def draw(state, logits, words):
            # words: [row_slots | sample_mask | SamplingBatch] as the runner's sampler
            # reads them; the mask marks the live sampled rows (the scan clears a row's
            # once it is past its drafts).
            sp = sampling.SamplingBatch.from_words(words[2 * b:], b, mask_width=mask_w,
                                                   bias_slots=MAX_LOGIT_BIAS)
            tokens, q = sampling.draft_sample(logits, sp, words[b:2 * b] != 0)  # [B], [B, V]
            return _Drafted(tokens, q), state

        scan = multi_step_fn(
            key, self.k, self.page,
            lambda params, kv, batch: model.forward(params, kv, batch, cfg, backend),
            draw, 2 * b + layout["step"][0])

        def decode(params, kv, q, flat, words):
            outs, kv, _ = scan(params, kv, _NoSlots(jnp.zeros(1, jnp.int32)), flat, words)
            slots = words[:b]  # [B] req_slot of each row (padding: the spare last slot)
            # Only a batch with sampled rows has q rows anyone reads.
            q = jax.lax.cond(jnp.any(words[b:2 * b] != 0),
                             lambda: q.at[slots].set(jnp.swapaxes(outs.q, 0, 1)),  # [B, K, V]
                             lambda: q)
            return outs.next_tokens, kv, q  # [K, B]

        return jax.jit(decode, donate_argnums=(1, 2))

    # ---- drafting (the SpecDecoding drafter protocol) ------------------------------------

    def draft_batch(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        """Up to limits[i] draft tokens for each of reqs (k at most)."""
        out: list[list[int]] = [[] for _ in reqs]
        self.sampled = {}
        todo: list[tuple[int, Req, _DraftRow, int]] = []
        for i, (req, limit) in enumerate(zip(reqs, limits, strict=True)):
            tokens = req.all_ids
            # Positions len - 1 .. len - 2 + n get the fed tokens' K/V.
            n = min(limit, self.k, self.buckets.max_seq_len + 1 - len(tokens))
            if n > 0 and self._hold(req.rid, tokens, n):
                todo.append((i, req, self.rows[req.rid], n))
        if not todo:
            return out
        self._catch_up([(req, row) for _, req, row, _ in todo])
        top = self.buckets.cfg.decode_buckets[-1]
        for start in range(0, len(todo), top):
            part = todo[start:start + top]
            drafted = self._decode([(req, row, n) for _, req, row, n in part])
            for (i, _, _, _), d in zip(part, drafted, strict=True):
                out[i] = d
        self.runner.check_no_compiles()
        return out

    def release(self, rid: str) -> None:
        """Free a finished or aborted request's draft pages."""
        row = self.rows.pop(rid, None)
        if row is not None:
            self.allocator.free(row.pages)

    def _hold(self, rid: str, tokens: list[int], n: int) -> bool:
        """Roll rid's draft K/V back to what matches `tokens` (the last token excluded: the
        decode program feeds it) and hold pages for n drafting steps; False if the pool
        has no room (the row does not draft)."""
        row = self.rows.setdefault(rid, _DraftRow())
        valid = min(_common_prefix(row.tokens, tokens), len(tokens) - 1)
        del row.tokens[valid:]
        keep = pages_for(valid, self.page)
        self.allocator.free(row.pages[keep:])
        del row.pages[keep:]
        need = pages_for(len(tokens) - 1 + n, self.page) - len(row.pages)
        if not self.allocator.can_allocate(need):
            return False
        row.pages += self.allocator.allocate(need)
        return True

    def _catch_up(self, rows: list[tuple[Req, _DraftRow]]) -> None:
        """DRAFT_EXTEND steps until each row's draft K/V holds all its tokens but the last:
        rows packed greedily into the largest EXTEND bucket, long ones in chunks."""
        c = self.buckets.cfg
        max_t, max_b = c.extend_token_buckets[-1], c.extend_seq_buckets[-1]
        behind = [(req, row) for req, row in rows if len(row.tokens) < len(req.all_ids) - 1]
        while behind:
            batch, budget = [], max_t
            for req, row in behind[:max_b]:
                if budget == 0:
                    break
                start = len(row.tokens)
                ids = req.all_ids[start:min(len(req.all_ids) - 1, start + budget)]
                budget -= len(ids)
                batch.append((row, BatchRow(req, ids, start, row.pages, sample=False)))
            self._extend([b for _, b in batch])
            for row, b in batch:
                row.tokens += b.input_ids
            behind = [(req, row) for req, row in behind
                      if len(row.tokens) < len(req.all_ids) - 1]

    def _extend(self, rows: list[BatchRow]) -> None:
        t0 = time.perf_counter()
        batch = ScheduleBatch(ForwardMode.EXTEND, rows, [])
        shape = self.buckets.bucket_for(batch)
        flat = pack_flat(rows, [], shape, self.page,
                         np.zeros(shape.num_extend_seqs, np.int32))
        t1 = time.perf_counter()
        key = StepKey(ForwardMode.EXTEND, shape)
        self.kv = self._exe[self._name(key)](self.params, self.kv, flat)
        self.runner.step_counts[ForwardMode.DRAFT_EXTEND] += 1
        # Never read back (it returns only the pool, which the next launch takes): the
        # next DRAFT_DECODE's readback completes it in the trace, and its device time
        # counts in that step's.
        self._record(batch, shape, ForwardMode.DRAFT_EXTEND, t0, t1)

    def _record(self, batch: ScheduleBatch, shape: BucketShape, mode: ForwardMode,
                t0: float, t1: float) -> StepRecord | None:
        """A draft launch as a trace step (None without a trace): packing from t0 to t1,
        launched now."""
        if self.trace is None:
            return None
        rec = step_record(batch, shape, t0, t1, time.perf_counter(),
                          self.runner.compiles_after_warmup, mode=mode)
        return self.trace.record(rec)

    def _decode(self, rows: list[tuple[Req, _DraftRow, int]]) -> list[list[int]]:
        """One DRAFT_DECODE step: each row fed its last token, n draft tokens back (drawn
        from q for sampled rows, argmax for the rest)."""
        t0 = time.perf_counter()
        r, c = self.runner, self.buckets.cfg
        bd = smallest_fitting(c.decode_buckets, len(rows), "draft rows")
        key = next(k for k in self.decode_keys if k.shape.num_decode_seqs == bd)
        batch_rows = [BatchRow(req, [req.all_ids[-1]], len(req.all_ids) - 1, row.pages,
                               sample=True, num_steps=n) for req, row, n in rows]
        flat = pack_steps(pack_flat([], batch_rows, key.shape, self.page,
                                    np.zeros(bd, np.int32)), batch_rows, key.shape, self.page)
        padded: list[BatchRow | None] = [*batch_rows, *[None] * (bd - len(rows))]
        stochastic = np.zeros(bd, np.int32)
        stochastic[:len(rows)] = [sampled_draft(req) for req, _, _ in rows]
        slots, _ = r.slots_of(padded)
        words = np.concatenate([slots, stochastic, r.sampling_batch(bd, padded).to_words()])
        batch = ScheduleBatch(ForwardMode.DECODE, [], batch_rows)
        t1 = time.perf_counter()
        toks, self.kv, self.q = self._exe[self._name(key)](self.params, self.kv, self.q,
                                                           flat, words)
        r.step_counts[ForwardMode.DRAFT_DECODE] += 1
        r.costs.watch(draft_cost_key(bd), toks)
        rec = self._record(batch, key.shape, ForwardMode.DRAFT_DECODE, t0, t1)
        toks = np.asarray(toks)  # [K, bd]
        if rec is not None:
            assert self.trace is not None
            rec.decode_steps = self.k
            self.trace.ready(rec, time.perf_counter(), waited=True)
        out = []
        for i, (req, row, n) in enumerate(rows):
            d = toks[:n, i].tolist()
            # K/V was written for the last token and the first n - 1 drafts.
            row.tokens = [*req.all_ids, *d[:n - 1]]
            out.append(d)
            if stochastic[i]:
                self.sampled[req.rid] = d
        return out


def sampled_draft(req: Req) -> bool:
    """Whether req's drafts are drawn from the draft's distribution q and verified by the
    standard rejection rule: a sampled row without a grammar (a grammar cuts drafts short
    at the first token it refuses, which would bias the rule; those rows draft greedily,
    exact under the one-hot rule)."""
    return req.sampling.temperature >= sampling.GREEDY_TEMPERATURE and req.grammar is None


def draft_cost_key(rows: int) -> str:
    """Cost-table key of a DRAFT_DECODE step of a `rows`-row bucket: speculation with a
    draft model pays it on top of the verify step."""
    return f"draft_decode/bd{rows}"
