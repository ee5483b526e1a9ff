"""The default prefill policy: decode first, prefill fills the step up to a latency target.

Every step carries the running decode rows. What is left of the step, up to the per-step
inter-token-latency target (`--itl_target_ms`), goes to prefill:

- nothing decodes: a whole EXTEND batch (the chunked-prefill budget), so an idle server's
  TTFT and the first step of a burst pay nothing for the policy;
- streams decode: a token-axis chunk in a MIXED step, the largest chunk bucket whose
  predicted MIXED step fits the target (the step cost model below); the smallest bucket
  when none fits, so a prefill always advances;
- streams decode and no chunk fits, as where the prompt has reached a long context and
  attention over it makes even the smallest chunk overrun the target (by INTERVAL_OVERRUN:
  near it, the smallest chunk): a layer interval
  (split prefill) of the largest chunk beside a DECODE step, if the runner compiled its
  programs (SplitShape) and the interval's step is the cheaper; the chunk advances a few
  decoder layers a step, as many as keep each step within the target (interval_layers);
- every decoding stream is young (fewer than YOUNG_STREAM_TOKENS tokens) and every
  waiting prompt has a free slot: the largest chunk. Such streams arrived with the prompts
  still waiting (a burst being admitted): small chunks would stretch the whole wave's
  prefill, every member's TTFT and the burst's throughput, for a reading pace nobody has
  settled into yet; they still get a token every step (at most one largest MIXED step
  apart). With more prompts waiting than free slots the server is overloaded, not
  admitting a burst: the young streams are the ones a large chunk would stall longest.

A step's chunk is priced as what the batch builder will put in it: the rest of the prompt
mid-chunk (at its position), then the waiting prompts from position 0 (a chunk whose
prompt ends early is filled from the queue).

The policy's MIXED programs are few (policy_shapes): one extend row and as many decode
rows as fit the batch beside it, per chunk bucket but the largest, which has
max_extend_seqs rows; the decode rows are padded (free on the packed CPU path, which skips
padding) and every shape has max_running_requests rows, so all of them share the largest
DECODE bucket's sampler.

Host only (no jax): the scheduler calls `plan` each step; the engine builds the policy
from the runner's measured step costs (runtime/policy_setup.py) and, as MIXED steps are
read back, tells it what each took on the device (`observe`): predictions are scaled by
the moving ratio of measured to predicted.
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig

# A stream that has decoded fewer tokens than this does not bound the step (module doc).
YOUNG_STREAM_TOKENS = 8
# The default target: this many times the running batch's DECODE step, measured at start-up
# and followed while serving (a stream slows to ~1/4 of its pace while a prompt prefills
# beside it). Below 4 because the steps the cost model sizes are device time: the ITL a
# client sees adds the host's and the network's jitter (docs/multiplexing.md).
DEFAULT_DECODE_MULTIPLE = 3.75
# Chunk buckets of the MIXED programs (those up to the chunked-prefill size). 96 sits
# between 64 and 128 because the default target (~4 decode steps) usually falls between
# those two chunks' steps: without it a prompt advances 64 tokens a step where 96 fit.
CHUNK_BUCKETS = (64, 96, 128, 256, 512)
# A layer interval replaces the smallest chunk only where that chunk's predicted step
# overruns the target by this factor: near the target the MIXED step's measured correction
# (observe) keeps chunks on it, while an interval's first layers are priced from costs
# measured on other shapes (a 512-token row from position 0 at start-up).
INTERVAL_OVERRUN = 1.25
# The measured / predicted correction: an exponential moving average, bounded.
SCALE_SMOOTHING = 0.2
SCALE_BOUND = 3.0


def pair_weight(cfg: ModelConfig) -> float:
    """Token-equivalents of one attention (query, key) pair: its FLOPs (QK^T and PV, 4 per
    head dim) against one token's matmul FLOPs (q, k, v, o and the MLP), over all layers
    alike (runtime/split_prefill.layer_work's rule)."""
    heads_dim = cfg.num_heads * cfg.head_dim
    linear = 2 * cfg.hidden_size * (2 * heads_dim + 2 * cfg.num_kv_heads * cfg.head_dim) \
        + 6 * cfg.hidden_size * cfg.intermediate_size
    return 4 * heads_dim / linear


def extend_work(tokens: int, start_pos: int, weight: float) -> float:
    """Token-equivalents of prefilling positions [start_pos, start_pos + tokens): the
    matmuls' tokens plus the attention's (query, key) pairs at `weight` each."""
    return tokens + weight * tokens * (start_pos + (tokens + 1) / 2)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Device seconds of the steps the policy chooses between (measured at start-up).

    decode_s: a DECODE step of the full batch (the largest decode bucket);
    step_s: what an extend step costs beyond its tokens' work (launch, weight reads);
    token_s: seconds per token-equivalent of extend work (extend_work).
    A MIXED step is predicted as decode_s + step_s + token_s * work: the decode rows
    priced as a step of their own, an upper bound (inside a MIXED step they share its
    weight reads)."""

    decode_s: float
    step_s: float
    token_s: float
    pair_weight: float

    def mixed_s(self, tokens: int, start_pos: int) -> float:
        return self.decode_s + self.step_s + self.token_s * extend_work(
            tokens, start_pos, self.pair_weight)

    def to_json(self) -> dict[str, float]:
        return {"decode_ms": 1e3 * self.decode_s, "step_ms": 1e3 * self.step_s,
                "token_ms": 1e3 * self.token_s, "pair_weight": self.pair_weight}


@dataclasses.dataclass(frozen=True)
class SplitShape:
    """The layer-interval prefill a runner compiled for the policy: one row of `tokens`,
    advanced `sizes` layers (any of them) of `num_layers` per call."""

    tokens: int
    num_layers: int
    sizes: tuple[int, ...]


def split_pays(num_layers: int, min_interval: int, tokens: int, smallest_chunk: int) -> bool:
    """Whether a layer interval can make a finer step than the smallest chunk: its
    fraction of the chunk's layers holds fewer token-equivalents than that chunk (a
    2-layer interval of 30 layers of 512 tokens: 34 against 64; of a 4-layer model: 256),
    so compiling its programs for the policy is worth it."""
    return min_interval * tokens < smallest_chunk * num_layers


@dataclasses.dataclass(frozen=True)
class PrefillDecision:
    """Which path a step's prefill took and why (the execution trace keeps it per step)."""

    path: str  # "extend" | "mixed" | "mixed_young" | "interval"
    reason: str
    decode_rows: int
    chunk_tokens: int  # the step's prefill token budget
    max_rows: int  # prefill rows it may carry
    target_ms: float
    predicted_ms: float | None  # the cost model's MIXED step at the chunk's position
    scale: float = 1.0  # the measured / predicted correction in it (PrefillPolicy.observe)


def policy_shapes(token_buckets: tuple[int, ...], max_extend_seqs: int,
                  max_rows: int) -> tuple[tuple[int, int, int], ...]:
    """(extend tokens, extend rows, decode rows) of the policy's MIXED programs: a batch
    has at most max_rows rows, so beside e extend rows at most max_rows - e decode."""
    if max_rows < 2 or not token_buckets:
        return ()
    # The largest bucket holds several rows; with more decode rows than fit beside them the
    # plan falls back to the next bucket's one-row program.
    be = min(max_extend_seqs, token_buckets[-1], max_rows - 1)
    *smaller, top = token_buckets
    return tuple([(te, 1, max_rows - 1) for te in smaller] + [(top, be, max_rows - be)])


def chunk_buckets(chunk_size: int) -> tuple[int, ...]:
    """CHUNK_BUCKETS up to the chunk size, and the chunk size itself."""
    return tuple(sorted({b for b in CHUNK_BUCKETS if b < chunk_size} | {chunk_size}))


class PrefillPolicy:
    """Per step: how many prefill tokens and rows ride beside `decode_rows` decode rows."""

    def __init__(self, target_s: float | None, costs: StepCosts,
                 shapes: tuple[tuple[int, int, int], ...],
                 split: SplitShape | None = None) -> None:
        """target_s: the per-step target; None: default_target of the decode step as
        measured while serving (observe_decode), from costs.decode_s on. split: the
        layer-interval programs, if the runner has them."""
        if target_s is not None and target_s <= 0:
            raise ValueError(f"itl target {target_s} s: must be > 0 (0 turns the policy off)")
        if not shapes:
            raise ValueError("the policy needs MIXED programs (policy_shapes)")
        self.fixed_target_s, self.costs, self.shapes = target_s, costs, shapes
        self.split = split
        self.smallest_chunk = min(te for te, _, _ in shapes)
        # Measured over predicted device time of the MIXED steps run so far (observe):
        # the start-up costs drift with the machine's load and the attention's real cost.
        self.scale = 1.0
        # The running batch's DECODE step, as the host last measured it (observe_decode).
        self.decode_s = costs.decode_s

    @property
    def target_s(self) -> float:
        if self.fixed_target_s is not None:
            return self.fixed_target_s
        return default_target(dataclasses.replace(self.costs, decode_s=self.decode_s),
                              self.smallest_chunk, self.scale)

    def observe_decode(self, measured_s: float) -> None:
        """A DECODE step took measured_s on the device: the default target follows the
        streams' own pace (a loaded or idle machine, a growing context)."""
        if measured_s > 0:
            self.decode_s += SCALE_SMOOTHING * (measured_s - self.decode_s)

    def observe(self, predicted_s: float, measured_s: float) -> None:
        """A MIXED step that the start-up costs predicted at predicted_s (unscaled) took
        measured_s on the device."""
        if predicted_s > 0 and measured_s > 0:
            ratio = min(max(measured_s / predicted_s, 1 / SCALE_BOUND), SCALE_BOUND)
            self.scale += SCALE_SMOOTHING * (ratio - self.scale)

    def plan(self, decode_rows: int, young: bool, start_pos: int,
             remaining: int | None, queued: int) -> PrefillDecision:
        """The prefill budget of a step with `decode_rows` (> 0) decode rows. `start_pos`,
        `remaining`: where the prompt mid-chunk stands and its tokens left (None: no prompt
        is mid-chunk). `queued`: prompt tokens waiting behind it (admissions start at 0).
        `young`: every decode row is young and every waiting prompt has a free slot."""
        fits = [s for s in self.shapes if s[2] >= decode_rows]
        if not fits:  # more decode rows than any MIXED program: decode alone this step
            return self._decision("mixed", "no MIXED program holds the decode rows",
                                  decode_rows, 0, 0, None)
        top = max(te for te, _, _ in fits)
        rows = max(be for te, be, _ in fits if te == top)
        if young:
            return self._decision("mixed_young", f"every decoding stream is within its "
                                  f"first {YOUNG_STREAM_TOKENS} tokens", decode_rows, top,
                                  rows, self._predict(top, start_pos, remaining, queued))
        by_tokens = sorted({te for te, _, _ in fits})
        for te in reversed(by_tokens):
            predicted = self._predict(te, start_pos, remaining, queued)
            if predicted <= self.target_s:
                rows = max(be for t, be, _ in fits if t == te)
                return self._decision("mixed", "largest chunk whose predicted step fits "
                                      "the target", decode_rows, te, rows, predicted)
        te = by_tokens[0]
        predicted = self._predict(te, start_pos, remaining, queued)
        if self.split is not None and predicted > INTERVAL_OVERRUN * self.target_s:
            interval = self._predict_interval(min(self.split.sizes), start_pos, remaining,
                                              queued)
            if interval < predicted:
                return self._decision(
                    "interval", f"no chunk fits: the smallest's step {1e3 * predicted:.0f} "
                    f"ms, a {min(self.split.sizes)}-layer interval's {1e3 * interval:.0f} ms",
                    decode_rows, self.split.tokens, 1, interval)
        rows = max(be for t, be, _ in fits if t == te)
        return self._decision("mixed", "no chunk fits: the smallest", decode_rows, te, rows,
                              predicted)

    def interval_layers(self, remaining: int, decode_s: float | None,
                        layer_s: float | None, start_pos: int, tokens: int) -> int:
        """Layers of the next interval of a split prefill of `tokens` from `start_pos` with
        `remaining` layers to go, beside a DECODE step of decode_s seconds (None: as last
        measured): as many as keep the step within the target, at least one. layer_s: a
        layer's measured seconds (None: the cost model's)."""
        if decode_s is None:
            decode_s = self.decode_s
        if layer_s is None or layer_s <= 0:
            layer_s = self._layer_s(start_pos, tokens)
        fit = (self.target_s - decode_s) / layer_s
        return max(1, min(remaining, int(fit + 1e-9)))  # 1e-9: 9.999... layers fit 10

    def _layer_s(self, start_pos: int, tokens: int) -> float:
        """The cost model's seconds of one decoder layer of a split prefill."""
        assert self.split is not None
        work = extend_work(tokens, start_pos, self.costs.pair_weight)
        return self.scale * self.costs.token_s * work / self.split.num_layers

    def _predict_interval(self, k: int, start_pos: int, remaining: int | None,
                          queued: int) -> float:
        """A DECODE step beside k layers of the split prefill the scheduler would start: the
        mid-chunk prompt's rest from start_pos, else the next prompt from 0 (one row)."""
        assert self.split is not None
        if remaining is not None:
            tokens, pos = min(self.split.tokens, remaining), start_pos
        else:
            tokens, pos = min(self.split.tokens, queued), 0
        return self.decode_s + k * self._layer_s(pos, tokens)

    def _predict(self, te: int, start_pos: int, remaining: int | None, queued: int) -> float:
        """The MIXED step of a te-token chunk: the running batch's decode step as last
        measured, plus the chunk's work (the mid-chunk prompt's rest from start_pos, the
        queue's prompts from 0 after it), times the measured correction."""
        mid = 0 if remaining is None else min(te, remaining)
        rest = min(te - mid, queued)
        c = self.costs
        work = extend_work(mid, start_pos, c.pair_weight) + extend_work(rest, 0, c.pair_weight)
        return self.scale * (self.decode_s + c.step_s + c.token_s * work)

    def _decision(self, path: str, reason: str, decode_rows: int, tokens: int, rows: int,
                  predicted: float | None) -> PrefillDecision:
        return PrefillDecision(path, reason, decode_rows, tokens, rows,
                               1e3 * self.target_s,
                               None if predicted is None else 1e3 * predicted, self.scale)

    @staticmethod
    def whole(decode_rows: int, tokens: int, target_s: float) -> PrefillDecision:
        """The decision of a step with nothing decoding: a whole EXTEND batch."""
        return PrefillDecision("extend", "nothing decodes", decode_rows, tokens, 0,
                               1e3 * target_s, None)

    def to_json(self) -> dict:
        return {"itl_target_ms": 1e3 * self.target_s,
                "target": "fixed" if self.fixed_target_s else
                f"{DEFAULT_DECODE_MULTIPLE}x the decode step as measured while serving",
                "decode_ms_now": 1e3 * self.decode_s, "costs": self.costs.to_json(),
                "scale": self.scale,
                "mixed_shapes": [list(s) for s in self.shapes],
                "split": None if self.split is None else dataclasses.asdict(self.split),
                "young_stream_tokens": YOUNG_STREAM_TOKENS}


def default_target(costs: StepCosts, smallest_chunk: int, scale: float = 1.0) -> float:
    """The target when --itl_target_ms is not given: DEFAULT_DECODE_MULTIPLE x the DECODE
    step, but at least the smallest chunk's MIXED step from position 0 (else no chunk
    would ever fit; `scale`: the policy's measured / predicted correction)."""
    return max(DEFAULT_DECODE_MULTIPLE * costs.decode_s,
               scale * costs.mixed_s(smallest_chunk, 0))
