"""ServerArgs: every option of scripts/serve.py and Engine, with its default and help, once.

Names follow SGLang's, in snake_case. scripts/serve.py generates its absl flags from these
fields (runtime/arg_flags.py); SchedulerConfig takes its defaults from here and the
runner's config is derived from the args (runtime/engine_setup.runner_config). Every rule
between options is in `ServerArgs.validate`, whose errors name the flags and the fix.
Nothing in this module imports jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
           parse: Callable[[Any], Any] | None = None) -> Any:
    """A ServerArgs field: its default; its --help text; the values its flag accepts
    (choices, an enum flag); how a flag value becomes the field's value (parse)."""
    return dataclasses.field(default=default,
                             metadata={"help": help, "choices": choices, "parse": parse})


def _positive_or_off(value: int | None) -> int | None:
    return value if value is not None and value > 0 else None


@dataclasses.dataclass(frozen=True)
class Platform:
    """Facts of the machine that some option values depend on (validate's parameter)."""

    on_gpu: bool
    # Why cpu_kernels (the packed CPU matmul, the CPU attention) cannot run here; None: they can.
    cpu_kernels_unavailable: str | None = None
    # Why this CPU cannot decode 12-bit weights (--compress_weights); None: it can.
    x12_unavailable: str | None = None


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    """Everything `scripts/serve.py` and `Engine` take. Construction validates (validate()
    without platform facts); the engine checks the platform's part before it loads."""

    # ---- model and HTTP ------------------------------------------------------------------
    model: str = option("default", "orbax checkpoint, GGUF file, Hugging Face folder, "
                        "'default' (the embedded SmolLM2-135M-Instruct) or a preset: "
                        "'tiny-moe' (random-weight Qwen2-MoE-style model, SmolLM2 tokenizer)")
    served_model_name: str | None = option(None, "model name in /v1 replies (default: from "
                                           "--model)")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(30000, "port to listen on")
    api_key: str | None = option(None, "require 'Authorization: Bearer <key>' (not on "
                                 "/health)")
    max_queued_requests: int = option(1024, "waiting requests beyond this get 503 with "
                                      "Retry-After")
    max_top_logprobs: int = option(5, "most top logprobs a request may ask for")

    # ---- weights and numerics ------------------------------------------------------------
    dtype: str | None = option(None, "default: float32 on CPU, bfloat16 on GPU",
                               choices=("float32", "bfloat16"))
    kv_cache_dtype: str = option("auto", "KV pool dtype (auto: as --dtype)",
                                 choices=("auto", "float32", "bfloat16"))
    quantization: str | None = option(
        None, "int8: weight-only int8 matrices with a scale per output column on the CPU "
        "fast path (a quarter of f32's bytes a token; norms, embeddings and the KV pool stay "
        "in --dtype)", choices=("int8",))
    compress_weights: bool = option(
        False, "bfloat16 matrices on the CPU fast path in 12 bits each, losslessly (3/4 of "
        "bf16's bytes a token; the same weights): needs --dtype=bfloat16 and AVX-512BW")
    attention_backend: str | None = option(
        None, "pallas: the Pallas kernels (GPU); cpu: decode rows through our CPU kernel; "
        "xla: jnp (default: pallas on GPU, cpu where it builds, else xla)",
        choices=("xla", "cpu", "pallas"))
    cpu_matmul: str | None = option(
        None, "CPU matmuls: our kernel over weights packed at load, or XLA's dot (default: "
        "packed where it builds: x86-64 with AVX2 + FMA, and a C++ compiler)",
        choices=("packed", "xla"))
    per_layer_weights: bool | None = option(
        None, "layer weights as per-layer buffers picked by lax.switch (default: on wherever "
        "XLA's dot runs, GPU or CPU with --cpu_matmul=xla, whose dot copies a slice of the "
        "stacked weights; off for the packed CPU kernel, which reads the stacked weights in "
        "place, and under two-batch overlap)")
    fuse_projections: bool | None = option(
        None, "wq|wk|wv and w_gate|w_up as one matrix each (default: on a GPU without tensor "
        "parallelism, where XLA keeps the one-row decode products gemms instead of writing "
        "weight-sized temporaries)")
    compilation_cache_dir: str | None = option(
        "~/.cache/xlaserve/jax", "persistent XLA compilation cache ('' turns it off)")
    checkpoint_cache_dir: str = option("~/.cache/xlaserve/checkpoints", "where the default "
                                       "model is converted to")
    strict_compile: bool = option(False, "fail on any compilation after warm-up")

    # ---- KV pool and scheduling ----------------------------------------------------------
    page_size: int = option(16, "tokens per KV page")
    max_total_tokens: int | None = option(None, "KV pool size in tokens (default: from "
                                          "--mem_fraction)")
    mem_fraction: float = option(0.8, "share of free memory for the KV pool")
    max_running_requests: int = option(32, "decode batch limit")
    max_prefill_tokens: int = option(512, "tokens per prefill batch")
    chunked_prefill_size: int | None = option(512, "prefill chunk size; <= 0 turns chunking "
                                              "off", parse=_positive_or_off)
    max_extend_seqs: int = option(4, "prompts per prefill batch")
    enable_mixed_chunk: bool = option(False, "run prefill chunks and decodes in one batch "
                                      "(every bucket; overrides --itl_target_ms)")
    itl_target_ms: float | None = option(
        None, "decode first: every step carries the running decode rows and prefill fills it "
        "up to this step time, as a MIXED chunk sized from the measured step costs, or "
        "where no chunk fits, a few layers of a split prefill beside a DECODE step (a whole "
        "EXTEND when nothing decodes; runtime/prefill_policy.py). Default: 3.75x the full "
        "batch's decode step, measured at start-up and logged; 0: prefill first (a prefill "
        "step carries no decode rows). --enable_mixed_chunk, --enable_split_prefill, "
        "--enable_multiplexing, --chunked_prefill_size<=0, --dp>1 and "
        "--enable_two_batch_overlap override it")
    policy_layer_intervals: bool = option(
        True, "let the decode-first policy advance a prefill by layer intervals where no "
        "chunk fits its target (split-prefill programs of the largest chunk, compiled on "
        "models deep enough for an interval to be the finer step); off: the smallest chunk")
    schedule_policy: str = option("fcfs", "admission order", choices=("fcfs", "lpm"))
    disable_prefix_cache: bool = option(False, "no radix prefix cache")
    sliding_window_rings: bool = option(
        False, "models with sliding and global layers (Gemma 3, gpt-oss): the sliding "
        "layers keep their K/V in a ring of window + chunk tokens per request, reused as the "
        "context grows; the global layers alone fill the main pool. Turns the prefix cache "
        "off; not with split prefill, multiplexing, TBO, a draft model or dp / ep "
        "(docs/models.md)")
    disable_overlap_schedule: bool = option(False, "schedule step N+1 only after step N's "
                                            "results are back")
    # Decode steps per DECODE batch, run on the device in one program when no request can
    # be admitted (runtime/multi_step.py).
    num_scheduler_steps: int = option(
        1, "decode steps a DECODE batch runs on the device in one program when no request "
        "can be admitted (vLLM's --num-scheduler-steps): the host schedules, launches and "
        "reads back once per that many tokens; 1 turns it off")

    # ---- speculative decoding (runtime/spec_decode.py, docs/speculative.md) -------------
    speculative_algorithm: str | None = option(
        None, "ngram: draft by prompt lookup over the request's prompt and output, verify "
        "1 + --speculative_num_draft_tokens tokens per row in one TARGET_VERIFY pass "
        "(greedy rows keep the plain path's tokens, sampled rows its distribution); "
        "standalone: draft greedily with --speculative_draft_model_path",
        choices=("ngram", "standalone", "eagle"))
    speculative_num_draft_tokens: int = option(
        4, "most tokens a row drafts per step (each row adapts its own below this)")
    speculative_draft_model_path: str | None = option(
        None, "the draft model of --speculative_algorithm=standalone: a smaller model of "
        "the target's vocabulary, any path --model takes")

    # ---- shape buckets (None: derived from the limits above and the model) ---------------
    decode_buckets: tuple[int, ...] | None = option(
        None, "decode batch sizes to compile (default: powers of two up to "
        "--max_running_requests)")
    extend_token_buckets: tuple[int, ...] | None = option(None, "prefill token counts to "
                                                          "compile")
    kv_len_buckets: tuple[int, ...] | None = option(
        None, "sequence lengths to compile (multiples of --page_size; the largest is the "
        "context length)")

    # ---- device mesh (runtime/sharding.serving_mesh) -------------------------------------
    # Tensor parallel over heads / MLP columns, expert parallel over MoE experts,
    # data-parallel attention over dp ranks (each its own requests, KV pages and prefix
    # cache; runtime/dp_attention.py).
    dp: int = option(1, "data-parallel attention ranks: each runs its own requests over "
                     "its own KV pages (must divide --max_running_requests; buckets are per "
                     "rank)")
    tp: int = option(1, "tensor-parallel devices (must divide the query and KV heads); on a "
                     "mesh attention and matmuls run through XLA")
    ep: int = option(1, "expert-parallel devices for a MoE model (must divide the experts)")
    # Multi-process meshes (runtime/multihost.py): the processes meet at the jax.distributed
    # coordinator on rank 0's host.
    nnodes: int = option(1, "processes the device mesh spans (jax.distributed; start one "
                         "per node_rank, each with the same flags)")
    node_rank: int = option(0, "this process's rank: 0 serves HTTP and schedules, the "
                            "others replay its steps (runtime/multihost.py)")
    dist_init_addr: str | None = option(None, "HOST:PORT of rank 0's jax.distributed "
                                        "coordinator (needed with --nnodes > 1)")
    dist_timeout: int = option(300, "seconds the processes wait for each other at start-up")
    dist_heartbeat_timeout: int = option(100, "seconds a silent process counts as alive; "
                                         "then every process stops with an error")

    # ---- split prefill (runtime/split_prefill.py), multiplexing (runtime/multiplexing.py)
    enable_split_prefill: bool = option(False, "run prefills a few layers per call "
                                        "(SPLIT_PREFILL executables)")
    enable_multiplexing: bool = option(
        False, "interleave decode steps with split-prefill intervals, so a long prompt "
        "never freezes running streams (implies --enable_split_prefill)")
    split_prefill_layers: int | None = option(
        None, "layers per split-prefill interval (default: chosen each iteration to meet "
        "--multiplex_itl_target_ms)")
    split_prefill_min_tokens: int = option(256, "prefill buckets with fewer tokens run "
                                           "whole, not split (fewer executables)")
    multiplex_itl_target_ms: float = option(
        0.0, "inter-token latency one multiplexed iteration aims for (0: "
        "--multiplex_decode_slowdown x the running batch's decode step)")
    multiplex_decode_slowdown: float = option(
        3.0, "with --multiplex_itl_target_ms=0: how many times its decode step a running "
        "stream's inter-token latency may grow while a prompt prefills")
    # 0 by default: 0.75 fixes a burst's throughput but raised the overload ITL p99 2.5x.
    multiplex_fill_fraction: float = option(
        0.0, "prefill first, without decode steps, while the decoding streams are under "
        "this fraction of the batch the prefilling and admissible waiting requests make "
        "them (a burst fills the batch first; 0: always multiplex)")
    multiplex_max_stall_ms: float = option(
        5000.0, "while prefilling first, run a decode step once the streams waited this "
        "long (0: no bound)")
    multiplex_fused: bool = option(False, "run each multiplexed iteration as one fused "
                                   "decode + interval executable instead of two calls")

    # ---- two-batch overlap (docs/tbo.md) -------------------------------------------------
    enable_two_batch_overlap: bool = option(
        False, "MoE: split each batch into two micro-batches whose expert-parallel "
        "all_to_all overlaps the other's compute (docs/tbo.md)")
    tbo_token_distribution_threshold: float = option(
        0.48, "cut one sequence in two when the best sequence boundary leaves less than "
        "this share of the tokens on one side")
    tbo_min_tokens: int | None = option(None, "smaller batches run unsplit (default: 128 "
                                        "per ep rank)")

    # ---- execution trace (runtime/exec_trace.py) -----------------------------------------
    trace_dir: str | None = option(
        None, "write the execution trace as Chrome trace / Perfetto JSON here "
        "(ui.perfetto.dev), a file each time the ring fills and one at shutdown; also the "
        "default /start_profile folder")
    trace_buffer_steps: int = option(4096, "forward steps (and finished requests) the "
                                     "execution trace keeps; 0 turns it off")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def on_mesh(self) -> bool:
        return self.dp * self.tp * self.ep > 1

    @property
    def decode_first(self) -> bool:
        """Whether the decode-first prefill policy (--itl_target_ms) schedules: on unless
        --itl_target_ms=0 or a flag that picks another path overrides it."""
        overridden = (self.enable_mixed_chunk or self.enable_split_prefill
                      or self.enable_multiplexing or self.enable_two_batch_overlap
                      or self.chunked_prefill_size is None or self.dp > 1
                      or self.max_running_requests < 2)
        return self.itl_target_ms != 0 and not overridden

    def validate(self, platform: Platform | None = None) -> None:
        """Every rule between options (and each option's range) as one ValueError naming
        the flags and the fix; with `platform`, also what this machine cannot run."""
        problems = _ranges(self) + _rules(self)
        if platform is not None:
            problems += _platform_rules(self, platform)
        if problems:
            raise ValueError("invalid server arguments:\n  " + "\n  ".join(problems))


def _ranges(a: ServerArgs) -> list[str]:
    """Each option on its own: enum values, lower bounds, bucket lists."""
    out = []
    for f in dataclasses.fields(a):
        value, choices = getattr(a, f.name), f.metadata["choices"]
        if choices and value is not None and value not in choices:
            out.append(f"--{f.name}={value}: expected one of {', '.join(choices)}")
    at_least = {"port": 0, "max_queued_requests": 0, "max_top_logprobs": 0, "page_size": 1,
                "max_total_tokens": 1, "max_running_requests": 1, "max_prefill_tokens": 1,
                "chunked_prefill_size": 0, "max_extend_seqs": 1, "num_scheduler_steps": 1,
                "dp": 1, "tp": 1, "ep": 1, "nnodes": 1, "dist_timeout": 1,
                "dist_heartbeat_timeout": 1, "split_prefill_layers": 1,
                "split_prefill_min_tokens": 0, "tbo_min_tokens": 0, "trace_buffer_steps": 0,
                "multiplex_itl_target_ms": 0, "multiplex_max_stall_ms": 0,
                "itl_target_ms": 0, "speculative_num_draft_tokens": 1}
    for name, low in at_least.items():
        value = getattr(a, name)
        if value is not None and value < low:
            out.append(f"--{name}={value}: must be >= {low}")
    if not 0 < a.mem_fraction <= 1:
        out.append(f"--mem_fraction={a.mem_fraction}: must be in (0, 1]")
    if not 0 <= a.tbo_token_distribution_threshold <= 0.5:
        out.append(f"--tbo_token_distribution_threshold={a.tbo_token_distribution_threshold}"
                   ": must be in [0, 0.5]")
    for name in ("decode_buckets", "extend_token_buckets", "kv_len_buckets"):
        b = getattr(a, name)
        if b is not None and (not b or list(b) != sorted(set(b)) or b[0] < 1):
            out.append(f"--{name}={','.join(map(str, b))}: need increasing integers >= 1")
    return out


def _rules(a: ServerArgs) -> list[str]:
    """Rules between options that hold on every machine."""
    out = []
    if a.compress_weights and a.dtype != "bfloat16":
        out.append("--compress_weights stores bfloat16 weights: pass --dtype=bfloat16 with "
                   "it")
    if a.compress_weights and (a.quantization or a.cpu_matmul == "xla"):
        out.append("--compress_weights runs on the packed CPU matmul without --quantization: "
                   f"drop --quantization={a.quantization} / --cpu_matmul={a.cpu_matmul}")
    if a.quantization and a.cpu_matmul == "xla":
        out.append(f"--quantization={a.quantization} runs on the packed CPU matmul: drop "
                   "--cpu_matmul=xla")
    if a.kv_len_buckets and any(b % a.page_size for b in a.kv_len_buckets):
        out.append(f"--kv_len_buckets={','.join(map(str, a.kv_len_buckets))} must be "
                   f"multiples of --page_size={a.page_size}")
    if a.num_scheduler_steps > 1 and (a.enable_split_prefill or a.enable_multiplexing):
        out.append(f"--num_scheduler_steps={a.num_scheduler_steps} runs in the plain step "
                   "loop, not with --enable_split_prefill / --enable_multiplexing (their "
                   "decode steps are one at a time between prefill intervals): drop one")
    out += _spec_rules(a) + _mesh_rules(a) + _multihost_rules(a)
    return out


def _spec_rules(a: ServerArgs) -> list[str]:
    out = []
    algo = a.speculative_algorithm
    if algo == "eagle":
        out.append("--speculative_algorithm=eagle needs a trained EAGLE draft head for the "
                   "model, which xlaserve does not load: use ngram (prompt lookup) or "
                   "standalone with --speculative_draft_model_path (a smaller model of the "
                   "same vocabulary)")
    if algo == "standalone" and not a.speculative_draft_model_path:
        out.append("--speculative_algorithm=standalone drafts with the model of "
                   "--speculative_draft_model_path (a smaller model of the target's "
                   "vocabulary): pass it")
    if a.speculative_draft_model_path and algo != "standalone":
        out.append("--speculative_draft_model_path is the draft of "
                   "--speculative_algorithm=standalone: pass that too, or drop it")
    if algo:
        off = [flag for flag, on in (
            ("--enable_split_prefill", a.enable_split_prefill),
            ("--enable_multiplexing", a.enable_multiplexing), (f"--dp={a.dp}", a.dp > 1))
            if on]
        if off:
            out.append(f"--speculative_algorithm={algo} runs in the plain step loop on one "
                       f"data-parallel rank, not with {', '.join(off)}: drop one")
    return out


def _mesh_rules(a: ServerArgs) -> list[str]:
    out = []
    if a.on_mesh:
        explicit = [f"--{n}={v}" for n, v, ours in (
            ("attention_backend", a.attention_backend, "cpu"),
            ("cpu_matmul", a.cpu_matmul, "packed")) if v == ours]
        if explicit:
            out.append(f"{' '.join(explicit)}: the CPU kernels are single-device, and "
                       f"--dp={a.dp} --tp={a.tp} --ep={a.ep} is a mesh: use "
                       "--attention_backend=xla --cpu_matmul=xla (or leave them unset)")
    if a.dp > 1:
        if a.max_running_requests % a.dp:
            out.append(f"--dp={a.dp} must divide --max_running_requests="
                       f"{a.max_running_requests} (each rank runs its share)")
        off = [flag for flag, on in (
            ("--enable_split_prefill", a.enable_split_prefill),
            ("--enable_multiplexing", a.enable_multiplexing),
            ("--multiplex_fused", a.multiplex_fused),
            ("--enable_two_batch_overlap", a.enable_two_batch_overlap),
            (f"--num_scheduler_steps={a.num_scheduler_steps}", a.num_scheduler_steps > 1))
            if on]
        if off:
            out.append(f"--dp={a.dp} (data-parallel attention) does not run with "
                       f"{', '.join(off)} yet: drop them or use --dp=1")
    if a.enable_two_batch_overlap:
        if a.per_layer_weights:
            out.append("--enable_two_batch_overlap runs the stacked layer weights: drop "
                       "--per_layer_weights")
        if a.tp > 1:
            out.append(f"--enable_two_batch_overlap runs on an ep mesh without tp: drop "
                       f"--tp={a.tp}")
    if a.fuse_projections and a.tp > 1:
        out.append(f"--fuse_projections with --tp={a.tp}: a column shard of the fused "
                   "wq|wk|wv would not be one device's heads; drop --fuse_projections")
    return out


def _multihost_rules(a: ServerArgs) -> list[str]:
    out = []
    if not 0 <= a.node_rank < max(a.nnodes, 1):
        out.append(f"--node_rank={a.node_rank} must be in [0, nnodes={a.nnodes})")
    if a.nnodes > 1:
        addr = a.dist_init_addr or ""
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            out.append(f"--nnodes={a.nnodes} needs --dist_init_addr=HOST:PORT (rank 0's "
                       f"address for the jax.distributed coordinator), got {addr!r}")
    return out


def _platform_rules(a: ServerArgs, p: Platform) -> list[str]:
    """What this machine cannot run: explicit CPU-kernel choices, 12-bit weights."""
    out = []
    why = "the backend is a GPU" if p.on_gpu else p.cpu_kernels_unavailable
    for name, ours in (("cpu_matmul", "packed"), ("attention_backend", "cpu")):
        if getattr(a, name) == ours and why is not None:
            out.append(f"--{name}={ours!r} needs the CPU kernels: {why}")
    if a.compress_weights and p.x12_unavailable:
        out.append(f"--compress_weights: {p.x12_unavailable}")
    return out
