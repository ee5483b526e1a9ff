"""The static shape buckets: which forward executables exist (one per mode and bucket)
and which one a batch runs. Plain Python (no jax), fixed at start-up from RunnerConfig.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from models.forward_mode import ForwardMode
from runtime.batch_builder import BucketShape
from runtime.config import RunnerConfig
from runtime.schedule_batch import ScheduleBatch


@dataclasses.dataclass(frozen=True)
class StepKey:
    """Static identity of one executable."""

    mode: ForwardMode
    shape: BucketShape


def smallest_fitting(buckets: Sequence[int], need: int, what: str) -> int:
    for b in buckets:
        if b >= need:
            return b
    raise ValueError(f"{what}={need} exceeds the largest bucket {buckets[-1]}")


class BucketPlan:
    """Bucket rules of one runner: page size and RunnerConfig in, step keys out."""

    def __init__(self, cfg: RunnerConfig, page_size: int) -> None:
        self.cfg, self.page_size = cfg, page_size

    def _pages(self, kv_len: int) -> int:
        return kv_len // self.page_size

    def step_keys(self) -> list[StepKey]:
        """Every forward executable the runner may call, fixed at start-up."""
        c = self.cfg
        dec_nps, ext_nps = self.decode_widths(), self._extend_widths()
        keys = [StepKey(ForwardMode.DECODE, BucketShape(0, 0, bd, n))
                for bd in c.decode_buckets for n in dec_nps]
        for te in c.extend_token_buckets:
            for be in (b for b in c.extend_seq_buckets if b <= te):
                fresh = [0] if self._prefixless_extend else []
                keys += [StepKey(ForwardMode.EXTEND, BucketShape(te, be, 0, n))
                         for n in fresh + ext_nps]
                if c.enable_mixed:
                    keys += [StepKey(ForwardMode.MIXED, BucketShape(te, be, bd, n))
                             for bd in c.decode_buckets for n in ext_nps]
        return keys + [StepKey(ForwardMode.MIXED, s) for s in self._policy_mixed()]

    def _policy_mixed(self) -> list[BucketShape]:
        """The decode-first policy's MIXED buckets (RunnerConfig.mixed_shapes), in the
        order bucket_for tries them: fewest tokens, then fewest rows."""
        if self.cfg.enable_mixed:
            return []
        return [BucketShape(te, be, bd, n) for te, be, bd in sorted(self.cfg.mixed_shapes)
                for n in self._extend_widths()]

    def decode_widths(self) -> list[int]:
        """Page-table widths of DECODE executables. Every backend's decode attention walks
        each batch's actual context (the jnp path in 128-token blocks with a dynamic trip
        count, the CPU and Pallas kernels page by page up to seq_lens), so a wider table
        costs only its host packing: one width, the longest context, serves all."""
        return [self._pages(self.cfg.kv_len_buckets[-1])]

    def _extend_widths(self) -> list[int]:
        """Page-table widths of EXTEND / MIXED executables over a cached prefix. The jnp
        extend scores every token against every page-table slot in one pass, so its cost
        follows the width and it keeps one width per kv_len bucket; the CPU and Pallas
        kernels read each row's prefix pages up to seq_lens and take one width."""
        if self.cfg.attention_backend == "xla":
            return [self._pages(n) for n in self.cfg.kv_len_buckets]
        return self.decode_widths()

    def verify_shape(self, rows: int, k: int) -> BucketShape:
        """The TARGET_VERIFY bucket of `rows` rows of 1 + k tokens: an extend step whose
        rows are decode_buckets."""
        b = smallest_fitting(self.cfg.decode_buckets, rows, "verify rows")
        return BucketShape(b * (k + 1), b, 0, self.decode_widths()[-1])

    def verify_shapes(self, k: int) -> list[BucketShape]:
        """Every TARGET_VERIFY bucket, one per decode bucket. Its page-table width is
        decode's: every backend's verify attention reads each row's prefix up to its
        length (the CPU and Pallas extend kernels; the jnp path walks it as decode does,
        attention_ref._verify), so a wider table costs only its host packing."""
        return [BucketShape(b * (k + 1), b, 0, n) for b in self.cfg.decode_buckets
                for n in self.decode_widths()]

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
        # A multi-step row's last step reads the context before its last position.
        max_ctx = max(r.start_pos + r.num_steps - 1 for r in (*ext, *dec))
        widths = self._extend_widths() if ext else self.decode_widths()
        np_ = widths[-1] if len(widths) == 1 else self._pages(
            smallest_fitting(c.kv_len_buckets, max_ctx, "sequence length"))
        if max_ctx > self.max_seq_len:
            raise ValueError(f"sequence length={max_ctx} exceeds the largest bucket "
                             f"{self.max_seq_len}")
        if max_ctx == 0 and not dec and self._prefixless_extend:
            np_ = 0
        if ext and dec and self._policy_mixed():
            return self._policy_bucket(ext_tokens, len(ext), len(dec), np_)
        te = smallest_fitting(c.extend_token_buckets, ext_tokens, "extend tokens") if ext else 0
        be = smallest_fitting(c.extend_seq_buckets, len(ext), "extend rows") if ext else 0
        bd = smallest_fitting(c.decode_buckets, len(dec), "decode rows") if dec else 0
        return BucketShape(te, be, bd, np_)

    def _policy_bucket(self, tokens: int, ext: int, dec: int, width: int) -> BucketShape:
        for s in self._policy_mixed():
            if (s.num_extend_tokens >= tokens and s.num_extend_seqs >= ext
                    and s.num_decode_seqs >= dec and s.num_pages_per_seq == width):
                return s
        raise ValueError(f"no MIXED bucket of the prefill policy holds {tokens} extend "
                         f"tokens in {ext} rows beside {dec} decode rows")

    @property
    def max_seq_len(self) -> int:
        return self.cfg.kv_len_buckets[-1]



def mode_of(shape: BucketShape) -> ForwardMode:
    """The plain step program of a bucket: extend rows and decode rows make a MIXED step,
    either alone an EXTEND or a DECODE step (a step key's shape says which)."""
    if shape.num_extend_seqs and shape.num_decode_seqs:
        return ForwardMode.MIXED
    return ForwardMode.EXTEND if shape.num_extend_seqs else ForwardMode.DECODE


def cost_key(mode: ForwardMode, shape: BucketShape) -> str:
    """Cost-table key: decode steps by row bucket (their cost follows the context, not the
    page-table width); other steps by their whole shape."""
    if mode is ForwardMode.DECODE:
        return f"decode/bd{shape.num_decode_seqs}"
    return key_name(StepKey(mode, shape))


def key_name(key: StepKey) -> str:
    s = key.shape
    return (f"{key.mode.value}/te{s.num_extend_tokens}_be{s.num_extend_seqs}"
            f"_bd{s.num_decode_seqs}_np{s.num_pages_per_seq}")
