"""Data-parallel attention (--dp, SGLang's DP attention): the host half (no jax).

Each of the dp ranks of the mesh's `dp` axis owns its own requests and its own KV pages:
the pool's page axis is split over `dp` (rank r holds pages [r * P, (r + 1) * P) of the
global pool, which it indexes 0..P-1 with its own page 0 as the padding sink), and every
rank has a Scheduler of its own over its pages, its share of the sampler slots and its
own prefix cache. One step runs every rank's batch in one SPMD executable: attention and
the KV writes run per rank under shard_map (a rank reads only its pages), everything else
(embeddings, projections, the MLP or the experts over `ep`, the logits) over all ranks'
tokens. A rank with nothing to run is IDLE for the step: its share of the bucket is
padding, so it still joins the step's collectives.

DPScheduler stands where the engine expects one Scheduler: a new request goes to the rank
whose prefix cache holds the longest prefix of it, else the least loaded (fewest running
and waiting requests); next_batch asks every rank and packs their batches into a DPBatch;
process_results hands each rank its rows' results. The runner pads every rank's batch to
one per-rank bucket (dp_shape: the largest of the ranks' buckets): an executable's shape
is the per-rank bucket, its arrays dp times that, rank after rank (dp_pack).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import numpy as np

from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape, pack_rows
from runtime.config import CacheConfig, SchedulerConfig
from runtime.request import Req
from runtime.schedule_batch import BatchRow, ScheduleBatch, StepOutput
from runtime.scheduler import ReqEvent, Scheduler, SchedulerStats


@dataclasses.dataclass
class DPBatch(ScheduleBatch):
    """One step of every rank: parts[r] is rank r's batch, None for an IDLE rank.
    extend_rows / decode_rows are every rank's, and `rows` (the order of results) is
    rank after rank, each rank's extend rows then its decode rows."""

    parts: list[ScheduleBatch | None] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, parts: list[ScheduleBatch | None]) -> DPBatch:
        real = [p for p in parts if p is not None]
        ext = [r for p in real for r in p.extend_rows]
        dec = [r for p in real for r in p.decode_rows]
        mode = (ForwardMode.MIXED if ext and dec else
                ForwardMode.EXTEND if ext else ForwardMode.DECODE)
        return cls(mode, ext, dec, parts=parts)

    @property
    def rows(self) -> list[BatchRow]:
        return [r for p in self.parts if p is not None for r in p.rows]

    @property
    def num_idle(self) -> int:
        return sum(p is None for p in self.parts)


def split_output(output: StepOutput, sizes: list[int]) -> list[StepOutput]:
    """output's rows cut into consecutive pieces of these sizes."""
    out, start = [], 0
    for n in sizes:
        sl = slice(start, start + n)
        top = output.top_logprobs
        out.append(StepOutput(
            next_token_ids=output.next_token_ids[sl],
            logprobs=None if output.logprobs is None else output.logprobs[sl],
            top_logprobs=None if top is None else (top[0][sl], top[1][sl])))
        start += n
    return out


class DPScheduler:
    """dp Schedulers, one per data-parallel rank, behind the Scheduler interface the
    engine loop uses. `config` is one rank's (its pool is one rank's pages)."""

    def __init__(self, config: SchedulerConfig, dp: int, eos_token_ids: Iterable[int],
                 decode_fn: Callable[[list[int]], str] | None = None) -> None:
        eos = tuple(eos_token_ids)
        self.rank_config = config
        self.ranks = [Scheduler(config, eos, decode_fn, first_slot=r * config.max_running_requests)
                      for r in range(dp)]
        # What the engine and the server report: the pool and slots of all ranks.
        self.config = dataclasses.replace(
            config, max_running_requests=dp * config.max_running_requests,
            cache=CacheConfig(config.cache.page_size, dp * config.cache.num_pages))

    @property
    def dp(self) -> int:
        return len(self.ranks)

    def rank_for(self, req: Req) -> int:
        """The rank a new request joins: the longest cached prefix, then the fewest
        running + waiting requests, then the lowest rank."""
        def key(r: int) -> tuple[int, int, int]:
            s = self.ranks[r]
            hit = s.prefix_cache.match_prefix(req.prompt_ids[:-1]).num_tokens
            return (-hit, len(s.running) + len(s.waiting), r)
        return min(range(self.dp), key=key)

    def add(self, req: Req) -> None:
        if any(req.rid in s._reqs for s in self.ranks):
            raise ValueError(f"duplicate request id {req.rid!r}")
        self.ranks[self.rank_for(req)].add(req)

    def abort(self, rid: str, message: str = "aborted") -> Req | None:
        for s in self.ranks:
            req = s.abort(rid, message)
            if req is not None:
                return req
        return None

    def is_idle(self) -> bool:
        return all(s.is_idle() for s in self.ranks)

    def flush_cache(self) -> bool:
        if not self.is_idle():
            return False
        return all([s.flush_cache() for s in self.ranks])

    def stats(self) -> SchedulerStats:
        per = [s.stats() for s in self.ranks]
        return SchedulerStats(**{f.name: sum(getattr(p, f.name) for p in per)
                                 for f in dataclasses.fields(SchedulerStats)})

    def next_batch(self) -> DPBatch | None:
        parts = [s.next_batch() for s in self.ranks]
        if all(p is None for p in parts):
            return None
        return DPBatch.of(parts)

    def process_results(self, batch: DPBatch, output: StepOutput) -> list[ReqEvent]:
        real = [(s, p) for s, p in zip(self.ranks, batch.parts, strict=True) if p is not None]
        pieces = split_output(output, [len(p.rows) for _, p in real])
        return [e for (s, p), o in zip(real, pieces, strict=True)
                for e in s.process_results(p, o)]


def dp_shape(batch: DPBatch, bucket_for: Callable[[ScheduleBatch], BucketShape],
             decode_width: int) -> BucketShape:
    """One bucket every rank's part fits: the largest extend and decode sizes of the
    parts, and a page table as wide as the widest part needs (a MIXED step, parts of both
    kinds, takes the decode width: the widest)."""
    shapes = [bucket_for(p) for p in batch.parts if p is not None]
    te, be, bd = (max(getattr(s, f) for s in shapes) for f in (
        "num_extend_tokens", "num_extend_seqs", "num_decode_seqs"))
    width = max(s.num_pages_per_seq for s in shapes)
    if batch.mode is ForwardMode.MIXED:
        width = max(width, decode_width)
    return BucketShape(te, be, bd, width)


def dp_padded_shape(shape: BucketShape, dp: int) -> BucketShape:
    """The whole step's padded size (dp ranks of `shape`), for the execution trace."""
    return BucketShape(dp * shape.num_extend_tokens, dp * shape.num_extend_seqs,
                       dp * shape.num_decode_seqs, shape.num_pages_per_seq)


def dp_pack(batch: DPBatch, shape: BucketShape, page_size: int) -> dict[str, np.ndarray]:
    """Each rank's part packed into `shape` (an IDLE rank: padding only), rank after rank.
    Page ids and cache slots stay each rank's own; the logits indices point into the
    whole token axis [dp * T]."""
    tokens = shape.num_extend_tokens + shape.num_decode_seqs
    packed = []
    for r, part in enumerate(batch.parts):
        a = pack_rows(part.extend_rows if part else [], part.decode_rows if part else [],
                      shape, page_size)
        a["logits_indices"] = a["logits_indices"] + r * tokens
        packed.append(a)
    return {k: np.concatenate([a[k] for a in packed]) for k in packed[0]}
