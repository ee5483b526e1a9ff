"""Serve a model over HTTP: SGLang's native /generate and the OpenAI-compatible /v1 API.

  .venv/bin/python scripts/serve.py                      # embedded SmolLM2 on 127.0.0.1:30000
  .venv/bin/python scripts/serve.py --model=/ckpt --port=8000 --api_key=secret

A mesh over several processes: the same flags plus --nnodes=N --node_rank=R
--dist_init_addr=HOST:PORT in each (rank 0 serves HTTP; docs/moe_and_mesh.md).

Flags carry SGLang's names in snake_case. /health answers 503 until warm-up is done.
SIGTERM or Ctrl-C: stop accepting, let in-flight requests finish, exit 0.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import multihost  # noqa: E402
from runtime.config import ServerArgs  # noqa: E402
from runtime.server import serve  # noqa: E402

_D = ServerArgs()
flags.DEFINE_string("model", _D.model, "orbax checkpoint, GGUF file, Hugging Face folder, "
                    "'default' (the embedded SmolLM2-135M-Instruct) or a preset: 'tiny-moe' "
                    "(random-weight Qwen2-MoE-style model, SmolLM2 tokenizer)")
flags.DEFINE_string("served_model_name", None, "model name in /v1 replies (default: from "
                    "--model)")
flags.DEFINE_string("host", _D.host, "address to listen on")
flags.DEFINE_integer("port", _D.port, "port to listen on")
flags.DEFINE_string("api_key", None, "require 'Authorization: Bearer <key>' (not on /health)")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "default: float32 on CPU, "
                  "bfloat16 on GPU")
flags.DEFINE_enum("kv_cache_dtype", _D.kv_cache_dtype, ["auto", "float32", "bfloat16"],
                  "KV pool dtype (auto: as --dtype)")
flags.DEFINE_enum("quantization", None, ["int8"], "int8: weight-only int8 matrices with a "
                  "scale per output column on the CPU fast path (a quarter of f32's bytes "
                  "a token; norms, embeddings and the KV pool stay in --dtype)")
flags.DEFINE_bool("compress_weights", _D.compress_weights, "bfloat16 matrices on the CPU "
                  "fast path in 12 bits each, losslessly (3/4 of bf16's bytes a token; the "
                  "same weights): needs --dtype=bfloat16 and AVX-512BW")
flags.register_multi_flags_validator(
    ["compress_weights", "dtype"], lambda f: not f["compress_weights"] or f["dtype"] == "bfloat16",
    "--compress_weights stores bfloat16 weights: pass --dtype=bfloat16 with it")
flags.DEFINE_integer("page_size", _D.page_size, "tokens per KV page")
flags.DEFINE_integer("max_total_tokens", None, "KV pool size in tokens (default: from "
                     "--mem_fraction)")
flags.DEFINE_float("mem_fraction", _D.mem_fraction, "share of free memory for the KV pool")
flags.DEFINE_integer("max_running_requests", _D.max_running_requests, "decode batch limit")
flags.DEFINE_integer("max_prefill_tokens", _D.max_prefill_tokens, "tokens per prefill batch")
flags.DEFINE_integer("chunked_prefill_size", _D.chunked_prefill_size, "prefill chunk "
                     "size; <= 0 turns chunking off")
flags.DEFINE_integer("max_extend_seqs", _D.max_extend_seqs, "prompts per prefill batch")
flags.DEFINE_bool("enable_mixed_chunk", _D.enable_mixed_chunk, "run prefill chunks and "
                  "decodes in one batch")
flags.DEFINE_bool("enable_split_prefill", _D.enable_split_prefill, "run prefills a few "
                  "layers per call (SPLIT_PREFILL executables)")
flags.DEFINE_integer("split_prefill_layers", None, "layers per split-prefill interval "
                     "(default: chosen each iteration to meet --multiplex_itl_target_ms)")
flags.DEFINE_bool("enable_multiplexing", _D.enable_multiplexing, "interleave decode steps "
                  "with split-prefill intervals, so a long prompt never freezes running "
                  "streams (implies --enable_split_prefill)")
flags.DEFINE_float("multiplex_itl_target_ms", _D.multiplex_itl_target_ms, "inter-token "
                   "latency one multiplexed iteration aims for (0: "
                   "--multiplex_decode_slowdown x the running batch's decode step)")
flags.DEFINE_float("multiplex_decode_slowdown", _D.multiplex_decode_slowdown, "with "
                   "--multiplex_itl_target_ms=0: how many times its decode step a running "
                   "stream's inter-token latency may grow while a prompt prefills")
flags.DEFINE_float("multiplex_fill_fraction", _D.multiplex_fill_fraction, "prefill "
                   "first, without decode steps, while the decoding streams are under this "
                   "fraction of the batch the prefilling and admissible waiting requests "
                   "make them (a burst fills the batch first; 0: always multiplex)")
flags.DEFINE_float("multiplex_max_stall_ms", _D.multiplex_max_stall_ms, "while "
                   "prefilling first, run a decode step once the streams waited this long "
                   "(0: no bound)")
flags.DEFINE_integer("split_prefill_min_tokens", _D.split_prefill_min_tokens, "prefill "
                     "buckets with fewer tokens run whole, not split (fewer executables)")
flags.DEFINE_bool("multiplex_fused", _D.multiplex_fused, "run each multiplexed "
                  "iteration as one fused decode + interval executable instead of two calls")
flags.DEFINE_enum("schedule_policy", _D.schedule_policy, ["fcfs", "lpm"], "admission order")
flags.DEFINE_bool("disable_prefix_cache", _D.disable_prefix_cache, "no radix prefix cache")
flags.DEFINE_bool("disable_overlap_schedule", _D.disable_overlap_schedule, "schedule step "
                  "N+1 only after step N's results are back")
flags.DEFINE_enum("attention_backend", None, ["xla", "cpu", "pallas"], "pallas: the Pallas "
                  "kernels (GPU); cpu: decode rows through our CPU kernel; xla: jnp "
                  "(default: pallas on GPU, cpu where it builds, else xla)")
flags.DEFINE_list("decode_buckets", None, "decode batch sizes to compile (default: powers "
                  "of two up to --max_running_requests)")
flags.DEFINE_list("extend_token_buckets", None, "prefill token counts to compile")
flags.DEFINE_list("kv_len_buckets", None, "sequence lengths to compile (multiples of "
                  "--page_size; the largest is the context length)")
flags.DEFINE_integer("max_top_logprobs", _D.max_top_logprobs, "most top logprobs a request "
                     "may ask for")
flags.DEFINE_integer("max_queued_requests", _D.max_queued_requests, "waiting requests "
                     "beyond this get 503 with Retry-After")
flags.DEFINE_string("compilation_cache_dir", _D.compilation_cache_dir, "persistent XLA "
                    "compilation cache ('' turns it off)")
flags.DEFINE_string("checkpoint_cache_dir", _D.checkpoint_cache_dir, "where the default "
                    "model is converted to")
flags.DEFINE_bool("strict_compile", _D.strict_compile, "fail on any compilation after "
                  "warm-up")
flags.DEFINE_bool("per_layer_weights", None, "layer weights as per-layer buffers picked by "
                  "lax.switch (default: on wherever XLA's dot runs, GPU or CPU with "
                  "--cpu_matmul=xla: it copies a slice of the stacked weights before each "
                  "dot; off for the packed kernel, which reads the stacked weights in place, "
                  "and under two-batch overlap)")
flags.DEFINE_bool("fuse_projections", None, "wq|wk|wv and w_gate|w_up as one matrix each "
                  "(default: on a GPU without tensor parallelism, where XLA keeps the "
                  "one-row decode products gemms instead of writing weight-sized temporaries)")
flags.DEFINE_enum("cpu_matmul", None, ["packed", "xla"], "CPU matmuls: our kernel over "
                  "weights packed at load, or XLA's dot (default: packed where it builds: "
                  "x86-64 with AVX-512 or AVX2 + FMA, and a C++ compiler)")
flags.DEFINE_string("trace_dir", None, "write the execution trace as Chrome trace / "
                    "Perfetto JSON here (ui.perfetto.dev), a file each time the ring fills "
                    "and one at shutdown; also the default /start_profile folder")
flags.DEFINE_integer("trace_buffer_steps", _D.trace_buffer_steps, "forward steps (and "
                     "finished requests) the execution trace keeps; 0 turns it off")

flags.DEFINE_integer("tp", _D.tp, "tensor-parallel devices (must divide the query and KV "
                     "heads); on a mesh attention and matmuls run through XLA")
flags.DEFINE_integer("ep", _D.ep, "expert-parallel devices for a MoE model (must divide "
                     "the experts)")
flags.DEFINE_bool("enable_two_batch_overlap", _D.enable_two_batch_overlap, "MoE: split "
                  "each batch into two micro-batches whose expert-parallel all_to_all "
                  "overlaps the other's compute (docs/tbo.md)")
flags.DEFINE_float("tbo_token_distribution_threshold", _D.tbo_token_distribution_threshold,
                   "cut one sequence in two when the best sequence boundary leaves less "
                   "than this share of the tokens on one side")
flags.DEFINE_integer("tbo_min_tokens", None, "smaller batches run unsplit (default: 128 per "
                     "ep rank)")
flags.DEFINE_integer("num_scheduler_steps", _D.num_scheduler_steps, "decode steps a "
                     "DECODE batch runs on the device in one program when no request can "
                     "be admitted (vLLM's --num-scheduler-steps): the host schedules, "
                     "launches and reads back once per that many tokens; 1 turns it off")
flags.DEFINE_integer("dp", _D.dp, "data-parallel attention ranks: each runs its own "
                     "requests over its own KV pages (must divide --max_running_requests; "
                     "buckets are per rank)")
flags.DEFINE_integer("nnodes", _D.nnodes, "processes the device mesh spans (jax.distributed; "
                     "start one per node_rank, each with the same flags)")
flags.DEFINE_integer("node_rank", _D.node_rank, "this process's rank: 0 serves HTTP and "
                     "schedules, the others replay its steps (runtime/multihost.py)")
flags.DEFINE_string("dist_init_addr", None, "HOST:PORT of rank 0's jax.distributed "
                    "coordinator (needed with --nnodes > 1)")
flags.DEFINE_integer("dist_timeout", _D.dist_timeout, "seconds the processes wait for "
                     "each other at start-up")
flags.DEFINE_integer("dist_heartbeat_timeout", _D.dist_heartbeat_timeout, "seconds a "
                     "silent process counts as alive; then every process stops with an error")

FLAGS = flags.FLAGS


def _buckets(values: list[str] | None) -> tuple[int, ...] | None:
    return tuple(int(v) for v in values) if values else None


def server_args() -> ServerArgs:
    return ServerArgs(
        model=FLAGS.model, host=FLAGS.host, port=FLAGS.port, api_key=FLAGS.api_key or None,
        dtype=FLAGS.dtype, kv_cache_dtype=FLAGS.kv_cache_dtype, quantization=FLAGS.quantization,
        compress_weights=FLAGS.compress_weights,
        page_size=FLAGS.page_size,
        max_total_tokens=FLAGS.max_total_tokens,
        mem_fraction=FLAGS.mem_fraction, max_running_requests=FLAGS.max_running_requests,
        max_prefill_tokens=FLAGS.max_prefill_tokens,
        chunked_prefill_size=FLAGS.chunked_prefill_size if FLAGS.chunked_prefill_size > 0
        else None,
        max_extend_seqs=FLAGS.max_extend_seqs, enable_mixed_chunk=FLAGS.enable_mixed_chunk,
        schedule_policy=FLAGS.schedule_policy, disable_prefix_cache=FLAGS.disable_prefix_cache,
        disable_overlap_schedule=FLAGS.disable_overlap_schedule,
        attention_backend=FLAGS.attention_backend,
        decode_buckets=_buckets(FLAGS.decode_buckets),
        extend_token_buckets=_buckets(FLAGS.extend_token_buckets),
        kv_len_buckets=_buckets(FLAGS.kv_len_buckets), max_top_logprobs=FLAGS.max_top_logprobs,
        compilation_cache_dir=FLAGS.compilation_cache_dir or None,
        checkpoint_cache_dir=FLAGS.checkpoint_cache_dir, strict_compile=FLAGS.strict_compile,
        max_queued_requests=FLAGS.max_queued_requests,
        per_layer_weights=FLAGS.per_layer_weights, fuse_projections=FLAGS.fuse_projections,
        cpu_matmul=FLAGS.cpu_matmul,
        tp=FLAGS.tp, ep=FLAGS.ep, dp=FLAGS.dp, nnodes=FLAGS.nnodes, node_rank=FLAGS.node_rank,
        dist_init_addr=FLAGS.dist_init_addr, dist_timeout=FLAGS.dist_timeout,
        dist_heartbeat_timeout=FLAGS.dist_heartbeat_timeout,
        enable_split_prefill=FLAGS.enable_split_prefill,
        split_prefill_layers=FLAGS.split_prefill_layers,
        enable_multiplexing=FLAGS.enable_multiplexing,
        multiplex_itl_target_ms=FLAGS.multiplex_itl_target_ms,
        multiplex_decode_slowdown=FLAGS.multiplex_decode_slowdown,
        multiplex_fill_fraction=FLAGS.multiplex_fill_fraction,
        multiplex_max_stall_ms=FLAGS.multiplex_max_stall_ms,
        multiplex_fused=FLAGS.multiplex_fused,
        split_prefill_min_tokens=FLAGS.split_prefill_min_tokens,
        enable_two_batch_overlap=FLAGS.enable_two_batch_overlap,
        tbo_token_distribution_threshold=FLAGS.tbo_token_distribution_threshold,
        tbo_min_tokens=FLAGS.tbo_min_tokens, num_scheduler_steps=FLAGS.num_scheduler_steps,
        trace_dir=FLAGS.trace_dir or None, trace_buffer_steps=FLAGS.trace_buffer_steps)


def main(argv: list[str]) -> None:
    del argv
    # Replaces absl's root handler, whose --verbosity would apply to every logger; orbax
    # (restore steps, through absl) and jax ("no TPU backend") stay at WARNING.
    logging.basicConfig(level=logging.INFO, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = server_args()
    multihost.initialize(args)  # before anything starts a JAX backend
    if args.node_rank > 0:  # a follower: no HTTP, it replays rank 0's steps
        sys.exit(multihost.run_follower(args))
    sys.exit(serve(args, served_model_name=FLAGS.served_model_name))


if __name__ == "__main__":
    app.run(main)
