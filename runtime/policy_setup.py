"""The decode-first prefill policy of an engine, from the runner's measured step costs.

At start-up, after warm-up, a DECODE step of the full batch (once to warm the process,
then timed) and the policy's MIXED step at its smallest chunk (one run) run on real tokens
that write only the padding page (the runner's cost-seed inputs: padding would time as
free on the packed CPU path). What the MIXED step takes beyond the DECODE step, per token
of extend work, is the cost per token (prefill_policy.StepCosts); the target is
--itl_target_ms or, by default, prefill_policy.default_target of the decode step. Both are
logged. Few runs, since start-up time counts and a loaded machine's timings are noisy:
serving corrects both (PrefillPolicy.observe, observe_decode).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from models.forward_mode import ForwardMode
from runtime import prefill_policy
from runtime.bucket_plan import StepKey
from runtime.prefill_policy import PrefillPolicy, SplitShape, StepCosts
from runtime.server_args import ServerArgs

if TYPE_CHECKING:
    from runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _time_step(runner: ModelRunner, key: StepKey, repeats: int = 1, warm: bool = False
               ) -> float:
    """Seconds of the fastest of `repeats` runs of `key`'s program (after one to warm the
    process up). Few runs: start-up time counts, and serving corrects the costs."""
    arrays, slots = runner.cost_seed_inputs(key.shape)
    plain = runner.paths["plain"]
    best = float("inf")
    for i in range(repeats + warm):
        t0 = time.perf_counter()
        plain.run_forward(key, arrays, slots).block_until_ready()
        if i or not warm:
            best = min(best, time.perf_counter() - t0)
    return best


def measure_costs(runner: ModelRunner) -> StepCosts:
    """StepCosts of `runner`, whose plan holds the policy's MIXED programs: the full
    DECODE step, and what the smallest chunk's MIXED step adds to it, per token of work.
    One MIXED run gives no fixed part (step_s 0): the level is what serving corrects."""
    keys = runner.step_keys()
    decode = max((k for k in keys if k.mode is ForwardMode.DECODE),
                 key=lambda k: k.shape.num_decode_seqs)
    small = min((k for k in keys if k.mode is ForwardMode.MIXED),
                key=lambda k: (k.shape.num_extend_tokens, k.shape.num_extend_seqs,
                               k.shape.num_pages_per_seq))
    weight = prefill_policy.pair_weight(runner.model_cfg)
    d = _time_step(runner, decode, warm=True)
    m = _time_step(runner, small)
    work = prefill_policy.extend_work(small.shape.num_extend_tokens, 0, weight)
    return StepCosts(d, 0.0, max(m - d, 1e-6) / work, weight)


def build_policy(args: ServerArgs, runner: ModelRunner) -> PrefillPolicy | None:
    """The policy `args` ask for, or None (prefill first) where they turn it off or the
    runner was built without its MIXED programs."""
    if not args.decode_first:
        return None
    shapes = runner.cfg.mixed_shapes
    if not shapes or runner.cfg.enable_mixed:
        logger.info("prefill policy off: the runner has no policy MIXED programs "
                    "(RunnerConfig.mixed_shapes)")
        return None
    t0 = time.perf_counter()
    costs = measure_costs(runner)
    smallest = min(te for te, _, _ in shapes)
    fixed = None if args.itl_target_ms is None else args.itl_target_ms / 1000
    splitter = runner.paths.get("split_prefill")
    split = (SplitShape(runner.cfg.policy_split_tokens, runner.model_cfg.num_layers,
                        tuple(splitter.interval_sizes))
             if splitter is not None and runner.cfg.policy_split_tokens else None)
    policy = PrefillPolicy(fixed, costs, shapes, split)
    target = policy.target_s
    source = "default" if fixed is None else "--itl_target_ms"
    logger.info("prefill policy: decode first, itl target %.0f ms (%s: %.1fx the %d-row "
                "decode step of %.1f ms); MIXED step = %.1f ms + %.3f ms per token of "
                "extend work; chunk of %d from 0 predicted %.0f ms, of %d %.0f ms; measured "
                "in %.1f s; layer intervals of %s", 1e3 * target, source, target / costs.decode_s,
                max(bd + be for _, be, bd in shapes), 1e3 * costs.decode_s,
                1e3 * (costs.decode_s + costs.step_s), 1e3 * costs.token_s, smallest,
                1e3 * costs.mixed_s(smallest, 0), max(te for te, _, _ in shapes),
                1e3 * costs.mixed_s(max(te for te, _, _ in shapes), 0),
                time.perf_counter() - t0,
                "none" if split is None else f"{split.tokens} tokens, sizes {split.sizes}")
    return policy

