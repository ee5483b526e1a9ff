"""Multi-step decode side by side: one engine per --steps value (serve.py's
--num_scheduler_steps), the same weights, run in alternating rounds in one process.

    .venv/bin/python scripts/bench/bench_multi_step.py --out_dir=bench_out \
        --dtype=bfloat16 --compress_weights --steps=1,4 --rounds=12
    .venv/bin/python scripts/bench/bench_multi_step.py --smoke --out_dir=/tmp/ms   # seconds

Each round runs, on every engine in turn: one greedy stream (decode tok/s: tokens after
the first over their time, bench_offline's measure) and, with --concurrency > 1, that many
requests of the same prompt at once (output tok/s). The ratios are each round's value over
the first --steps value's in the same round, then the median; the greedy tokens of every
engine must equal the first's. Writes bench_multi_step.json to --out_dir.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import bench_common as bc
from absl import app, flags

from runtime.config import ServerArgs
from runtime.engine import Engine

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "bench_out", "where the JSON goes")
flags.DEFINE_bool("smoke", False, "tiny random model, few tokens (checks the script)")
flags.DEFINE_list("steps", ["1", "4"], "num_scheduler_steps of each engine; the first is "
                  "the baseline of the ratios")
flags.DEFINE_integer("rounds", 6, "alternating rounds (A B A B)")
flags.DEFINE_string("dtype", None, "see ServerArgs (default: the server's)")
flags.DEFINE_bool("compress_weights", False, "bf16 weights in 12 bits (with "
                  "--dtype=bfloat16)")
flags.DEFINE_string("prompt", "What is the capital of France?", "the prompt")
flags.DEFINE_integer("new_tokens", 128, "greedy tokens per request")
flags.DEFINE_integer("concurrency", 32, "requests of the batched run (1: single stream only)")
flags.DEFINE_string("compilation_cache_dir", "~/.cache/xlaserve/jax", "see ServerArgs; '' off")


def _args(steps: int) -> ServerArgs:
    base = ServerArgs(dtype=FLAGS.dtype, compress_weights=FLAGS.compress_weights,
                      num_scheduler_steps=steps, max_running_requests=max(32,
                                                                          FLAGS.concurrency),
                      kv_len_buckets=(1024,), max_top_logprobs=0,
                      compilation_cache_dir=FLAGS.compilation_cache_dir or None)
    return bc.smoke_args(base) if FLAGS.smoke else base


def _round(engine: Engine, ids: list[int], n: int, conc: int) -> dict[str, Any]:
    rec: dict[str, Any] = {"single": bc.xla_single(engine, ids, n)}
    if conc > 1:
        rec["batch"] = bc.xla_throughput(engine, [ids] * conc, n)
    return rec


def main(argv: list[str]) -> None:
    del argv
    steps = [int(k) for k in FLAGS.steps]
    if not steps or min(steps) < 1 or len(set(steps)) != len(steps):
        raise app.UsageError(f"--steps={','.join(FLAGS.steps)}: distinct values >= 1")
    bc.enable_compilation_cache(FLAGS.compilation_cache_dir or None)
    n = 8 if FLAGS.smoke else FLAGS.new_tokens
    conc = min(FLAGS.concurrency, 4) if FLAGS.smoke else FLAGS.concurrency
    engines = {}
    for k in steps:
        model = bc.tiny_model() if FLAGS.smoke else None
        engines[k] = Engine(_args(k), model=model)
    first = engines[steps[0]]
    # bench_offline's single stream: the prompt in the chat template (37 tokens).
    ids = (list(range(3, 40)) if first.tokenizer is None else list(
        first.tokenizer.apply_chat_template([{"role": "user", "content": FLAGS.prompt}],
                                            tokenize=True)))
    for e in engines.values():  # warm: first calls pay one-time costs
        _round(e, ids, n, conc)
    rounds = []
    for r in range(FLAGS.rounds):
        rounds.append({str(k): _round(e, ids, n, conc) for k, e in engines.items()})
        bc.log(f"round {r + 1}/{FLAGS.rounds}: " + ", ".join(
            f"K={k} {rounds[-1][str(k)]['single']['decode_tok_s']:.1f} tok/s"
            for k in steps))
    base = str(steps[0])
    summary: dict[str, Any] = {}
    for k in map(str, steps):
        single = [x[k]["single"]["decode_tok_s"] for x in rounds]
        summary[f"K{k}_single_decode_tok_s"] = statistics.median(single)
        summary[f"K{k}_single_vs_K{base}"] = statistics.median(
            s / x[base]["single"]["decode_tok_s"] for s, x in zip(single, rounds, strict=True))
        summary[f"K{k}_single_faster_rounds"] = sum(
            s > x[base]["single"]["decode_tok_s"] for s, x in zip(single, rounds, strict=True))
        if conc > 1:
            batch = [x[k]["batch"]["output_tok_s"] for x in rounds]
            summary[f"K{k}_c{conc}_output_tok_s"] = statistics.median(batch)
            summary[f"K{k}_c{conc}_vs_K{base}"] = statistics.median(
                b / x[base]["batch"]["output_tok_s"] for b, x in zip(batch, rounds, strict=True))
        summary[f"K{k}_same_tokens"] = all(
            x[k]["single"]["output_ids"] == x[base]["single"]["output_ids"] for x in rounds)
    for key, v in summary.items():
        bc.log(f"  {key:32s} {v:.3f}" if isinstance(v, float) else f"  {key:32s} {v}")
    bc.write_json(FLAGS.out_dir, "bench_multi_step.json", {
        "script": "bench_multi_step", "command": bc.command_line(),
        "git_revision": bc.git_revision(), "machine": bc.machine_info(),
        "engine_args": dataclasses.asdict(_args(steps[0])), "steps": steps,
        "concurrency": conc, "new_tokens": n, "rounds": rounds, "summary": summary})


if __name__ == "__main__":
    app.run(main)
