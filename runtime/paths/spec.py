"""Speculative decoding's TARGET_VERIFY step as a path: one program per verify bucket
(rows x (1 + k) tokens, bucket_plan.verify_shapes) runs the rows' last and drafted tokens
as an extend over their caches and samples a token at every position with the shared
sampler's body, each position seeded as plain decoding seeds it (runtime/spec_decode.py
says why that is the rejection rule). With a draft model, a sampled row's drafted
positions instead apply the standard rule to the draft's q rows (the draft path's `q`,
a device array the program takes with each position's q row and draft token): each
position's token is then its draft if accepted, else the residual draw. The scheduler
reads the [rows, 1 + k] tokens back and keeps the accepted ones; their K/V is already in
place, the rest is rolled back on the host (kv_len, pages)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.forward_batch import ForwardBatch, real_token_mask
from models.forward_mode import ForwardMode
from models.kv_pool import with_rings
from runtime import sampling
from runtime.batch_builder import BucketShape, input_layout, pack_flat, unflatten_inputs
from runtime.executable_budget import MULTI_STEP_COST, PlanPart
from runtime.grammar import draft_bitmasks, mask_width
from runtime.paths.base import ExecPath, Lowering
from runtime.request import MAX_LOGIT_BIAS, Req
from runtime.runner_sampling import PendingStep
from runtime.schedule_batch import ScheduleBatch, StepOutput


@dataclasses.dataclass
class _Position:
    """One token of a verify row, as the sampler's column builders read a row: its
    request, and end_pos, the position of the token sampled there (the seed's step).
    Only a row with no draft samples into its slot (sample): a drafting row's last token
    is known on the host when its next batch is built, and it has no penalties."""

    req: Req
    end_pos: int
    sample: bool


class VerifyPending(PendingStep):
    """A verify step's results: per row, the tokens sampled at its 1 + k positions."""

    def __init__(self, batch: ScheduleBatch, out: Any, index: np.ndarray, top_n: int) -> None:
        super().__init__(batch, out, np.zeros(0, np.int64), top_n)
        self._index = index  # [rows, 1 + k] token index of each row's positions

    def result(self) -> StepOutput:
        out = jax.tree.map(np.asarray, self.out)
        i = self._index
        top = (out.top_ids[i], out.top_logprobs[i]) if self._top_n else None
        return StepOutput(next_token_ids=out.next_tokens[i], logprobs=out.logprobs[i],
                          top_logprobs=top)


class SpecPath(ExecPath):
    name = "spec"

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.k = runner.cfg.speculative_num_draft_tokens
        self.shapes = runner.buckets.verify_shapes(self.k)
        self._exe: dict[BucketShape, Callable] = {}

    @property
    def _draft(self) -> Any:
        """The draft-model path (runtime/paths/draft.py), whose q rows sampled drafts
        were drawn from; None with prompt lookup."""
        return self.runner.paths.get("draft")

    @property
    def names(self) -> list[str]:
        return [self._name(s) for s in self.shapes]

    def _name(self, s: BucketShape) -> str:
        return f"target_verify/bd{s.num_extend_seqs}_k{self.k}_np{s.num_pages_per_seq}"

    def plan_parts(self) -> list[PlanPart]:
        c = self.runner.cfg
        return [PlanPart("TARGET_VERIFY", len(self.shapes), MULTI_STEP_COST,
                         "--speculative_algorithm: one per decode bucket "
                         f"({len(c.decode_buckets)}), each row 1 + "
                         "--speculative_num_draft_tokens tokens")]

    def lowerings(self, params: Any, kv: Any, state: Any) -> Iterable[Lowering]:
        r = self.runner
        q = () if self._draft is None else (
            jax.ShapeDtypeStruct(self._draft.q.shape, jnp.float32),)
        for s in self.shapes:
            drafts = () if not q else (jax.ShapeDtypeStruct((2, s.num_extend_tokens),
                                                            jnp.int32),)
            yield self._name(s), functools.partial(
                self._program(s).lower, params, kv, state, r.flat_input(s),
                r.abstract_sample_inputs(s.num_extend_tokens)[1], *q, *drafts)

    def install(self, compiled: Mapping[str, Callable]) -> None:
        self._exe = {s: compiled[self._name(s)] for s in self.shapes}

    def bucket_for(self, batch: ScheduleBatch) -> BucketShape | None:
        if batch.mode is not ForwardMode.TARGET_VERIFY:
            return None
        return self.runner.buckets.verify_shape(len(batch.decode_rows), self.k)

    def launch(self, batch: ScheduleBatch) -> PendingStep | None:
        if batch.mode is not ForwardMode.TARGET_VERIFY:
            return None
        r = self.runner
        shape = self.bucket_for(batch)
        assert shape is not None
        rows, width = batch.decode_rows, self.k + 1
        slots = np.full(shape.num_extend_seqs, r.max_running, np.int32)
        slots[:len(rows)] = [row.req.req_slot for row in rows]
        flat = pack_flat(rows, [], shape, r.cache_cfg.page_size, slots)
        positions: list[_Position | None] = [None] * shape.num_extend_tokens
        index = np.zeros((len(rows), width), np.int64)
        t = 0
        for i, row in enumerate(rows):
            n = len(row.input_ids)
            for j in range(n):
                positions[t + j] = _Position(row.req, row.start_pos + j + 1, n == 1)
            # Positions past a row's draft repeat its last one (the host never keeps them).
            index[i] = t + np.minimum(np.arange(width), n - 1)
            t += n
        words = r.sample_words(positions)
        self._grammar_masks(words, rows, len(positions))
        extra = () if self._draft is None else (self._draft.q, self._q_inputs(rows, len(positions)))
        out, r.kv, r.state = self._exe[shape](r.params, r.kv, r.state, flat, words, *extra)
        r.check_no_compiles()
        r.step_counts[ForwardMode.TARGET_VERIFY] += 1
        r.costs.watch(verify_cost_key(shape.num_extend_seqs), out.next_tokens)
        pending = VerifyPending(batch, out, index, r.cfg.max_top_logprobs)
        pending.shape = shape
        return pending

    def _q_inputs(self, rows: list, b: int) -> np.ndarray:
        """[2, T]: per position, the row of the draft's q (flattened [slots * k, V]) its
        draft was drawn from, or -1 (the one-hot rule: greedy and grammar rows, bonus
        positions, padding); and that draft token."""
        draft, k = self._draft, self.k
        out = np.zeros((2, b), np.int32)
        out[0] = -1
        t = 0
        for row in rows:
            n = len(row.input_ids)
            drafts = row.input_ids[1:]
            if drafts and draft.sampled.get(row.req.rid, [])[:n - 1] == drafts:
                out[0, t:t + n - 1] = row.req.req_slot * k + np.arange(n - 1)
                out[1, t:t + n - 1] = drafts
            t += n
        return out

    def _grammar_masks(self, words: np.ndarray, rows: list, b: int) -> None:
        """Each drafting grammar row's positions sample under the grammar advanced over
        the drafts before them (sample_words gave every position the first's mask)."""
        if not any(row.req.grammar is not None and len(row.input_ids) > 1 for row in rows):
            return
        v = self.runner.model_cfg.vocab_size
        w = mask_width(v)
        start = 2 * b + sampling.word_layout(b, w, MAX_LOGIT_BIAS)["token_bitmask"][0]
        mask = words[start:start + b * w].reshape(b, w)  # a view: [T, W]
        t = 0
        for row in rows:
            n = len(row.input_ids)
            if row.req.grammar is not None and n > 1:
                mask[t:t + n] = draft_bitmasks(row.req.grammar, row.input_ids[1:], v)
            t += n

    def _program(self, shape: BucketShape) -> Callable:
        r = self.runner
        model, cfg, mesh, place = r.model, r.model_cfg, r.mesh, r.placement
        backend = r.cfg.attention_backend
        te, be = shape.num_extend_tokens, shape.num_extend_seqs
        layout = input_layout(shape)
        sample = r.sample_body()
        mask_w = mask_width(cfg.vocab_size)

        def standard_rule(out, logits, words, q, drafts):
            """Positions with a q row (drafts[0] >= 0) take the standard rejection rule's
            token; the rest keep the sampler's."""
            use = drafts[0] >= 0  # [T]
            sp = sampling.SamplingBatch.from_words(words[2 * te:], te, mask_width=mask_w,
                                                   bias_slots=MAX_LOGIT_BIAS)
            q_rows = q.reshape(-1, q.shape[-1])[jnp.maximum(drafts[0], 0)]  # [T, V]
            tokens = jnp.where(use, sampling.verify_draft(logits, sp, q_rows, drafts[1]),
                               out.next_tokens)  # [T]
            # Raw logprobs of the tokens the rule chose (the sampler's are of its own).
            lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # [T]
            chosen = jnp.take_along_axis(logits.astype(jnp.float32), tokens[:, None],
                                         axis=-1)[:, 0] - lse  # [T]
            return out.replace(next_tokens=tokens,
                               logprobs=jnp.where(use & sp.logprobs, chosen, out.logprobs))

        def verify(params, kv, state, flat, words, *draft_q):
            arrays = unflatten_inputs(flat, layout)
            row_slots = arrays.pop("row_slots")  # [B]
            # Logits at every token, not only each row's last: [T] indices.
            arrays["logits_indices"] = jnp.arange(te, dtype=jnp.int32)
            batch = with_rings(ForwardBatch(**arrays, mode=ForwardMode.TARGET_VERIFY,
                                            num_extend_tokens=te, num_extend_seqs=be),
                               kv, row_slots)
            h = model.embed(params, batch.input_ids)  # [T, D]
            h, kv = model.run_layers(params, kv, h, batch, cfg, attention_backend=backend,
                                     mesh=mesh)
            logits = model.compute_logits(params, h, batch.logits_indices, cfg,
                                          real_token_mask(batch))  # [T, V]
            out, state = sample(state, logits, words)
            if draft_q:  # a draft model: q [slots, k, V], drafts [2, T]
                out = jax.lax.cond(jnp.any(draft_q[1][0] >= 0),
                                   lambda: standard_rule(out, logits, words, *draft_q),
                                   lambda: out)
            return out, kv, state

        return jax.jit(verify, donate_argnums=(1, 2),
                       **place.out(place.replicated, place.kv, place.replicated))


def verify_cost_key(rows: int) -> str:
    """Cost-table key of a verify step of a `rows`-row bucket (decode's is decode/bd<rows>)."""
    return f"target_verify/bd{rows}"
