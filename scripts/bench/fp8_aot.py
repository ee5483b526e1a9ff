"""FP8 weights on an H100 / H200, read from the compiled program (no GPU needed).

Compiles, for a GPU target (scripts/bench/gpu_programs.py's compile-only topology):
  matmul/<name>/<kind>/rows=R  one Llama-3-8B layer matrix (models/fp8.fp8_linear for the
                               FP8 kinds, `x @ w` in bf16) at R rows
  decode/rows=R/<kind>         the runner's whole one-row DECODE step, Llama-3-8B, per-layer
                               weights, with bf16 or FP8 (128 x 128 block) layer matrices
  experts/<name>/<kind>/rows=R one MoE layer's expert product (models/moe.py's grouped
                               product: ragged_dot in bf16, models/fp8.fp8_ragged_dot for
                               FP8) for R decode rows of top-k pairs, the pairs spread
                               over the experts as evenly as they go
and reports per program the bytes its kernels move (scripts/bench/hlo_traffic.py), the
ratio to bf16, whether every FP8 weight reaches its dot as f8e4m3fn (`fp8_operands`: the
fusions with a dot that read an f8e4m3fn parameter) and the weight-shaped copies
(`weight_copies`: a dequantized bf16 weight written to memory would be one).

    JAX_PLATFORMS=cpu $CUDA_VENV/bin/python scripts/bench/fp8_aot.py --rows=1,8,32 \
        --json=out/fp8_aot.json
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import gpu_aot  # noqa: E402
import gpu_programs  # noqa: E402
import hlo_traffic  # noqa: E402
from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS  # --target, --rows (of the matmuls), --json, --hlo_dir: gpu_aot's
flags.DEFINE_bool("decode", True, "also the whole one-row decode step (slower to compile)")
flags.DEFINE_bool("experts", True, "also the MoE expert products (EXPERTS) at --rows")

# Llama-3-8B's layer matrices [K, N] (ours: [in, out]).
MATRICES = {"wq": (4096, 4096), "wk": (4096, 1024), "w_gate": (4096, 14336),
            "w_down": (14336, 4096)}
KINDS = {"bf16": None, "fp8_block": (128, 128), "fp8_channel": "channel"}
# One MoE layer's stacked experts [E, K, N] and its top-k: Qwen3-30B-A3B (128 experts of
# 2048 -> 768, top 8) and DeepSeek-V3 (256 of 7168 -> 2048, top 8); gate (up alike), down.
EXPERTS = {"qwen3_30b_gate": (128, 2048, 768, 8), "qwen3_30b_down": (128, 768, 2048, 8),
           "dsv3_gate": (256, 7168, 2048, 8), "dsv3_down": (256, 2048, 7168, 8)}


def _fp8_dots(text: str) -> int:
    """Fusions (and their callees) with a dot or reduce that read an f8e4m3fn parameter:
    the weight goes into the product as FP8, converted in registers."""
    comps, _ = hlo_traffic.parse(text)
    n = 0
    for comp in comps.values():
        ops = [i.op for i in comp.instrs.values()]
        reads_f8 = any(i.op == "parameter" and "f8e4m3fn[" in i.shape
                       for i in comp.instrs.values())
        if reads_f8 and ("dot" in ops or "reduce" in ops):
            n += 1
    return n


def _record(name: str, compiled, tgt, weight_shapes: list[tuple[int, ...]], hlo_dir) -> dict:
    text = re.sub(r", metadata=\{[^{}]*\}", "", compiled.as_text())
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, name.replace("/", ".") + ".hlo.txt"), "w") as f:
            f.write(text)
    traffic = hlo_traffic.TrafficModel(text, 0, 0, weight_shapes).run()
    return dict(program=name, target=tgt.name, bytes=traffic.bytes,
                weight_copies=sum(c.count for c in traffic.copies),
                weight_copy_bytes=traffic.copy_bytes, fp8_operands=_fp8_dots(text),
                temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                predicted_us=1e6 * traffic.bytes / tgt.bandwidth)


def _fp8_abstract(shape: tuple[int, ...], kind, sharding):
    import jax
    import jax.numpy as jnp

    from models.fp8 import FP8, Fp8Weight

    *lead, k, n = shape
    block = (k, 1) if kind == "channel" else kind
    scale = (*lead, -(-k // block[0]), -(-n // block[1]))
    return Fp8Weight(jax.ShapeDtypeStruct(shape, FP8, sharding=sharding),
                     jax.ShapeDtypeStruct(scale, jnp.float32, sharding=sharding), block)


def matmuls(tgt, mesh, rows: list[int], hlo_dir) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from models.layers import linear

    rep = NamedSharding(mesh, PartitionSpec())
    out = []
    for name, (k, n) in MATRICES.items():
        for kind, block in KINDS.items():
            for r in rows:
                x = jax.ShapeDtypeStruct((r, k), jnp.bfloat16, sharding=rep)
                w = (jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=rep) if block is None
                     else _fp8_abstract((k, n), block, rep))
                compiled = jax.jit(linear).trace(x, w).lower().compile()
                rec = _record(f"matmul/{name}/{kind}/rows={r}", compiled, tgt, [(k, n)],
                              hlo_dir)
                out.append(rec)
    return _vs_bf16(out)


def _vs_bf16(out: list[dict]) -> list[dict]:
    """Each record's bytes against the bf16 record of the same matrix and rows (programs
    named kind/name/dtype/rows=R)."""
    base = {(r["program"].split("/")[1], r["program"].split("/")[3]): r["bytes"]
            for r in out if "/bf16/" in r["program"]}
    for r in out:
        _, name, _, rows_ = r["program"].split("/")
        r["vs_bf16"] = r["bytes"] / base[(name, rows_)]
    return out


def experts(tgt, mesh, rows: list[int], hlo_dir) -> list[dict]:
    """The grouped expert product at decode row counts, bf16 against FP8 experts."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from models.moe import _grouped

    rep = NamedSharding(mesh, PartitionSpec())
    out = []
    for name, (e, k, n, top_k) in EXPERTS.items():
        for r in rows:
            m = r * top_k  # (token, expert) pairs, sorted by expert as moe.experts sorts
            x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=rep)
            sizes = jax.ShapeDtypeStruct((e,), jnp.int32, sharding=rep)
            own = jax.ShapeDtypeStruct((m,), jnp.int32, sharding=rep)
            for kind, block in KINDS.items():
                w = (jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16, sharding=rep)
                     if block is None else _fp8_abstract((e, k, n), block, rep))
                compiled = jax.jit(_grouped).trace(x, w, sizes, own).lower().compile()
                rec = _record(f"experts/{name}/{kind}/rows={r}", compiled, tgt, [(e, k, n)],
                              hlo_dir)
                # The weights of the experts the pairs can reach (each pair its own expert
                # at most): the bytes a kernel that reads only those would move.
                active = min(e, m) * k * n
                rec.update(pairs=m, active_expert_weight_bytes={
                    "bf16": 2 * active, "fp8": active}["bf16" if block is None else "fp8"])
                out.append(rec)
    return _vs_bf16(out)


def decode_steps(tgt, mesh, hlo_dir) -> list[dict]:
    """The whole one-row decode step, bf16 against FP8 layer matrices."""
    import jax

    from models.fp8 import Fp8Weight

    out = []
    for kind in ("bf16", "fp8_block", "fp8_channel"):
        # The GPU default: per-layer buffers, wq|wk|wv and w_gate|w_up fused (FP8 ones
        # fused by models.fp8.concat_columns).
        runner = gpu_aot.build_runner(gpu_aot.model_config("8b"), "per_layer+fused", [1],
                                      131072)
        if kind != "bf16":
            runner.params = {**runner.params, "layer_list": [
                {k: (_fp8_abstract(v.shape, KINDS[kind], v.sharding) if v.ndim == 2 else v)
                 for k, v in lp.items()} for lp in runner.params["layer_list"]]}
            assert isinstance(runner.params["layer_list"][0]["wqkv"], Fp8Weight)
        for name, lower in runner._lowerings():
            if not name.startswith("decode/"):
                continue
            t0 = time.perf_counter()
            compiled = gpu_programs.compile_lowering(lower, mesh)
            rec = gpu_aot.analyse(runner, name, compiled, tgt, 512, kind, "8b",
                                  time.perf_counter() - t0, hlo_dir)
            rec = {k: rec[k] for k in ("bytes", "perfect_bytes", "weight_copies", "temp_bytes",
                                       "predicted_ms", "target")}
            text = compiled.as_text()
            rec.update(program=f"{name}/{kind}", fp8_operands=_fp8_dots(text),
                       weights_bytes=sum(a.size * a.dtype.itemsize
                                         for a in jax.tree.leaves(runner.params)))
            out.append(rec)
    for r in out[1:]:
        r["vs_bf16"] = r["bytes"] / out[0]["bytes"]
    return out


def main(argv: list[str]) -> None:
    del argv
    if reason := gpu_programs.gpu_plugin_missing():
        sys.exit(reason)
    tgt = gpu_programs.target(FLAGS.target)
    mesh = gpu_programs.compile_only_mesh(tgt)
    records = matmuls(tgt, mesh, [int(r) for r in FLAGS.rows], FLAGS.hlo_dir)
    if FLAGS.experts:
        records += experts(tgt, mesh, [int(r) for r in FLAGS.rows], FLAGS.hlo_dir)
    if FLAGS.decode:
        with gpu_programs.compiled_pallas():
            records += decode_steps(tgt, mesh, FLAGS.hlo_dir)
    for r in records:
        print(f"{r['program']:36s} {r['bytes'] / 1e6:9.1f} MB  "
              f"{r.get('vs_bf16', 1.0):5.2f}x bf16  fp8 operands {r['fp8_operands']:3d}  "
              f"weight copies {r['weight_copies']:3.0f}  temp {r['temp_bytes'] / 2**20:7.1f} MiB",
              flush=True)
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    app.run(main)
