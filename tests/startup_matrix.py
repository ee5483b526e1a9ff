"""The start-up matrix: every documented serving flag, alone and in the combinations the
docs present, as ServerArgs overrides on a tiny model with SmolLM2's head layout (9 query /
3 KV heads, so tp=3 splits them and tp=2 / 4 cannot).

Each row either starts an Engine and serves one request with the reference tokens (the
plain single-device path's greedy tokens) or is refused at start-up with an error that
names its flags. tests/test_startup_matrix.py runs the rows; the table lives here so that
it reads as the list of what is covered.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.config import ModelConfig

# SmolLM2's attention layout (9 / 3 heads) at toy width. Two layers, so split prefill has
# intervals to cut; 128 tokens of vocabulary keep the sampler and the head cheap.
DENSE = ModelConfig(vocab_size=128, hidden_size=72, intermediate_size=96, num_layers=2,
                    num_heads=9, num_kv_heads=3, head_dim=8, max_position_embeddings=256)
# The same attention with a Qwen2-MoE body (shared expert, 4 experts top-2) for --ep / TBO.
MOE = dataclasses.replace(DENSE, architecture="qwen2_moe", attention_bias=True,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48)

# Every row starts from these: one bucket of each kind, so an engine compiles 5 programs
# (1 DECODE, 2 EXTEND: with and without a cached prefix, 1 sampler, 1 slot init). The
# extend bucket holds two 128-token query blocks of the jnp attention, so its key-block
# loop is traced (the shape where --tp=3 once failed to start).
PROMPT_LEN = 200
MAX_NEW = 4
BASE: dict[str, Any] = dict(
    page_size=16, max_running_requests=2, decode_buckets=(2,), extend_token_buckets=(256,),
    kv_len_buckets=(256,), max_prefill_tokens=256, chunked_prefill_size=256,
    max_extend_seqs=1, max_total_tokens=1024, max_top_logprobs=0, strict_compile=True,
    attention_backend="xla", cpu_matmul="xla", per_layer_weights=False)
# The engine's own defaults where a row wants them (None: chosen for this machine).
DEFAULTS = dict(attention_backend=None, cpu_matmul=None, per_layer_weights=None)
# Data-parallel attention: each rank's decode bucket is its share of the requests.
DP2 = dict(dp=2, decode_buckets=(1,))
TP3 = dict(tp=3, **DEFAULTS)  # `serve.py --tp=3`: the mesh picks XLA's dot and jnp attention


@dataclasses.dataclass(frozen=True)
class Row:
    """One start-up: `flags` are the serve.py flags it stands for, `overrides` the
    ServerArgs fields on top of BASE. `refused`: a regex of the start-up error (every flag
    of `flags` must appear in it too); None: it serves the reference tokens. `slow`: why
    it runs only with `make test-slow` (None: in `make test`)."""

    name: str
    flags: tuple[str, ...]
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    refused: str | None = None
    model: str = "dense"
    slow: str | None = None
    server: bool = False  # through the HTTP server (build_server) instead of Engine
    # "cpu_kernels" / "x12": where this machine cannot run them (cpu_kernels'
    # unavailable_reason / x12_unavailable_reason), the row is refused with that reason.
    needs: str | None = None


def _row(name: str, flags: str, refused: str | None = None, model: str = "dense",
         slow: str | None = None, server: bool = False, needs: str | None = None,
         **overrides: Any) -> Row:
    return Row(name, tuple(flags.split()), overrides, refused, model, slow, server, needs)


# Flags every row sets through BASE; the plain row stands for them.
BASE_FLAGS = ("page_size max_running_requests decode_buckets extend_token_buckets "
              "kv_len_buckets max_prefill_tokens chunked_prefill_size max_extend_seqs "
              "max_total_tokens max_top_logprobs strict_compile attention_backend cpu_matmul "
              "per_layer_weights compilation_cache_dir")

ROWS: tuple[Row, ...] = (
    # -- single device: the reference, backends, dtypes ------------------------------------
    _row("plain", BASE_FLAGS),
    _row("cpu_defaults", "attention_backend cpu_matmul per_layer_weights", **DEFAULTS),
    _row("per_layer_weights", "per_layer_weights", per_layer_weights=True,
         slow="4 more programs; per-layer weights are the mesh default, so tp3 / dp2 run them "
              "in make test"),
    _row("fuse_projections", "fuse_projections", fuse_projections=True,
         per_layer_weights=True,
         slow="the GPU layout (per-layer, fused projections): test_engine's xla runner runs "
              "it in make test"),
    _row("pallas", "attention_backend", attention_backend="pallas",
         slow="the Pallas kernels in interpret mode: 3 programs of ~10 s each to compile"),
    _row("bf16", "dtype kv_cache_dtype", dtype="bfloat16", kv_cache_dtype="float32"),
    _row("int8", "quantization cpu_matmul", quantization="int8", cpu_matmul="packed",
         needs="cpu_kernels"),
    _row("int8_xla_dot", "quantization cpu_matmul", "--quantization=int8 runs on the packed",
         quantization="int8"),
    _row("compress_weights", "compress_weights dtype", dtype="bfloat16",
         compress_weights=True, cpu_matmul="packed", needs="x12"),
    _row("compress_f32", "compress_weights", "compress_weights", compress_weights=True,
         cpu_matmul="packed"),
    # -- host scheduling (the same programs: compilation-cache hits) ------------------------
    _row("scheduling", "chunked_prefill_size disable_prefix_cache schedule_policy "
         "disable_overlap_schedule trace_buffer_steps", chunked_prefill_size=64,
         disable_prefix_cache=True, schedule_policy="lpm", disable_overlap_schedule=True,
         trace_buffer_steps=0),
    _row("unchunked", "chunked_prefill_size", chunked_prefill_size=None),
    _row("sliding_window_rings", "sliding_window_rings",
         "sliding_window_rings is for models with sliding and global layers",
         sliding_window_rings=True),
    _row("itl_target", "itl_target_ms", itl_target_ms=50.0),
    _row("prefill_first", "itl_target_ms", itl_target_ms=0.0),
    _row("no_layer_intervals", "policy_layer_intervals", policy_layer_intervals=False),
    _row("mixed_chunk", "enable_mixed_chunk", enable_mixed_chunk=True,
         slow="a MIXED program; dp2 (which needs them) runs MIXED programs in make test"),
    _row("kv_pool_from_memory", "mem_fraction max_total_tokens", max_total_tokens=None,
         mem_fraction=0.5, slow="a pool sized from memory has its own shape: 5 more programs"),
    # -- split prefill, multiplexing, multi-step ------------------------------------------
    _row("split_prefill", "enable_split_prefill split_prefill_layers split_prefill_min_tokens",
         enable_split_prefill=True, split_prefill_layers=1, split_prefill_min_tokens=0),
    _row("multiplexing", "enable_multiplexing multiplex_fused multiplex_itl_target_ms "
         "multiplex_decode_slowdown multiplex_fill_fraction multiplex_max_stall_ms",
         enable_multiplexing=True, multiplex_fused=True, multiplex_itl_target_ms=50.0,
         multiplex_decode_slowdown=2.0, multiplex_fill_fraction=0.75,
         multiplex_max_stall_ms=100.0),
    _row("multi_step", "num_scheduler_steps", num_scheduler_steps=4),
    _row("multi_step_multiplexing", "num_scheduler_steps enable_multiplexing",
         "--num_scheduler_steps=4 runs in the plain step loop, not with "
         "--enable_split_prefill / --enable_multiplexing",
         num_scheduler_steps=4, enable_multiplexing=True),
    # -- speculative decoding ---------------------------------------------------------------
    _row("speculative_ngram", "speculative_algorithm speculative_num_draft_tokens",
         speculative_algorithm="ngram", speculative_num_draft_tokens=3),
    _row("speculative_eagle", "speculative_algorithm", "needs a trained EAGLE draft head",
         speculative_algorithm="eagle"),
    _row("speculative_standalone", "speculative_algorithm speculative_draft_model_path",
         "cannot load the draft model", speculative_algorithm="standalone",
         speculative_draft_model_path="/nonexistent/draft"),
    # -- the mesh (4 fake CPU devices) ----------------------------------------------------
    _row("tp3", "tp", **TP3),
    _row("dp2", "dp", **DP2, **DEFAULTS),
    _row("dp4", "dp", dp=4, max_running_requests=4, decode_buckets=(1,),
         slow="a third mesh shape of the dp path: 6 more programs"),
    _row("tp3_split_prefill", "tp enable_split_prefill", enable_split_prefill=True, **TP3),
    _row("tp3_multiplexing", "tp enable_multiplexing multiplex_fused",
         enable_multiplexing=True, multiplex_fused=True, **TP3),
    _row("tp3_multi_step", "tp num_scheduler_steps", num_scheduler_steps=4, **TP3),
    _row("tp3_pallas", "tp attention_backend", attention_backend="pallas", tp=3,
         slow="the Pallas kernels in interpret mode on the mesh: ~40 s of compiles"),
    _row("tp3_bf16", "tp dtype", dtype="bfloat16", **TP3,
         slow="bf16 on the mesh: 5 more programs; bf16 and tp=3 each run in make test"),
    _row("tp2", "tp", "tp=2 does not divide the model's num_heads=9 and num_kv_heads=3",
         tp=2),
    _row("tp4", "tp", "tp=4 does not divide", tp=4),
    _row("tp3_fuse_projections", "tp fuse_projections",
         "--fuse_projections with --tp=3: a column shard", fuse_projections=True, **TP3),
    _row("tp3_dp2", "tp dp", r"dp=2 x tp=3 x ep=1 needs 6 devices", tp=3, dp=2),
    _row("tp3_cpu_attention", "tp attention_backend", "the CPU kernels are single-device",
         tp=3, attention_backend="cpu"),
    _row("tp3_packed", "tp cpu_matmul", "--cpu_matmul=packed: the CPU kernels are single-device",
         tp=3, cpu_matmul="packed"),
    _row("dp2_split_prefill", "dp enable_split_prefill",
         "dp=2 .* does not run with --enable_split_prefill", enable_split_prefill=True, **DP2),
    _row("dp2_multiplexing", "dp enable_multiplexing",
         "dp=2 .* does not run with --enable_multiplexing",
         enable_multiplexing=True, **DP2),
    _row("dp2_multi_step", "dp num_scheduler_steps",
         "dp=2 .* does not run with --num_scheduler_steps=4", num_scheduler_steps=4, **DP2),
    _row("dp3", "dp max_running_requests", "--dp=3 must divide --max_running_requests=2", dp=3),
    _row("ep_dense", "ep", "ep=2 needs a MoE model", ep=2),
    # -- MoE: expert parallelism and two-batch overlap -----------------------------------
    _row("moe", "", model="moe", slow="a MoE model: ~20 programs over its rows"),
    _row("moe_ep2", "ep", model="moe", ep=2, slow="a MoE model: ~20 programs over its rows"),
    _row("moe_tbo", "enable_two_batch_overlap tbo_token_distribution_threshold "
         "tbo_min_tokens", model="moe", ep=2, enable_two_batch_overlap=True,
         tbo_token_distribution_threshold=0.3, tbo_min_tokens=1,
         slow="a MoE model: ~20 programs over its rows"),
    _row("moe_dp2_ep2", "dp ep", model="moe", ep=2, **DP2,
         slow="a MoE model: ~20 programs over its rows"),
    _row("tbo_dense", "enable_two_batch_overlap",
         "enable_two_batch_overlap is for MoE models", enable_two_batch_overlap=True),
    _row("moe_tbo_tp3", "enable_two_batch_overlap tp", "enable_two_batch_overlap runs on an ep "
         "mesh without tp", model="moe", enable_two_batch_overlap=True, **TP3),
    _row("moe_tbo_dp2", "enable_two_batch_overlap dp",
         "dp=2 .* does not run with --enable_two_batch_overlap", model="moe",
         enable_two_batch_overlap=True, ep=2, **DP2),
    # -- multi-process flags: checked before any backend starts -----------------------------
    _row("nnodes_without_address", "nnodes dist_init_addr",
         "--nnodes=2 needs --dist_init_addr", nnodes=2),
    _row("follower_rank", "node_rank nnodes", "node_rank=2 must be in", nnodes=2,
         node_rank=2, dist_init_addr="127.0.0.1:1"),
    # -- the HTTP front end around the plain engine -------------------------------------
    _row("server", "host port api_key max_queued_requests trace_dir served_model_name",
         server=True, max_queued_requests=8),
)

# ServerArgs fields (and serve.py flags) no row starts, and why.
NOT_COVERED: dict[str, str] = {
    "model": "the rows pass the tiny model in process (Engine(model=...)); loading orbax, "
             "GGUF and HF checkpoints is tests/test_checkpoint.py's",
    "checkpoint_cache_dir": "only used to convert the default SmolLM2 checkpoint "
                            "(tests/test_checkpoint.py, the slow SmolLM2 mesh tests)",
    "dist_timeout": "a multi-process mesh: tests/test_multihost.py starts the processes",
    "dist_heartbeat_timeout": "a multi-process mesh: tests/test_multihost.py starts the "
                              "processes",
}
