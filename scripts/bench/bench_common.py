"""Shared helpers of the benchmark scripts (bench_one_batch.py, bench_offline.py).

- timing: repeated calls summarized as median / p90 (the machine is shared and noisy, so
  a mean would be dragged by whoever else ran at the time);
- the machine's roofline, measured in the same process and run as the benchmark: the best
  f32 matmul of XLA's dot and the CPU kernels' (compute) and a jitted reduction over 1 GiB
  (memory read bandwidth);
- FLOP and byte counts of one Llama forward, counted honestly: only useful work (causal
  attention pairs, logits only for the rows that sample);
- JSON and PNG output, and the machine's state (load average) next to every result;
- the flags several scripts share (--out_dir, --smoke, the cache directories, the shape
  and load flags), declared once here and called by each script.

Imported by the scripts as a sibling module (`import bench_common`); it puts the
repository root on sys.path so `runtime` and `models` import from a checkout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

import cpu_kernels  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.forward_mode import ForwardMode  # noqa: E402
from runtime.config import ServerArgs  # noqa: E402
from runtime.request import Req, SamplingParams  # noqa: E402
from runtime.schedule_batch import BatchRow, ScheduleBatch  # noqa: E402

# A random model small enough that --smoke / --tiny runs compile and run in seconds.
TINY_CONFIG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                          tie_word_embeddings=True, eos_token_ids=(2,))


def log(msg: str) -> None:
    """Progress line with a wall-clock stamp (long runs: show that something moves)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- shared flags
# The DEFINE calls below name their caller, not this module, as the flags' owner (absl
# walks the stack past a disclaimed module): a script's --help lists them with its own.
flags.disclaim_key_flags()


def define_run_flags(out_dir: str, smoke: str, *, out_help: str = "where the JSON and PNG go",
                     compilation_cache: bool = True, checkpoint_cache: bool = False) -> None:
    """--out_dir (default `out_dir`), --smoke (`smoke` says what it shrinks) and, where
    the script builds an engine, the caches' directories as ServerArgs takes them."""
    flags.DEFINE_string("out_dir", out_dir, out_help)
    flags.DEFINE_bool("smoke", False, smoke)
    if checkpoint_cache:
        flags.DEFINE_string("checkpoint_cache_dir", "~/.cache/xlaserve/checkpoints",
                            "see ServerArgs")
    if compilation_cache:
        flags.DEFINE_string("compilation_cache_dir", "~/.cache/xlaserve/jax",
                            "see ServerArgs; '' off")


def set_flags(values: dict[str, Any]) -> None:
    """Set these flags over what the command line said (e.g. a script's --smoke sizes)."""
    for name, value in values.items():
        flags.FLAGS[name].value = value


def define_head_flags() -> None:
    """--heads, --kv_heads, --head_dim: SmolLM2-135M's attention layout by default."""
    flags.DEFINE_integer("heads", 9, "Hq")
    flags.DEFINE_integer("kv_heads", 3, "Hkv")
    flags.DEFINE_integer("head_dim", 64, "Dh")


def define_length_flags(per: str) -> None:
    """--input_len, --output_len: the tokens of each `per` (e.g. "throughput request")."""
    flags.DEFINE_integer("input_len", 128, f"prompt tokens per {per}")
    flags.DEFINE_integer("output_len", 128, f"new tokens per {per}")


def define_single_stream_flags(order: str) -> None:
    """--single_new_tokens, --single_repeats; `order` says how the runs of a round
    interleave across the contenders."""
    flags.DEFINE_integer("single_new_tokens", 128, "new tokens of the single stream")
    flags.DEFINE_integer("single_repeats", 3, "single-stream runs per contender and round, "
                         f"interleaved across {order} with a read probe between neighbours; "
                         "the round reports their median", lower_bound=1)


# ---------------------------------------------------------------- machine and timing


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages: on a shared machine, the context of every number."""
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       "")
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "jax": jax.__version__,
            "jax_backend": jax.default_backend(), "load_average": load_average()}


def summarize(secs: Sequence[float]) -> dict[str, float]:
    a = np.asarray(secs, np.float64)
    return {"median_s": float(np.median(a)), "p90_s": float(np.percentile(a, 90)),
            "min_s": float(a.min()), "max_s": float(a.max()), "mean_s": float(a.mean()),
            "n": int(a.size)}


def time_calls(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    """Seconds of each of `iters` calls of fn (which must block until its work is done),
    after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Leading items two sequences share (how far two greedy outputs agree)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def median(xs: Sequence[float]) -> float:
    return float(np.median(np.asarray(xs, np.float64))) if len(xs) else float("nan")


# ---------------------------------------------------------------- xlaserve runs


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def xla_throughput(engine: Any, prompts: list[list[int]], n: int) -> dict[str, Any]:
    """The Engine's offline throughput over `prompts`, n greedy tokens each."""
    t0 = time.perf_counter()
    outs = engine.generate(prompts, greedy(n))
    secs = time.perf_counter() - t0
    return throughput_record(secs, sum(map(len, prompts)), sum(len(o.output_ids) for o in outs))


def xla_single(engine: Any, ids: list[int], n: int) -> dict[str, Any]:
    """One stream's TTFT and decode tok/s (tokens after the first over their time)."""
    out = engine.generate([ids], greedy(n))[0]
    meta = out.meta_info
    decode_s = meta["e2e_latency"] - meta["ttft"]
    return {"prompt_tokens": len(ids), "new_tokens": len(out.output_ids),
            "ttft_s": meta["ttft"], "e2e_s": meta["e2e_latency"],
            "decode_tok_s": (len(out.output_ids) - 1) / decode_s,
            "output_ids": out.output_ids}


def throughput_record(secs: float, in_tokens: int, out_tokens: int) -> dict[str, Any]:
    return {"wall_s": secs, "input_tokens": in_tokens, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / secs, "total_tok_s": (in_tokens + out_tokens) / secs}


# ---------------------------------------------------------------- roofline


@dataclasses.dataclass(frozen=True)
class Roofline:
    matmul_gflops: float  # f32 GEMM, the compute ceiling of an f32 model
    mem_read_gbps: float  # a streaming read, the ceiling of weight-bound decode
    # The f32 GEMMs measured for matmul_gflops, GFLOP/s by name (measure_roofline).
    matmul_probes: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def measure_roofline(small: bool = False, iters: int = 10) -> Roofline:
    """f32 [1024, 1024] @ [1024, 4096] matmul GFLOP/s and measure_read_gbps, both jitted,
    medians of `iters` calls. `small` shrinks both (smoke runs; the numbers then mean
    little).

    The matmul ceiling is the faster of XLA's dot and, where they run, the CPU kernels'
    packed matmul (weights packed once, as the fast path serves them): the machine's
    compute is what its best f32 GEMM reaches. On an AMD EPYC Zen 4 XLA's dot probed
    139-193 GFLOP/s while the packed kernel's 512-token prefill ran at 130% of it, so a
    dot-only probe put the fast path above its own roof."""
    m, k, n = (256, 256, 1024) if small else (1024, 1024, 4096)
    a = jnp.ones((m, k), jnp.float32)
    b = jnp.ones((k, n), jnp.float32)
    gemms: dict[str, Callable[[], Any]] = {"xla_dot": functools.partial(jax.jit(jnp.matmul), a, b)}
    if jax.default_backend() == "cpu" and cpu_kernels.unavailable_reason() is None:
        gemms["packed"] = functools.partial(jax.jit(cpu_kernels.packed_matmul), a,
                                            cpu_kernels.pack(b))
    probes = {name: 2 * m * k * n / median(time_calls(lambda f=f: f().block_until_ready(),
                                                       iters, 2)) / 1e9
              for name, f in gemms.items()}
    return Roofline(matmul_gflops=max(probes.values()),
                    mem_read_gbps=measure_read_gbps(small, iters), matmul_probes=probes)


def measure_read_gbps(small: bool = False, iters: int = 10) -> float:
    """GB/s of summing a 1 GiB f32 array (64 MiB if `small`), jitted, median of `iters`
    calls: a streaming read, the ceiling of weight-bound decode."""
    nbytes = (64 if small else 1024) << 20
    # Fill with distinct values (not a broadcast constant XLA could fold) and keep the
    # array resident: the sum then only reads memory.
    x = jax.jit(lambda: jnp.arange(nbytes // 4, dtype=jnp.float32))()
    total = jax.jit(jnp.sum)
    return nbytes / median(time_calls(lambda: total(x).block_until_ready(), iters, 2)) / 1e9


def interleaved_singles(contenders: Sequence[tuple[Any, str, Callable[[], dict[str, Any]]]],
                        repeats: int, small: bool = False, tag: str = ""
                        ) -> dict[Any, dict[str, Any]]:
    """key -> single_record of each contender's single stream. contenders: (key, name,
    run) with run() one single stream's record (decode_tok_s, ttft_s, e2e_s, ...). Runs
    `repeats` passes over all of them, every other pass in reverse order (A B C, C B A,
    ...), with a read probe between neighbours: this VM's read bandwidth swings up to 2x
    from one minute to the next, so only runs seconds apart compare, and
    a weight-bound run only against the probes just before and after it
    (read_gbps_around; `small`: the smoke-size probe)."""
    runs: dict[Any, list[dict[str, Any]]] = {key: [] for key, _, _ in contenders}
    probe = measure_read_gbps(small)
    for i in range(repeats):
        for key, name, run in contenders if i % 2 == 0 else contenders[::-1]:
            s = run()
            after = measure_read_gbps(small)
            runs[key].append({**s, "read_gbps_around": [probe, after]})
            log(f"{tag}{name} single stream {i + 1}/{repeats}: {s['decode_tok_s']:.1f} "
                f"decode tok/s, ttft {s['ttft_s'] * 1e3:.0f} ms (read probes {probe:.1f} / "
                f"{after:.1f} GB/s)")
            probe = after
    return {key: single_record(rs) for key, rs in runs.items()}


def single_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's single-stream runs as one record: median decode tok/s, TTFT and
    end-to-end time, the first run's other fields (xlaserve's output tokens among them),
    each run under "runs"."""
    rec = {k: v for k, v in runs[0].items() if k != "read_gbps_around"}
    rec["decode_tok_s"] = median([x["decode_tok_s"] for x in runs])
    rec["ttft_s"] = median([x["ttft_s"] for x in runs])
    rec["e2e_s"] = median([x["e2e_s"] for x in runs])
    rec["runs"] = [{k: v for k, v in x.items() if k != "output_ids"} for x in runs]
    return rec


def single_shares(single: dict[str, Any], nbytes: float) -> list[float]:
    """Each run of a single-stream record as a share of its bandwidth bound: decode tok/s
    x bytes a token over the higher of the read probes around that run."""
    return [x["decode_tok_s"] * nbytes / (max(x["read_gbps_around"]) * 1e9)
            for x in single.get("runs", [single]) if "read_gbps_around" in x]


# ---------------------------------------------------------------- model costs


@dataclasses.dataclass(frozen=True)
class RowWork:
    """One row of a forward: `new` tokens at positions [start, start + new); `sampled`
    whether the row computes logits (a prefill needs them for its last token only)."""

    start: int
    new: int
    sampled: bool = True


def _mlp_params(cfg: ModelConfig, active: bool) -> int:
    """One layer's MLP weights: dense, or a MoE's router, experts (only the top-k a token
    uses when `active`) and shared expert with its gate."""
    d = cfg.hidden_size
    if not cfg.is_moe:
        return 3 * d * cfg.intermediate_size
    experts = cfg.num_experts_per_tok if active else cfg.num_experts
    shared = cfg.shared_expert_intermediate_size
    return (d * cfg.num_experts + experts * 3 * d * cfg.moe_intermediate_size
            + (3 * d * shared + d if shared else 0))


def matmul_params(cfg: ModelConfig, active: bool = True) -> int:
    """Weights of the decoder layers' matmuls: each costs 2 FLOPs per token it is used by
    (for a MoE, `active`: the experts one token runs)."""
    d, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    return cfg.num_layers * (d * (q + 2 * kv) + q * d + _mlp_params(cfg, active))


def total_params(cfg: ModelConfig) -> int:
    d, v = cfg.hidden_size, cfg.vocab_size
    norms = (2 * cfg.num_layers + 1) * d
    biases = cfg.num_layers * (cfg.q_size + 2 * cfg.kv_size) if cfg.attention_bias else 0
    head = 0 if cfg.tie_word_embeddings else d * v
    return matmul_params(cfg, active=False) + norms + biases + v * d + head


def weight_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Weights a step must read: every layer, norms, and the whole output projection (the
    tied embedding when tied); the input embedding only contributes gathered rows."""
    untied_embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (total_params(cfg) - untied_embed) * itemsize


def step_flops(cfg: ModelConfig, rows: Sequence[RowWork]) -> float:
    """Useful FLOPs of one forward over `rows`: layer matmuls per token, causal attention
    (QK^T and PV: 4 * heads * head_dim per query/key pair, per layer), logits per sampled
    row. Padding and masked-out pairs are not useful work and are not counted."""
    per_tok = 2 * matmul_params(cfg)
    attn_pair = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    logits = 2 * cfg.hidden_size * cfg.vocab_size
    flops = 0.0
    for r in rows:
        pairs = r.new * r.start + r.new * (r.new + 1) / 2  # sum over queries of keys seen
        flops += per_tok * r.new + attn_pair * pairs + (logits if r.sampled else 0)
    return flops


def step_bytes(cfg: ModelConfig, rows: Sequence[RowWork], itemsize: int) -> float:
    """Least memory one forward must read: the weights once, plus each row's cached K/V
    (positions before `start`; this step's own K/V are attended from registers)."""
    kv_per_tok = 2 * cfg.num_layers * cfg.kv_size * itemsize
    return weight_bytes(cfg, itemsize) + sum(r.start for r in rows) * kv_per_tok


def roofline_fractions(flops: float, nbytes: float, secs: float,
                       roof: Roofline) -> dict[str, float]:
    """How close a measured time is to each bound: frac_compute = achieved FLOP/s over the
    matmul peak, frac_memory = achieved read GB/s over the probe's, frac_roofline = the
    larger of the two bound times over the measured time."""
    t_compute = flops / (roof.matmul_gflops * 1e9)
    t_memory = nbytes / (roof.mem_read_gbps * 1e9)
    return {"gflop": flops / 1e9, "gbyte": nbytes / 1e9,
            "compute_bound_s": t_compute, "memory_bound_s": t_memory,
            "frac_compute": t_compute / secs, "frac_memory": t_memory / secs,
            "frac_roofline": max(t_compute, t_memory) / secs}


# ---------------------------------------------------------------- models


def tiny_model() -> tuple[ModelConfig, dict]:
    from models import llama
    return TINY_CONFIG, llama.init_params(TINY_CONFIG, jax.random.key(0))


def init_weights(cfg: ModelConfig, dtype: str) -> tuple[dict, float]:
    """Random weights drawn on the default device by one jitted program (no host copy,
    no f32 temporaries: 16 GB of Llama-3-8B bf16 never touch the host); (params, seconds
    including its compile)."""
    from models import registry

    t0 = time.perf_counter()
    init = jax.jit(functools.partial(registry.model_module(cfg).init_params, cfg,
                                     dtype=jnp.dtype(dtype)))
    params = jax.block_until_ready(init(jax.random.key(registry.PRESET_SEED)))
    return params, time.perf_counter() - t0


def smoke_args(base: ServerArgs, kv_len: int = 64) -> ServerArgs:
    """Few buckets for a --smoke run on tiny_model() (each bucket is a compile); the
    scheduler's token budget fits the largest."""
    return dataclasses.replace(base, max_running_requests=4, decode_buckets=(4,),
                               extend_token_buckets=(64,), kv_len_buckets=(kv_len,),
                               max_prefill_tokens=64, chunked_prefill_size=64,
                               max_extend_seqs=4)


def model_summary(cfg: ModelConfig, name: str, dtype: str, quantization: str | None = None,
                  nbytes: int | None = None) -> dict[str, Any]:
    """The model a benchmark served: `dtype` its compute (activation) dtype, `weights` its
    weights' format (the dtype, or the quantization: "int8" is weight-only int8 over f32
    activations), `weight_bytes` what a decode step reads of them (`nbytes` where the
    engine says: decode_weight_bytes; else the parameters in `dtype`)."""
    return {"name": name, "dtype": dtype, "weights": quantization or dtype,
            "config": json.loads(cfg.to_json()), "params": total_params(cfg),
            "matmul_params": matmul_params(cfg),
            "weight_bytes": nbytes or weight_bytes(cfg, jnp.dtype(dtype).itemsize)}


def random_8b_header(script: str, cfg: ModelConfig, dtype: str, smoke: bool) -> dict[str, Any]:
    """The JSON head of a GPU-suite script on random weights: the script, its command, the
    device and the model (Llama-3-8B-shaped, or tiny with --smoke)."""
    dev = jax.devices()[0]
    return {"script": script, "command": command_line(),
            "env": {"jax": jax.__version__, "backend": jax.default_backend(),
                    "device": dev.device_kind, "smoke": smoke},
            "model": model_summary(cfg, "tiny random" if smoke else "llama3-8b-shape random",
                                   dtype)}


def decode_weight_bytes(engine: Any) -> int:
    """Bytes of weights an engine's decode step reads: on the packed path every parameter
    array but the lookup table (its few gathered rows; the head is its own packed copy),
    panels and int8 scales as they are; elsewhere the model's weights in its dtype."""
    if engine.runner.cfg.cpu_matmul != "packed":
        return weight_bytes(engine.model_cfg, jnp.dtype(engine.runner.cfg.dtype).itemsize)
    params = {k: v for k, v in engine.runner.params.items() if k != "embed"}
    return sum(leaf.nbytes for leaf in jax.tree.leaves(params))


def pow2_at_least(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


# ---------------------------------------------------------------- bare steps


def bare_batch(mode: ForwardMode, tokens: Sequence[Sequence[int]], context: int,
               page_size: int) -> ScheduleBatch:
    """One row per token list, each on `context` cached tokens (slots 0.., pages 1.. in
    turn, whatever they hold: attention costs the same), greedy; a row of one token
    samples into its slot as a decode row does."""
    sp = SamplingParams(temperature=0, max_new_tokens=1 << 16, ignore_eos=True)
    rows, first = [], 1
    for i, ids in enumerate(tokens):
        pages = -(-(context + len(ids)) // page_size)
        req = Req(rid=f"bare{i}", prompt_ids=[3] * context, sampling=sp, req_slot=i)
        rows.append(BatchRow(req=req, input_ids=list(ids), start_pos=context,
                             pages=list(range(first, first + pages)), sample=len(ids) == 1))
        first += pages
    return ScheduleBatch(mode=mode, extend_rows=[], decode_rows=rows)


def time_alternately(runner: Any, batches: dict[str, ScheduleBatch],
                     rounds: int) -> dict[str, list[float]]:
    """Seconds of each batch's step, launch to read-back, the batches called in turn for
    `rounds` rounds after one warm call each (drift in the machine hits them alike)."""
    secs: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(rounds + 1):
        for name, batch in batches.items():
            t0 = time.perf_counter()
            runner.launch(batch).result()
            secs[name].append(time.perf_counter() - t0)
    return {name: v[1:] for name, v in secs.items()}


def verify_vs_decode(decode_s: Sequence[float], verify_s: Sequence[float]) -> dict[str, float]:
    """The median decode and verify steps in ms and their ratio (verify / decode)."""
    decode_ms, verify_ms = 1e3 * median(decode_s), 1e3 * median(verify_s)
    return {"decode_ms": decode_ms, "verify_ms": verify_ms, "ratio": verify_ms / decode_ms}


# ---------------------------------------------------------------- output


def write_json(out_dir: str | Path, name: str, obj: dict[str, Any]) -> Path:
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_json_default) + "\n")
    log(f"wrote {path}")
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def pyplot() -> Any | None:
    """matplotlib.pyplot on the file-only Agg backend, or None without the `bench` extra
    (the JSON is the result; the plot is a convenience)."""
    try:
        import matplotlib
    except ImportError:
        log("matplotlib not installed (pip install -e '.[bench]'): no PNG")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def grouped_bars(ax: Any, labels: Sequence[str], series: dict[str, Sequence[float]],
                 ylabel: str) -> None:
    """One group of bars per label, the series' bars side by side in it, on a log scale
    (the contenders of a point differ by orders of magnitude)."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar(np.arange(len(labels)) + width * (i - (len(series) - 1) / 2), values, width,
               label=name)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def save_figure(fig: Any, out_dir: str | Path, name: str) -> Path:
    path = Path(out_dir) / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")
    return path


def git_revision() -> str:
    """HEAD, with '+dirty' when the working tree differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout.strip()
    rev = git("rev-parse", "HEAD") or "unknown"
    return rev + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def command_line() -> str:
    """The command as typed from the repository root (interpreter path relative to it)."""
    exe = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else (
        sys.executable)
    return " ".join([exe, *sys.argv])


def enable_compilation_cache(path: str | None) -> None:
    """JAX's persistent compilation cache, as the Engine sets it (reruns start faster)."""
    if path:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
