"""Compile the engine's GPU programs for an H100 or H200 on this machine (no GPU needed)
and report, per program, what its optimized HLO moves through device memory against what
a perfect program must move. Predictions from the compiled programs, not timings.

    JAX_PLATFORMS=cpu python scripts/bench/gpu_aot.py --target=h100 --json=out/h100.json
    make gpu-aot        # DECODE at 1 / 32 / 128 rows, Llama-3-8B shapes, H100 and H200
    ... gpu_aot.py --model=70b --tp=8 --programs='^decode/'      # eight GPUs of one host
    ... gpu_aot.py --model=qwen3-moe --ep=8 --programs='^decode/'
    ... gpu_aot.py --rows=1,8 --draft_tokens=4 --programs='^(decode|target_verify)/'

With --tp / --ep the runner's weights, KV pool and inputs are placed by runtime/sharding.py's
rules on a mesh of compile-only GPUs; every byte below is then one GPU's, and each record
also counts the step's collectives (launches per step, and their bytes).

Per program (one JSON record each, and a table on stdout):
  bytes          bytes its kernels read and write (scripts/bench/hlo_traffic.py: loop trip counts
                 multiplied in, Pallas attention at the modelled KV read; a MoE step's loop
                 over its routed experts at the expected count, `unknown_trips`; its
                 grouped expert kernel at the expected tiles' weights, `expert_read`)
  perfect_bytes  weights read once (the embedding's gathered rows only) + the KV read by
                 its rows at --context tokens each + the KV it writes + its inputs and outputs
  ratio          bytes / perfect_bytes
  weight_copies  data-movement kernels per run whose output holds an array shaped like a
                 layer's weight (copied before its gemm, or a weight-sized product)
  temp_bytes     the executable's temporary buffers (memory_analysis)
  predicted_ms   bytes / the target's memory bandwidth (a memory-bound step's time)
Nothing is autotuned without a device (gemm tilings are XLA's heuristics); the fusion and
copy structure is decided before autotuning, so it is what the device would run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_programs  # noqa: E402
import hlo_traffic  # noqa: E402
from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
# The runner's DECODE and EXTEND steps, its multi-step decode programs, its samplers and
# (with --draft_tokens) its TARGET_VERIFY programs.
PROGRAMS = r"^(decode|extend|multi_decode|sample|target_verify)/"
flags.DEFINE_enum("target", "h100", sorted(gpu_programs.TARGETS), "GPU to compile for")
flags.DEFINE_string("json", None, "write one JSON record per program here")
flags.DEFINE_enum("model", "8b", ["8b", "70b", "qwen3-moe"], "model shape "
                  "(scripts/bench/gpu_shapes.py): Llama-3-8B, Llama-3-70B, Qwen3-30B-A3B")
flags.DEFINE_integer("tp", 1, "tensor-parallel GPUs (runtime/sharding.py's rules)")
flags.DEFINE_integer("ep", 1, "expert-parallel GPUs (a MoE model's experts split over them)")
flags.DEFINE_list("rows", ["1", "32", "128"], "decode buckets (rows) of the plan")
flags.DEFINE_list("extend", ["2048x1", "2048x16"], "EXTEND buckets of the plan, as "
                  "tokens x rows")
flags.DEFINE_integer("steps", 4, "decode steps of the multi-step programs (1: none)")
flags.DEFINE_string("programs", PROGRAMS, "regex over program names to compile")
flags.DEFINE_list("layers", ["default"], "layer weight layouts to compile: default (the "
                  "runtime's GPU default), stacked (lax.scan over [L, ...] slices), "
                  "per_layer (one buffer per layer behind a lax.switch); a +fused or "
                  "+unfused suffix sets fuse_projections (wq|wk|wv and w_gate|w_up as one "
                  "matrix each) instead of the default's choice")
flags.DEFINE_integer("context", 512, "earlier context per row, in tokens (the KV read)")
flags.DEFINE_integer("kv_tokens", 131072, "KV pool size in tokens")
flags.DEFINE_string("hlo_dir", None, "write each optimized HLO here")
flags.DEFINE_enum("moe_gpu_experts", "pallas", ["pallas", "xla"], "a MoE model's expert "
                  "products (models/moe.py GPU_EXPERTS): the grouped Triton kernel, or XLA's "
                  "(a loop over the routed experts for few tokens, else ragged_dot)")
flags.DEFINE_integer("draft_tokens", 0, "speculative decoding's k: the plan then also has a "
                     "TARGET_VERIFY program per decode bucket (rows x (1 + k) tokens)")


def model_config(name: str):
    import gpu_shapes

    return {"8b": gpu_shapes.LLAMA3_8B, "70b": gpu_shapes.LLAMA3_70B,
            "qwen3-moe": gpu_shapes.QWEN3_30B_A3B}[name]


def build_runner(model_cfg, layers: str, rows: list[int], kv_tokens: int,
                 extend: tuple[tuple[int, int], ...] = (), steps: int = 1, mesh=None,
                 draft_tokens: int = 0):
    """The runner a GPU engine would build for these shapes (weights abstract). `layers`:
    see --layers; `extend`: (tokens, rows) EXTEND buckets; `steps`: multi-step decode;
    `mesh`: gpu_programs.runner_mesh's (weights, pool and inputs placed by its rules);
    `draft_tokens`: see --draft_tokens."""
    import dataclasses

    from runtime import engine_setup
    from runtime.config import CacheConfig, ServerArgs

    layout, _, fuse = layers.partition("+")
    per_layer = {"default": None, "stacked": False, "per_layer": True}[layout]
    fused = {"": None, "fused": True, "unfused": False}[fuse]
    tokens = tuple(sorted({t for t, _ in extend})) or (64,)
    args = ServerArgs(dtype="bfloat16", attention_backend="pallas", cpu_matmul="xla",
                      max_running_requests=max(rows), decode_buckets=tuple(rows),
                      kv_len_buckets=(model_cfg.max_position_embeddings,),
                      extend_token_buckets=tokens, max_prefill_tokens=max(tokens),
                      chunked_prefill_size=max(tokens),
                      max_extend_seqs=max([b for _, b in extend] or [1]),
                      num_scheduler_steps=steps,
                      per_layer_weights=per_layer, fuse_projections=fused,
                      speculative_algorithm="ngram" if draft_tokens else None,
                      speculative_num_draft_tokens=draft_tokens or 4)
    rcfg = engine_setup.runner_config(args, model_cfg)
    if extend:  # exactly these (tokens, rows) pairs: seq buckets are crossed with tokens
        rcfg = dataclasses.replace(rcfg, extend_seq_buckets=tuple(sorted({b for _, b in
                                                                           extend})))
    if fused is None:  # as on a GPU (this process's backend is the CPU)
        rcfg = dataclasses.replace(rcfg, fuse_projections=engine_setup.default_fuse_projections(
            args, rcfg.cpu_matmul, gpu=True) and (mesh is None or mesh.shape["tp"] == 1))
    cache = CacheConfig(page_size=args.page_size, num_pages=kv_tokens // args.page_size + 1)
    return gpu_programs.abstract_runner(model_cfg, cache, rcfg, max(rows), mesh)


def weight_shapes(runner) -> list[tuple[int, ...]]:
    """Shapes of a layer's weight matrices, as the runner holds them and as the model
    defines them (a fused wq|wk|wv still counts a wk-shaped product as a copy)."""
    import jax

    from models.registry import model_module

    held = runner.params.get("layers") or runner.params["layer_list"][0]
    stacked = "layers" in runner.params
    shapes = {a.shape[1:] if stacked else a.shape for a in jax.tree.leaves(held)}
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    defined = model_module(runner.model_cfg).param_shapes(runner.model_cfg)["layers"]
    shapes |= {sh[1:] for sh in jax.tree.leaves(defined, is_leaf=is_shape)}
    return sorted(sh for sh in shapes if len([d for d in sh if d > 1]) >= 2)


def perfect_bytes(runner, name: str, context: int) -> float | None:
    """What a perfect forward step `name` must move through one device's memory (on a mesh:
    its shard of the weights and KV; inputs and logits whole); None for programs it does
    not model. A MoE step reads only the experts its rows route to: under uniform routing
    E * (1 - (1 - k/E)^rows) of each layer's E, spread evenly over the ep GPUs."""
    import jax
    import jax.numpy as jnp

    from models.kv_pool import kv_bytes_per_token
    from runtime.bucket_plan import key_name

    keys = {key_name(k): k for k in runner.step_keys()}
    multi = runner.paths.get("multi_step")
    if multi is not None:  # K decode steps: K steps' worth
        for k in multi.programs.keys:
            if multi.programs.name(k) == name:
                return multi.programs.steps * perfect_bytes(runner, key_name(k), context)
    if name not in keys:
        return None
    s, cfg = keys[name].shape, runner.model_cfg
    tokens, rows = s.num_extend_tokens + s.num_decode_seqs, s.num_extend_seqs + s.num_decode_seqs
    size = jnp.dtype(runner.cfg.dtype).itemsize
    experts = 0.0
    if cfg.is_moe:
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        experts = 1 - (1 - k / e) ** tokens  # fraction of the experts a step reads

    def held(path, a) -> float:
        keys = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        b = gpu_programs.shard_bytes(a)
        return b * experts if keys and keys[-1].startswith("we_") else b

    weights = sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(held, runner.params)))
    vocab_split = _split(runner, "vocab", cfg.vocab_size)
    if "lm_head" in runner.params:  # untied: the lookup reads only the step's rows
        weights += (tokens - cfg.vocab_size // vocab_split) * cfg.hidden_size * size
    per_token = kv_bytes_per_token(cfg, jnp.dtype(runner.cfg.kv_dtype)) / _kv_split(runner)
    kv_read = rows * context * per_token if s.num_pages_per_seq else 0
    io = 4 * (runner.flat_input(s).shape[0] + runner.max_running + 1) + 4 * rows * cfg.vocab_size
    return weights + kv_read + tokens * per_token + io


def _split(runner, logical: str, size: int) -> int:
    """Devices runtime/sharding.py splits a dim named `logical` over (1: whole)."""
    from runtime import sharding

    if runner.mesh is None:
        return 1
    spec = sharding.logical_to_spec((logical,), (size,), runner.mesh, runner.model_cfg)
    return runner.mesh.shape[spec[0]] if spec[0] else 1


def _kv_split(runner) -> int:
    """Devices one token's KV is split over (its KV heads, under tp)."""
    return _split(runner, "kv_heads", runner.model_cfg.kv_size)


def routed_local_experts(runner, tokens: int) -> float:
    """A GPU's expected routed local experts for `tokens` tokens under uniform routing (the
    perfect program's model): the trips of models/moe.py's loop over them, a while loop
    whose trip count the HLO cannot know."""
    cfg = runner.model_cfg
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    n_local = e // (1 if runner.mesh is None else runner.mesh.shape.get("ep", 1))
    return n_local * (1 - (1 - 1 / e) ** (tokens * k))


def expert_tiles(runner, tokens: int) -> float:
    """A GPU's expected tiles of models/moe.py's grouped expert kernel for `tokens` tokens
    under uniform routing, each tile loading its expert's weights once: a local expert
    receives Binomial(tokens, k / E) pairs (a token picks k distinct experts), ceil(n / bm)
    tiles of them (bm: moe.tile_rows)."""
    from models import moe

    cfg = runner.model_cfg
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    n_local = e // (1 if runner.mesh is None else runner.mesh.shape.get("ep", 1))
    bm, p = moe.tile_rows(tokens * k / e), k / e
    pmf, tiles = (1 - p) ** tokens, 0.0  # P(n = 0), then P(n) from P(n - 1)
    for n in range(1, tokens + 1):
        pmf *= (tokens - n + 1) / n * p / (1 - p)
        tiles += pmf * -(-n // bm)
    return n_local * tiles


def expert_stacks(runner) -> list[tuple[int, ...]]:
    """Shapes of one GPU's stacked experts of a layer, [E_local, K, N] (the grouped expert
    kernel's weight operands)."""
    cfg = runner.model_cfg
    n_local = cfg.num_experts // (1 if runner.mesh is None else runner.mesh.shape.get("ep", 1))
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    return [(n_local, d, f), (n_local, f, d), (n_local, d, 2 * f)]


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter",
               "collective-permute", "ragged-all-to-all")


def analyse(runner, name: str, compiled, tgt, context: int, layers: str, model: str,
            compile_s: float, hlo_dir: str | None = None) -> dict:
    import jax.numpy as jnp

    from runtime.bucket_plan import key_name

    cfg = runner.model_cfg
    text = re.sub(r", metadata=\{[^{}]*\}", "", compiled.as_text())
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, f"{tgt.name}.{layers}.{name.replace('/', '.')}"
                               ".hlo.txt"), "w") as f:
            f.write(text)
    shapes = {key_name(k): k.shape for k in runner.step_keys()}
    if (spec := runner.paths.get("spec")) is not None:  # TARGET_VERIFY: rows x (1 + k) tokens
        shapes.update(zip(spec.names, spec.shapes, strict=True))
    s = shapes.get(name)
    rows = (s.num_extend_seqs + s.num_decode_seqs) if s else None
    pool = gpu_programs.shard_bytes(runner.kv.k)  # one device's share of the K pool
    kv_item = jnp.dtype(runner.cfg.kv_dtype).itemsize
    read = ((rows or 0) * context * cfg.kv_size * kv_item / _kv_split(runner)
            if s and s.num_pages_per_seq else 0)
    tokens = (s.num_extend_tokens + s.num_decode_seqs) if s else None
    moe_tokens = tokens if cfg.is_moe and tokens else 0
    trips = routed_local_experts(runner, moe_tokens) if moe_tokens else 1.0
    stacks = expert_stacks(runner) if moe_tokens else []
    share = expert_tiles(runner, moe_tokens) / stacks[0][0] if moe_tokens else 1.0
    traffic = hlo_traffic.TrafficModel(text, pool, read, weight_shapes(runner), trips,
                                       stacks, share).run()
    perfect = perfect_bytes(runner, name, context)
    mem = compiled.memory_analysis()
    return dict(program=name, target=tgt.name, model=model, layers=layers, rows=rows,
                tokens=tokens, unknown_trips=trips, expert_read=share,
                context=context, bytes=traffic.bytes, perfect_bytes=perfect,
                ratio=traffic.bytes / perfect if perfect else None,
                weight_copies=sum(c.count for c in traffic.copies),
                weight_copy_bytes=traffic.copy_bytes, temp_bytes=mem.temp_size_in_bytes,
                predicted_ms=1e3 * traffic.bytes / tgt.bandwidth,
                perfect_ms=1e3 * perfect / tgt.bandwidth if perfect else None,
                unknown_trip_loops=traffic.unknown_trip_loops, compile_s=compile_s,
                devices=1 if runner.mesh is None else runner.mesh.size,
                collectives={k: traffic.runs[k] for k in sorted(traffic.runs)
                             if k.startswith(COLLECTIVES) and not k.endswith("-done")},
                collective_bytes=sum(v for k, v in traffic.kernels.items()
                                     if k.startswith(COLLECTIVES)),
                kernels={k: v for k, v in sorted(traffic.kernels.items(), key=lambda kv: -kv[1])})


@contextlib.contextmanager
def moe_experts(name: str) -> Iterator[None]:
    """models/moe.py's GPU expert product set to `name` (see --moe_gpu_experts)."""
    from models import moe

    saved, moe.GPU_EXPERTS = moe.GPU_EXPERTS, name
    try:
        yield
    finally:
        moe.GPU_EXPERTS = saved


def run(target: str, model: str, layers_list: list[str], rows: list[int], programs: str,
        context: int, kv_tokens: int, log=print, hlo_dir: str | None = None,
        extend: tuple[tuple[int, int], ...] = (), steps: int = 1, tp: int = 1,
        ep: int = 1, draft_tokens: int = 0, moe_gpu_experts: str = "pallas") -> list[dict]:
    """Compile and analyse the selected programs, one compilation at a time; with tp or
    ep > 1, for that many GPUs of one host (bytes per device). `moe_gpu_experts`: see
    --moe_gpu_experts."""
    tgt = gpu_programs.target(target)
    runner_mesh = gpu_programs.runner_mesh(tgt, tp=tp, ep=ep)
    mesh = runner_mesh or gpu_programs.compile_only_mesh(tgt)
    records = []
    for layers in layers_list:
        runner = build_runner(model_config(model), layers, rows, kv_tokens, extend, steps,
                              runner_mesh, draft_tokens)
        with gpu_programs.compiled_pallas(), moe_experts(moe_gpu_experts):
            for name, lower in runner._lowerings():
                if not re.search(programs, name):
                    continue
                t0 = time.perf_counter()
                compiled = gpu_programs.compile_lowering(lower, mesh)
                rec = analyse(runner, name, compiled, tgt, context, layers, model,
                              time.perf_counter() - t0, hlo_dir)
                rec["per_layer_weights"] = runner.cfg.per_layer_weights
                rec["fuse_projections"] = runner.cfg.fuse_projections
                rec["tp"], rec["ep"] = tp, ep
                rec["moe_gpu_experts"] = moe_gpu_experts
                records.append(rec)
                log(_row(rec))
    return records


def _row(r: dict) -> str:
    ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
    perfect = f"{r['perfect_bytes'] / 1e9:.2f}" if r["perfect_bytes"] else "-"
    return (f"{r['target']:5s} {r['layers']:17s} {r['program']:34s} rows={r['rows']!s:4s} "
            f"{r['bytes'] / 1e9:7.2f} GB / {perfect:>6s} GB = {ratio:>6s}  copies="
            f"{r['weight_copies']:4.0f}  temp={r['temp_bytes'] / 2**20:7.1f} MiB  "
            f"{r['predicted_ms']:6.2f} ms  compile {r['compile_s']:.1f} s"
            + (f"  x{r['devices']} GPUs, collectives {r['collectives']} "
               f"{r['collective_bytes'] / 1e6:.1f} MB" if r["devices"] > 1 else ""))


def main(argv: list[str]) -> None:
    del argv
    if reason := gpu_programs.gpu_plugin_missing():
        sys.exit(reason)
    extend = tuple(tuple(int(x) for x in e.split("x")) for e in FLAGS.extend)
    records = run(FLAGS.target, FLAGS.model, FLAGS.layers, [int(r) for r in FLAGS.rows],
                  FLAGS.programs, FLAGS.context, FLAGS.kv_tokens, hlo_dir=FLAGS.hlo_dir,
                  extend=extend, steps=FLAGS.steps, tp=FLAGS.tp, ep=FLAGS.ep,
                  draft_tokens=FLAGS.draft_tokens, moe_gpu_experts=FLAGS.moe_gpu_experts)
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    app.run(main)
