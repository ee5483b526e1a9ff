"""A one-row decode step with FP8 layer matrices against the same step in bf16: the GPU
suite's fp8 section (scripts/bench/gpu_suite.py). Writes JSON.

    python scripts/bench/bench_fp8_step.py --out=fp8.json                   # GPU (8B shapes)
    .venv/bin/python scripts/bench/bench_fp8_step.py --smoke --out=/tmp/fp8.json  # CPU check

Random Llama-3-8B-shaped weights drawn on the device (16 GB bf16), laid out as the GPU
runner lays them (one buffer per layer, wq|wk|wv and w_gate|w_up fused); the FP8 copy
quantizes each layer matrix on the device to e4m3 with 128 x 128 block scales (as
DeepSeek-V3 / Qwen3-FP8 ship), which models/fp8.fp8_linear reads at one byte per weight.
Embedding, norms and the head stay bf16. Each step is the model's forward for one decode
row over --context cached tokens (XLA's attention: the section is about the weights),
the pool donated as the runner does; bf16 and FP8 steps are timed interleaved and their
medians compared with --target (FP8 / bf16: the layer matrices are ~87% of the bytes, so
a step that reads them at one byte each lands near 0.55x). Also recorded: the bytes
each step's weights take, and how far the FP8 logits are from the bf16 ones. (--smoke:
f32 in place of bf16 under the same keys, 64 cached tokens.)
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from gpu_shapes import LLAMA3_8B

from models import registry
from models.config import ModelConfig
from models.forward_batch import ForwardBatch, ForwardMode
from models.fp8 import FP8, Fp8Weight
from models.kv_pool import init_kv_pool
from runtime.batch_builder import BucketShape, SeedRow, pack_rows
from runtime.config import CacheConfig

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_fp8_step.json", "JSON results path")
flags.DEFINE_bool("smoke", False, "a tiny random model (a CPU check of this script)")
flags.DEFINE_integer("context", 1024, "tokens already cached for the decoding row")
flags.DEFINE_integer("iters", 20, "timed steps per variant")
flags.DEFINE_float("target", 0.6, "the FP8 step's goal, as a fraction of the bf16 step")

# The matrices an FP8 Llama checkpoint quantizes (runtime/hf_loader.FP8_KEEP_KEYS).
FP8_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
PAGE = 16


def _quantize(w: jax.Array, block: tuple[int, int]) -> Fp8Weight:
    """w [L, K, N] -> e4m3 with one f32 scale per block (each block's largest magnitude
    at e4m3's 448), as hf_folder.quantize_fp8_blocks writes checkpoints."""
    n_layers, k, n = w.shape
    bk, bn = block
    g = w.astype(jnp.float32).reshape(n_layers, k // bk, bk, n // bn, bn)
    scale = jnp.maximum(jnp.abs(g).max(axis=(2, 4)), 1e-12) / 448.0  # [L, Kb, Nb]
    q = (g / scale[:, :, None, :, None]).reshape(n_layers, k, n).astype(FP8)
    return Fp8Weight(q, scale, block)


def _decode_batch(context: int) -> ForwardBatch:
    """One decode row at position context - 1 over the pool's first pages."""
    n_pages = -(-context // PAGE)
    shape = BucketShape(0, 0, 1, n_pages)
    row = SeedRow([1], context - 1, list(range(1, n_pages + 1)))
    arrays = pack_rows([], [row], shape, PAGE)
    return ForwardBatch(**{k: jnp.asarray(v) for k, v in arrays.items()},
                        mode=ForwardMode.DECODE, num_extend_tokens=0, num_extend_seqs=0)


def _nbytes(tree: Any) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def run(cfg: ModelConfig, dtype: str, block: tuple[int, int], results: dict[str, Any]) -> None:
    model = registry.model_module(cfg)
    t0 = time.perf_counter()
    stacked, _ = bc.init_weights(cfg, dtype)
    quantize = jax.jit(_quantize, static_argnums=1)
    fp8_layers = {k: (quantize(v, block) if k in FP8_KEYS else v)
                  for k, v in stacked["layers"].items()}
    fp8_stacked = jax.block_until_ready({**stacked, "layers": fp8_layers})
    results["weights_init_s"] = time.perf_counter() - t0
    # Each stacked tree is dropped once laid out (per-layer copies): 8B peaks near 45 GB.
    variants = {"bf16": model.fuse_projections(model.unstack_layers(stacked))}
    del stacked
    variants["fp8"] = model.fuse_projections(model.unstack_layers(fp8_stacked))
    del fp8_stacked
    assert isinstance(variants["fp8"]["layer_list"][0]["wqkv"], Fp8Weight)
    results["weight_bytes"] = {k: _nbytes(v) for k, v in variants.items()}
    bc.log(f"weights: bf16 {results['weight_bytes']['bf16'] / 2**30:.2f} GiB, FP8 "
           f"{results['weight_bytes']['fp8'] / 2**30:.2f} GiB in {results['weights_init_s']:.1f} s")

    context = 64 if FLAGS.smoke else FLAGS.context
    cache = CacheConfig(page_size=PAGE, num_pages=-(-context // PAGE) + 1)
    batch = _decode_batch(context)

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, kv, batch):
        return model.forward(params, kv, batch, cfg, attention_backend="xla")

    pools, compile_s, logits = {}, {}, {}
    for name, params in variants.items():
        pools[name] = init_kv_pool(cfg, cache, jnp.dtype(dtype))
        t0 = time.perf_counter()
        out, pools[name] = step(params, pools[name], batch)
        logits[name] = np.asarray(out, np.float32)
        compile_s[name] = time.perf_counter() - t0
        bc.log(f"{name}: first step (compile) {compile_s[name]:.1f} s")
    results["compile_s"] = compile_s
    diff = np.abs(logits["fp8"] - logits["bf16"])
    results["logits"] = {"max_abs_diff": float(diff.max()),
                         "bf16_max_abs": float(np.abs(logits["bf16"]).max()),
                         "same_argmax": bool((logits["fp8"].argmax(-1)
                                              == logits["bf16"].argmax(-1)).all())}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(FLAGS.iters):  # interleaved: drift in the machine hits both alike
        for name, params in variants.items():
            t0 = time.perf_counter()
            out, pools[name] = step(params, pools[name], batch)
            out.block_until_ready()
            times[name].append(time.perf_counter() - t0)
    results["steps"] = {name: bc.summarize(t) for name, t in times.items()}
    ratio = results["steps"]["fp8"]["median_s"] / results["steps"]["bf16"]["median_s"]
    results.update(fp8_vs_bf16=ratio, target=FLAGS.target, meets_target=ratio <= FLAGS.target)
    bc.log(f"one-row decode step: bf16 {1e3 * results['steps']['bf16']['median_s']:.2f} ms, "
           f"FP8 {1e3 * results['steps']['fp8']['median_s']:.2f} ms = {ratio:.2f}x "
           f"(target <= {FLAGS.target})")


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.smoke:  # f32 at tiny sizes, 16 x 16 blocks that divide every matrix
        cfg, dtype, block = bc.TINY_CONFIG, "float32", (16, 16)
    else:
        cfg, dtype, block = LLAMA3_8B, "bfloat16", (128, 128)
    results: dict[str, Any] = {
        **bc.random_8b_header("bench_fp8_step", cfg, dtype, FLAGS.smoke),
        "block": list(block), "context": 64 if FLAGS.smoke else FLAGS.context, "errors": []}
    try:
        run(cfg, dtype, block, results)
    except Exception as e:  # keep what was measured, and why the rest was not
        results["errors"].append({"error": repr(e), "traceback": traceback.format_exc()})
        bc.log(f"ERROR {e!r}")
    out = Path(FLAGS.out)
    bc.write_json(out.parent, out.name, results)
    sys.exit(1 if results["errors"] else 0)


if __name__ == "__main__":
    app.run(main)
