"""Prompt-lookup speculative decoding against plain decoding, side by side in one process:
one runner (its TARGET_VERIFY programs compiled), two engines over it, run alternately.

    .venv/bin/python scripts/bench/bench_spec.py --out_dir=bench_out
    .venv/bin/python scripts/bench/bench_spec.py --smoke --out_dir=/tmp/spec   # seconds

Two prompt sets made here: copy-heavy ("rewrite this code with one change", "summarise,
quoting the text") and chat. For each set: single stream (each prompt alone, decode tok/s:
tokens after the first over their time, plain and speculative alternately) and
--streams prompts at once (output tok/s), over --rounds alternating rounds; plus the
acceptance (drafted tokens kept) and tokens a verify row yields. Greedy, so both engines
must give the same tokens (the JSON says whether they did). Then bare steps on the same
runner (--step_rounds): a DECODE step of 1 and of --streams rows against a TARGET_VERIFY
step of as many rows of 1 + k tokens, --step_context tokens cached, called alternately
(median ms of launch + read-back). Writes bench_spec.json.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any

import bench_common as bc
from absl import app, flags

from models.forward_mode import ForwardMode
from runtime.config import ServerArgs
from runtime.engine import Engine
from runtime.model_runner import ModelRunner
from runtime.request import SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "bench_out", "where the JSON goes")
flags.DEFINE_bool("smoke", False, "tiny random model, few tokens (checks the script)")
flags.DEFINE_integer("rounds", 2, "alternating rounds (plain, spec, plain, spec)")
flags.DEFINE_integer("new_tokens", 128, "most greedy tokens per request (EOS ends one)")
flags.DEFINE_integer("streams", 8, "requests of the concurrent run")
flags.DEFINE_integer("single_prompts", 4, "prompts of each set run as a single stream")
flags.DEFINE_integer("draft_tokens", 4, "--speculative_num_draft_tokens")
flags.DEFINE_list("kv_len_buckets", ["512", "1024"], "see ServerArgs (prompts + outputs "
                  "here stay under 512 tokens)")
flags.DEFINE_integer("step_rounds", 10, "timed calls of each bare step (0: none)")
flags.DEFINE_integer("step_context", 200, "cached tokens of each row of the bare steps")
flags.DEFINE_string("compilation_cache_dir", "~/.cache/xlaserve/jax", "see ServerArgs; '' off")

_NAMES = ["total", "count", "items", "value", "result", "index", "buffer", "limit", "scale",
          "offset", "window", "weights", "rows", "cols", "score", "label"]
_TOPICS = ["the harbour bridge", "the river delta", "the mountain railway", "the old library",
           "the wind farm", "the glass factory", "the night market", "the coral reef"]


def _code(rng: random.Random) -> tuple[str, str, str]:
    """A short Python function, its name, and a new name for it."""
    a, b, c, d = rng.sample(_NAMES, 4)
    name = f"compute_{a}_{b}"
    lines = [f"def {name}({a}, {b}, {c}=None):",
             f'    """Return the {d} of {a} and {b}, scaled by {c} when given."""',
             f"    {d} = 0",
             f"    for i in range(len({a})):",
             f"        if {a}[i] > {b}:",
             f"            {d} += {a}[i] * {rng.randint(2, 9)}",
             "        else:",
             f"            {d} -= {a}[i] // {rng.randint(2, 9)}",
             f"    if {c} is not None:",
             f"        {d} = {d} * {c}",
             f"    return {d}"]
    return "\n".join(lines), name, f"calc_{a}_{b}"


def _text(rng: random.Random) -> str:
    topic = rng.choice(_TOPICS)
    year = rng.randint(1850, 1990)
    return (f"The history of {topic} began in {year}, when the town council approved the "
            f"first plans. Construction took {rng.randint(3, 12)} years and employed more "
            f"than {rng.randint(2, 9)} hundred workers. Local newspapers described {topic} as "
            f"\"a wonder of its age\". In {year + rng.randint(20, 60)} it was restored, and "
            f"today it welcomes about {rng.randint(10, 90)} thousand visitors every year.")


def copy_heavy(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            code, old, new = _code(rng)
            out.append(f"Rewrite this Python code, renaming the function {old} to {new}. "
                       f"Change nothing else.\n\n```python\n{code}\n```")
        else:
            out.append("Summarise the following text in two sentences, quoting its key "
                       f"phrases word for word:\n\n{_text(rng)}")
    return out


CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "Give me three tips for learning to cook.", "Why is the sky blue?",
        "Explain what a neural network is to a child.", "Suggest a name for a pet turtle.",
        "What are the benefits of regular exercise?", "How do airplanes stay in the air?"]


def _args(spec: bool) -> ServerArgs:
    # Prefill first (itl_target_ms=0): both engines batch the prompts alike whatever the
    # step times they measure, so their greedy tokens can be compared. No prefix cache: the
    # two engines share one runner's KV pool, each with its own page allocator.
    base = ServerArgs(max_running_requests=max(8, FLAGS.streams),
                      kv_len_buckets=tuple(int(b) for b in FLAGS.kv_len_buckets), itl_target_ms=0,
                      disable_prefix_cache=True,
                      max_top_logprobs=0, compilation_cache_dir=FLAGS.compilation_cache_dir
                      or None, speculative_algorithm="ngram" if spec else None,
                      speculative_num_draft_tokens=FLAGS.draft_tokens)
    return bc.smoke_args(base, kv_len=256) if FLAGS.smoke else base


def _sampling(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n)


def _single(engine: Engine, ids: list[int], n: int) -> dict[str, Any]:
    out = engine.generate([ids], _sampling(n))[0]
    m = out.meta_info
    return {"new_tokens": len(out.output_ids), "decode_s": m["e2e_latency"] - m["ttft"],
            "output_ids": out.output_ids, "accept_rate": m.get("spec_accept_rate"),
            "accept_length": m.get("spec_accept_length")}


def _streams(engine: Engine, prompts: list[list[int]], n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, _sampling(n))
    secs = time.perf_counter() - t0
    rec = bc.throughput_record(secs, sum(map(len, prompts)), sum(len(o.output_ids)
                                                                  for o in outs))
    drafted = sum(o.meta_info.get("spec_draft_tokens", 0) for o in outs)
    kept = sum(o.meta_info.get("spec_accepted_tokens", 0) for o in outs)
    rec["accept_rate"] = kept / drafted if drafted else None
    rec["output_ids"] = [o.output_ids for o in outs]
    return rec


def _run_set(engines: dict[str, Engine], prompts: list[list[int]], n: int) -> dict[str, Any]:
    """Alternating rounds of the single streams and the concurrent run."""
    rounds = []
    for r in range(FLAGS.rounds):
        rec: dict[str, Any] = {"load_average": bc.load_average()}
        for name, eng in engines.items():
            singles = [_single(eng, ids, n) for ids in prompts[:FLAGS.single_prompts]]
            rec[name] = {"single": singles, "streams": _streams(eng, prompts, n)}
        rounds.append(rec)
        bc.log(f"  round {r + 1}: " + ", ".join(
            f"{k} single {_tok_s(rec[k]['single']):.1f} tok/s, {len(prompts)} streams "
            f"{rec[k]['streams']['output_tok_s']:.1f} tok/s" for k in engines))
    return {"rounds": rounds, "summary": _summary(rounds)}


def _tok_s(singles: list[dict[str, Any]]) -> float:
    """Decode tok/s over the prompts: tokens after the first over their decode time."""
    return sum(s["new_tokens"] - 1 for s in singles) / sum(s["decode_s"] for s in singles)


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    single = {k: [_tok_s(r[k]["single"]) for r in rounds] for k in ("plain", "ngram")}
    streams = {k: [r[k]["streams"]["output_tok_s"] for r in rounds] for k in ("plain", "ngram")}
    spec_singles = [s for r in rounds for s in r["ngram"]["single"]]
    rates = [s["accept_rate"] for s in spec_singles if s["accept_rate"] is not None]
    lengths = [s["accept_length"] for s in spec_singles if s["accept_length"]]
    same = all(p["output_ids"] == s["output_ids"] for r in rounds
               for p, s in zip(r["plain"]["single"], r["ngram"]["single"], strict=True))
    same_streams = all(r["plain"]["streams"]["output_ids"] == r["ngram"]["streams"]["output_ids"]
                       for r in rounds)
    return {
        "single_plain_tok_s": statistics.median(single["plain"]),
        "single_ngram_tok_s": statistics.median(single["ngram"]),
        "single_speedup": statistics.median(s / p for s, p in zip(
            single["ngram"], single["plain"], strict=True)),
        "streams_plain_tok_s": statistics.median(streams["plain"]),
        "streams_ngram_tok_s": statistics.median(streams["ngram"]),
        "streams_speedup": statistics.median(s / p for s, p in zip(
            streams["ngram"], streams["plain"], strict=True)),
        "single_accept_rate": statistics.mean(rates) if rates else None,
        "single_accept_length": statistics.mean(lengths) if lengths else None,
        "streams_accept_rate": statistics.mean(
            [r["ngram"]["streams"]["accept_rate"] or 0.0 for r in rounds]),
        "same_tokens_single": same, "same_tokens_streams": same_streams}


def _step_times(runner: ModelRunner, k: int, row_counts: list[int], context: int,
                rounds: int) -> dict[str, dict[str, float]]:
    """Median ms of a bare DECODE and a TARGET_VERIFY step (rows of 1 + k tokens) at each
    row count, called alternately after one warm call each. Run after the engines: the
    steps write K/V into pages the engines' allocators see as free."""
    page = runner.cache_cfg.page_size
    out = {}
    for rows in row_counts:
        secs = bc.time_alternately(runner, {
            "decode": bc.bare_batch(ForwardMode.DECODE, [[3]] * rows, context, page),
            "verify": bc.bare_batch(ForwardMode.TARGET_VERIFY, [range(3, 4 + k)] * rows,
                                    context, page)}, rounds)
        rec = bc.verify_vs_decode(secs["decode"], secs["verify"])
        out[f"rows_{rows}"] = rec
        bc.log(f"bare steps, {rows} rows: decode {rec['decode_ms']:.1f} ms, verify "
               f"(1 + {k} tokens a row) {rec['verify_ms']:.1f} ms, {rec['ratio']:.2f}x")
    return out


def main(argv: list[str]) -> None:
    del argv
    bc.enable_compilation_cache(FLAGS.compilation_cache_dir or None)
    n = 8 if FLAGS.smoke else FLAGS.new_tokens
    model = bc.tiny_model() if FLAGS.smoke else None
    spec = Engine(_args(True), model=model)
    # The same runner (and compiled programs) without speculation.
    plain = Engine(_args(False), runner=spec.runner, tokenizer=spec.tokenizer)
    engines = {"plain": plain, "ngram": spec}
    tok = spec.tokenizer

    def encode(text: str) -> list[int]:
        if tok is None:  # smoke: a random model, token ids that repeat like a copy
            ids = [3 + (ord(c) % 200) for c in text[:40]]
            return ids + ids[:20]
        return list(tok.apply_chat_template([{"role": "user", "content": text}],
                                            tokenize=True))

    streams = FLAGS.streams
    sets = {"copy_heavy": [encode(p) for p in copy_heavy(streams)],
            "chat": [encode(p) for p in (CHAT * streams)[:streams]]}
    for eng in engines.values():  # warm: first calls pay one-time costs
        eng.generate(sets["chat"][:2], _sampling(4))
    results = {}
    for name, prompts in sets.items():
        bc.log(f"{name}: {len(prompts)} prompts, {min(map(len, prompts))}-"
               f"{max(map(len, prompts))} tokens")
        results[name] = _run_set(engines, prompts, n)
        for key, v in results[name]["summary"].items():
            bc.log(f"  {key:28s} {v:.3f}" if isinstance(v, float) else f"  {key:28s} {v}")
    steps = {}
    if FLAGS.step_rounds:
        context = min(FLAGS.step_context, spec.runner.max_seq_len - FLAGS.draft_tokens - 1)
        steps = {"load_average": bc.load_average(), "context": context,
                 **_step_times(spec.runner, FLAGS.draft_tokens, sorted({1, streams}), context,
                               FLAGS.step_rounds)}
    bc.write_json(FLAGS.out_dir, "bench_spec.json", {
        "script": "bench_spec", "command": bc.command_line(),
        "git_revision": bc.git_revision(), "machine": bc.machine_info(),
        "engine_args": dataclasses.asdict(_args(True)), "new_tokens": n,
        # Measured device seconds per step kind (decode/bdN against target_verify/bdN).
        "step_costs": {k: v for k, v in spec.runner.costs.snapshot().items()
                       if k.startswith(("decode/", "target_verify/"))},
        "bare_steps": steps, "results": results})


if __name__ == "__main__":
    app.run(main)
