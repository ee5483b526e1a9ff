"""xlaserve's CPU fast path in float32, bfloat16 and weight-only int8 (--quantization=int8)
side by side with llama-server on the F32 and Q4_1 GGUFs: single-stream decode and c-way
offline throughput, the bytes a decode token reads and the share of the memory-bandwidth
bound each reaches, all in one run.

Every contender serves the same prompts, greedy with EOS ignored. Each round runs every
contender's single stream --single_repeats times, interleaved (A B C D, D C B A, ...,
a read probe between neighbours), then each one's throughput run in turn; the summary
takes medians over rounds.

A decode token reads every weight once (llama-server: its GGUF's bytes; xlaserve: the
weights as the packed path holds them: panels and scales) plus the row's cached K/V, so
bytes / token x tok/s over the round's measured read bandwidth is the share of the bound.

  .venv/bin/python scripts/bench/bench_dtypes.py --out_dir=bench_out/dtypes
  .venv/bin/python scripts/bench/bench_dtypes.py --smoke --out_dir=/tmp/bd  # tiny model, no peers
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import offline_peers  # noqa: E402

import cpu_kernels  # noqa: E402
from runtime.config import ServerArgs  # noqa: E402
from runtime.engine import Engine  # noqa: E402

FLAGS = flags.FLAGS
bc.define_run_flags("bench_out/dtypes", "tiny random model, tiny workload, one round, no "
                    "llama-server (checks the script)", out_help="where bench_dtypes.json goes",
                    checkpoint_cache=True)
flags.DEFINE_list("configs", ["float32:float32", "bfloat16:bfloat16", "float32:float32:int8"],
                  "xlaserve DTYPE:KV_CACHE_DTYPE[:QUANTIZATION] (--quantization=int8)")
flags.DEFINE_list("llama_variants", ["q4_1", "f32"], "llama-server GGUFs (see llama_peer)")
flags.DEFINE_integer("llama_threads", 2, "llama-server --threads / --threads-batch")
flags.DEFINE_integer("repeats", 3, "rounds")
flags.DEFINE_integer("concurrency", 32, "requests at once in the throughput run")
bc.define_length_flags("throughput request")
bc.define_single_stream_flags("the contenders (A B C D, D C B A, ...)")

_CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _engine(config: str) -> Engine:
    parts = config.split(":")
    if len(parts) not in (2, 3):
        raise app.UsageError(f"--configs {config!r}: want DTYPE:KV_CACHE_DTYPE[:QUANTIZATION]")
    dtype, kv, quantization = parts[0], parts[1], (parts[2] if len(parts) == 3 else None)
    longest = max(FLAGS.input_len + FLAGS.output_len, 64 + FLAGS.single_new_tokens)
    args = ServerArgs(dtype=dtype, kv_cache_dtype=kv, quantization=quantization,
                      max_running_requests=FLAGS.concurrency,
                      kv_len_buckets=(bc.pow2_at_least(longest, 256),), max_top_logprobs=0,
                      checkpoint_cache_dir=FLAGS.checkpoint_cache_dir,
                      compilation_cache_dir=FLAGS.compilation_cache_dir or None)
    t0 = time.perf_counter()
    eng = Engine(bc.smoke_args(args), model=bc.tiny_model()) if FLAGS.smoke else Engine(args)
    bc.log(f"xlaserve {config} ready in {time.perf_counter() - t0:.1f} s "
           f"({eng.runner.cfg.cpu_matmul} matmul, {eng.runner.cfg.attention_backend} attention)")
    return eng


def _decode_bytes(cfg: Any, weight_bytes: int, kv_itemsize: int, context: float) -> float:
    """Bytes one single-stream decode token reads: the weights and `context` cached
    tokens' K/V (the mean over the stream)."""
    return weight_bytes + context * 2 * cfg.num_layers * cfg.kv_size * kv_itemsize


def _round(r: int, engines: dict[str, Engine], llama: offline_peers.LlamaPeers,
           single_ids: list[int], prompts: list[list[int]]) -> dict[str, Any]:
    roof = bc.measure_roofline(small=FLAGS.smoke)
    rec: dict[str, Any] = {"round": r, "roofline": roof.to_json(),
                           "load_average": bc.load_average()}
    bc.log(f"round {r}: read bandwidth {roof.mem_read_gbps:.1f} GB/s, load "
           f"{rec['load_average']}")
    n = FLAGS.single_new_tokens
    contenders = [(f"xlaserve {name}", f"xlaserve {name}",
                   lambda eng=eng: bc.xla_single(eng, single_ids, n))
                  for name, eng in engines.items()]
    contenders += [(f"llama-server {v}", f"llama-server {v}",
                    lambda v=v: llama.single(v, single_ids, n)) for v in llama.servers]
    singles = bc.interleaved_singles(contenders, FLAGS.single_repeats, FLAGS.smoke,
                                     f"round {r}: ")
    for name, eng in engines.items():
        t = bc.xla_throughput(eng, prompts, FLAGS.output_len)
        rec[f"xlaserve {name}"] = {"single": singles[f"xlaserve {name}"], "throughput": t}
        bc.log(f"round {r}: xlaserve {name}: {FLAGS.concurrency}-way "
               f"{t['output_tok_s']:.1f} output tok/s")
    for v in llama.servers:
        t = llama.throughput(v, prompts, FLAGS.output_len)
        rec[f"llama-server {v}"] = {"single": singles[f"llama-server {v}"], "throughput": t}
        bc.log(f"round {r}: llama-server {v}: {FLAGS.concurrency}-way "
               f"{t['output_tok_s']:.1f} output tok/s")
    return rec


def _summary(rounds: list[dict[str, Any]], bytes_per_token: dict[str, float]
             ) -> dict[str, Any]:
    gbps = bc.median([r["roofline"]["mem_read_gbps"] for r in rounds])
    out: dict[str, Any] = {"mem_read_gbps": gbps, "contenders": {}}
    for name, nbytes in bytes_per_token.items():
        single = bc.median([r[name]["single"]["decode_tok_s"] for r in rounds])
        many = bc.median([r[name]["throughput"]["output_tok_s"] for r in rounds])
        out["contenders"][name] = {
            "single_decode_tok_s": single, f"c{FLAGS.concurrency}_output_tok_s": many,
            "bytes_per_token": nbytes, "bound_tok_s": gbps * 1e9 / nbytes,
            "share_of_bandwidth_bound": single * nbytes / (gbps * 1e9),
            # each single-stream run against the higher of the probes just before and
            # after it (bc.interleaved_singles), median over every run of every round
            "share_of_bound_probed_around": bc.median(
                [f for r in rounds for f in bc.single_shares(r[name]["single"], nbytes)])}
    c = out["contenders"]
    for name in [n for n in c if n.startswith("xlaserve")]:
        for peer, key in (("llama-server q4_1", "single_decode_tok_s"),
                          ("llama-server f32", f"c{FLAGS.concurrency}_output_tok_s")):
            if peer in c:
                c[name][f"{key} / {peer}"] = c[name][key] / c[peer][key]
    return out


def _print(summary: dict[str, Any]) -> None:
    key = f"c{FLAGS.concurrency}_output_tok_s"
    print(f"\nmedians; read bandwidth {summary['mem_read_gbps']:.1f} GB/s")
    print(f"| contender | single tok/s | {FLAGS.concurrency}-way output tok/s | "
          "MB / token | share of bandwidth bound (median probe) | (probed around it) |")
    print("|---|---|---|---|---|---|")
    for name, c in summary["contenders"].items():
        print(f"| {name} | {c['single_decode_tok_s']:.1f} | {c[key]:.1f} | "
              f"{c['bytes_per_token'] / 1e6:.0f} | {c['share_of_bandwidth_bound']:.0%} | "
              f"{c['share_of_bound_probed_around']:.0%} |")
    for name, c in summary["contenders"].items():
        for k, v in c.items():
            if " / " in k:
                print(f"{name}: {k} = {v:.2f}x")


def _bf16_kernel(eng: Engine) -> str | None:
    """The bf16 matmul kernel that served (cpu_kernels.bf16_kernel), None off the packed
    CPU path."""
    if eng.runner.cfg.cpu_matmul != "packed":
        return None
    return cpu_kernels.bf16_kernel()


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.smoke:
        bc.set_flags(dict(llama_variants=[], repeats=1, single_repeats=2, concurrency=4,
                          input_len=16, output_len=8, single_new_tokens=8))
    t_start = time.perf_counter()
    machine = bc.machine_info()
    engines = {c: _engine(c) for c in FLAGS.configs}
    first = next(iter(engines.values()))
    cfg = first.model_cfg
    single_ids = (list(range(3, 40)) if first.tokenizer is None  # the tiny model has none
                  else list(first.tokenizer.apply_chat_template(_CHAT, tokenize=True)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, FLAGS.input_len).tolist()
               for _ in range(FLAGS.concurrency)]
    ctx = bc.pow2_at_least(max(FLAGS.input_len + FLAGS.output_len,
                               64 + FLAGS.single_new_tokens), 256)
    llama = offline_peers.LlamaPeers(FLAGS.llama_variants, FLAGS.concurrency, ctx,
                                     FLAGS.llama_threads, "{llama_server}",
                                     FLAGS.checkpoint_cache_dir, Path(FLAGS.out_dir))
    try:
        for eng in engines.values():  # first calls pay page faults and lazy init
            bc.xla_throughput(eng, prompts[:2], 4)
        for v in llama.servers:
            llama.throughput(v, prompts[:2], 4)
        rounds = [_round(r, engines, llama, single_ids, prompts) for r in range(FLAGS.repeats)]
    finally:
        llama.stop()
    # Mean cached context over the single stream: the prompt, then half the new tokens.
    context = len(single_ids) + FLAGS.single_new_tokens / 2
    nbytes = {}
    for name, eng in engines.items():
        kv_itemsize = 4 if eng.runner.cfg.kv_dtype == "float32" else 2
        nbytes[f"xlaserve {name}"] = _decode_bytes(cfg, bc.decode_weight_bytes(eng), kv_itemsize,
                                                   context)
    for v, info in llama.info().items():
        kv_itemsize = 2  # llama-server's default KV cache type is f16
        nbytes[f"llama-server {v}"] = _decode_bytes(cfg, info["model_bytes"], kv_itemsize,
                                                    context)
    summary = _summary(rounds, nbytes)
    result = {"script": "bench_dtypes", "command": bc.command_line(),
              "git_revision": bc.git_revision(), "machine": machine,
              "bf16_matmul_kernel": _bf16_kernel(first),
              "machine_load_average_end": bc.load_average(), "llama_server": llama.info(),
              "single_prompt_tokens": len(single_ids), "rounds": rounds, "summary": summary,
              "workload": {k: FLAGS[k].value for k in (
                  "concurrency", "input_len", "output_len", "single_new_tokens", "repeats",
                  "single_repeats")},
              "wall_s": time.perf_counter() - t_start}
    _print(summary)
    bc.write_json(FLAGS.out_dir, "bench_dtypes.json", result)


if __name__ == "__main__":
    app.run(main)
