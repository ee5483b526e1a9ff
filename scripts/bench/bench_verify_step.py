"""A speculative TARGET_VERIFY step against a DECODE step of the same rows on random
Llama-3-8B-shaped bf16 weights: the GPU suite's spec section (scripts/bench/gpu_suite.py).
Writes JSON.

    python scripts/bench/bench_verify_step.py --out=spec.json                    # GPU (8B)
    .venv/bin/python scripts/bench/bench_verify_step.py --smoke --out=/tmp/spec.json  # CPU

One runner in the runtime's default layout for the device (on a GPU: Pallas attention,
one buffer per layer, wq|wk|wv and w_gate|w_up fused) with only the programs the two
steps need: DECODE and TARGET_VERIFY (1 + --draft_tokens tokens a row) at each of --rows,
their samplers, and the one small EXTEND program every runner has. Every row has
--context cached tokens; a verify row feeds its last token and k random drafts (what a
draft proposes does not change the target's step). The steps are bench_spec.py's bare
steps: launch to read-back, DECODE and TARGET_VERIFY of the same rows called alternately,
medians over --rounds. Target: a one-row verify step costs at most --target times the
one-row decode step (met or not is recorded). The JSON is rewritten after every row
count, so a run cut short keeps what it measured. (--smoke: a tiny random model in f32,
XLA's attention and dot, 64 cached tokens.)
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

import bench_common as bc
import numpy as np
from absl import app, flags
from gpu_shapes import LLAMA3_8B

from models.config import ModelConfig
from models.forward_mode import ForwardMode
from runtime.config import ServerArgs
from runtime.engine_setup import RunnerSetup
from runtime.model_runner import ModelRunner

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_verify_step.json", "JSON results path")
flags.DEFINE_bool("smoke", False, "a tiny random model (a CPU check of this script)")
flags.DEFINE_list("rows", ["1", "8"], "rows of each pair of steps (one decode bucket each)")
flags.DEFINE_integer("draft_tokens", 4, "k: drafted tokens a verify row scores after its "
                     "last one")
flags.DEFINE_integer("context", 512, "tokens already cached for every row")
flags.DEFINE_integer("rounds", 20, "timed calls of each step per row count")
flags.DEFINE_float("target", 1.3, "the one-row verify step's goal, as a multiple of the "
                   "one-row decode step")
flags.DEFINE_enum("attention_backend", None, ["pallas", "xla"], "attention kernels "
                  "(default: the runtime's, pallas on a GPU; the GPU suite passes xla when "
                  "the Pallas kernels failed their check on the device)")

EXTEND_TOKENS = 16  # the runner's one EXTEND bucket, never run: small to compile
PAGE = 16


def server_args(rows: list[int], k: int, context: int, smoke: bool,
                attention_backend: str | None) -> ServerArgs:
    """Decode buckets `rows`, one page-table width that holds context + 1 + k, a KV pool
    of exactly the pages the largest batch's rows take, prefill first (no MIXED
    programs). --smoke: XLA's attention and dot on the GPU's layout."""
    kv_len = bc.pow2_at_least(context + k + 1, PAGE)
    row_pages = -(-(context + k + 1) // PAGE)
    layout = (dict(attention_backend="xla", cpu_matmul="xla", per_layer_weights=True,
                   fuse_projections=True) if smoke
              else dict(attention_backend=attention_backend))
    return ServerArgs(dtype="float32" if smoke else "bfloat16", page_size=PAGE,
                      max_running_requests=max(rows), decode_buckets=tuple(rows),
                      kv_len_buckets=(kv_len,), extend_token_buckets=(EXTEND_TOKENS,),
                      max_prefill_tokens=EXTEND_TOKENS, chunked_prefill_size=EXTEND_TOKENS,
                      max_extend_seqs=1, itl_target_ms=0, max_top_logprobs=0,
                      max_total_tokens=max(rows) * row_pages * PAGE,
                      speculative_algorithm="ngram", speculative_num_draft_tokens=k, **layout)


def target_check(steps: dict[str, dict[str, float]], target: float) -> dict[str, Any]:
    """The one-row verify step against `target` x the one-row decode step; met is None
    when no one-row pair was measured."""
    ratio = steps.get("rows_1", {}).get("ratio")
    return {"verify_vs_decode_one_row": ratio, "target": target,
            "meets_target": None if ratio is None else ratio <= target}


def time_steps(runner: ModelRunner, rows: int, k: int, context: int, rounds: int,
               rng: np.random.Generator) -> dict[str, float]:
    """One row count's DECODE and TARGET_VERIFY steps, timed alternately."""
    page = runner.cache_cfg.page_size
    vocab = runner.model_cfg.vocab_size
    last = rng.integers(3, vocab, rows)  # each row's newest token
    drafts = rng.integers(3, vocab, (rows, k))
    secs = bc.time_alternately(runner, {
        "decode": bc.bare_batch(ForwardMode.DECODE, last[:, None].tolist(), context, page),
        "verify": bc.bare_batch(ForwardMode.TARGET_VERIFY,
                                np.concatenate([last[:, None], drafts], 1).tolist(), context,
                                page)}, rounds)
    return {**bc.verify_vs_decode(secs["decode"], secs["verify"]), "n": rounds}


def run(cfg: ModelConfig, dtype: str, context: int, results: dict[str, Any]) -> None:
    rows = sorted({int(r) for r in FLAGS.rows})
    k = FLAGS.draft_tokens
    args = server_args(rows, k, context, FLAGS.smoke, FLAGS.attention_backend)
    setup = RunnerSetup.from_args(args, cfg)
    params, results["weights_init_s"] = bc.init_weights(cfg, dtype)
    bc.log(f"weights in {results['weights_init_s']:.1f} s")
    t0 = time.perf_counter()
    # The runner lays the stacked weights out per layer: drop them once it holds its own.
    runner = setup.build(params)
    del params
    stats = runner.exec_stats
    results["runner"] = {"startup_s": time.perf_counter() - t0,
                         "attention_backend": runner.cfg.attention_backend,
                         "per_layer_weights": runner.cfg.per_layer_weights,
                         "fuse_projections": runner.cfg.fuse_projections,
                         "compile_s": {s.name: s.compile_s for s in stats}}
    bc.log(f"runner up in {results['runner']['startup_s']:.1f} s: {len(stats)} executables, "
           f"compile {sum(s.compile_s for s in stats):.1f} s")
    _write(results)
    rng = np.random.default_rng(0)
    for r in rows:
        rec = time_steps(runner, r, k, context, FLAGS.rounds, rng)
        results["steps"][f"rows_{r}"] = rec
        results.update(target_check(results["steps"], FLAGS.target))
        results["compiles_after_warmup"] = runner.compiles_after_warmup
        bc.log(f"{r} rows: decode {rec['decode_ms']:.2f} ms, verify (1 + {k} tokens a row) "
               f"{rec['verify_ms']:.2f} ms = {rec['ratio']:.2f}x")
        _write(results)
    if results["meets_target"] is not None:
        bc.log(f"one-row verify / decode {results['verify_vs_decode_one_row']:.2f}x (target "
               f"<= {FLAGS.target}): {'met' if results['meets_target'] else 'not met'}")


def _write(results: dict[str, Any]) -> None:
    out = Path(FLAGS.out)
    bc.write_json(out.parent, out.name, results)


def main(argv: list[str]) -> None:
    del argv
    cfg, dtype = (bc.TINY_CONFIG, "float32") if FLAGS.smoke else (LLAMA3_8B, "bfloat16")
    context = 64 if FLAGS.smoke else FLAGS.context
    results: dict[str, Any] = {
        **bc.random_8b_header("bench_verify_step", cfg, dtype, FLAGS.smoke),
        "draft_tokens": FLAGS.draft_tokens, "context": context, "rounds": FLAGS.rounds,
        "steps": {}, **target_check({}, FLAGS.target), "errors": []}
    try:
        run(cfg, dtype, context, results)
    except Exception as e:  # keep what was measured, and why the rest was not
        results["errors"].append({"error": repr(e), "traceback": traceback.format_exc()})
        bc.log(f"ERROR {e!r}")
    _write(results)
    sys.exit(1 if results["errors"] else 0)


if __name__ == "__main__":
    app.run(main)
