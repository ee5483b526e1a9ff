"""How fast a decode step can read its layer weights, by how the layers are laid out: the
question behind the runtime's per_layer_weights default on a GPU. Writes JSON.

    python scripts/bench/bench_layer_weights.py --out=layers.json            # GPU (8B shapes)
    .venv/bin/python scripts/bench/bench_layer_weights.py --smoke --out=/tmp/lw.json  # CPU check

The runtime scans one layer body over the stacked weights [L, ...], the layer index
traced (models/layers.py `_layer_body`), unless per_layer_weights keeps one buffer per
layer behind a lax.switch. On XLA CPU a dynamic slice of the stack feeding a dot is
copied first, which halves a memory-bound step (why the switch exists there). The first
H200 run (docs/gpu_suite.md) put a one-row 8B decode step at 15 ms against 3.1 ms of
weight reads at 4.8 TB/s, as if each layer's weights were read about three times: a
copy would do that. This measures the layer loop alone, side by side, with Llama-3-8B's
weight-bearing matmuls (q, k, v, o, gate, up, down) and B rows:
  stacked   lax.scan over layer indices, weights dynamically indexed from the stack
            (the GPU default before per-layer buffers)
  switch    lax.scan over layer indices, lax.switch into one branch per layer's buffers
            (per_layer_weights)
  switch_fused  switch with q|k|v and gate|up as one matrix each (fuse_projections: the
            runtime's GPU default; one row keeps k and v gemms, docs/gpu.md)
  unrolled  a Python loop over the per-layer buffers: no dynamic indexing at all (the
            bound for the other two; not a runtime mode)
Each is timed as the weight bytes read per call over the measured time (GB/s, and as a
fraction of --peak_hbm_tbps), the variants interleaved A B C A B C and medians reported.
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_layer_weights.json", "JSON results path")
flags.DEFINE_bool("smoke", False, "tiny shapes (a CPU check of this script)")
flags.DEFINE_list("batches", ["1", "32", "128"], "rows per call")
flags.DEFINE_integer("iters", 10, "timed calls per variant")
flags.DEFINE_float("peak_hbm_tbps", 4.8, "nominal HBM bandwidth, TB/s (H200: 4.8)")

# Llama-3-8B: hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, 32 layers.
FULL = dict(layers=32, d=4096, q=4096, kv=1024, f=14336)
SMOKE = dict(layers=4, d=64, q=64, kv=32, f=128)
NAMES = ("wq", "wk", "wv", "wo", "wg", "wu", "wd")


def _shapes(s: dict[str, int]) -> dict[str, tuple[int, int]]:
    d, q, kv, f = s["d"], s["q"], s["kv"], s["f"]
    return dict(wq=(d, q), wk=(d, kv), wv=(d, kv), wo=(q, d), wg=(d, f), wu=(d, f), wd=(f, d))


def _layer(w: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """x [B, D] through one layer's matmuls (attention left out: no weights); fused
    `wqkv` / `wgu` where the layer has them (_fuse)."""
    if "wqkv" in w:
        q, k, v = jnp.split(x @ w["wqkv"], [w["wo"].shape[0], w["wo"].shape[0] +
                                            (w["wqkv"].shape[1] - w["wo"].shape[0]) // 2], -1)
    else:
        q = x @ w["wq"]
        k, v = x @ w["wk"], x @ w["wv"]
    # k and v feed the output so XLA keeps their reads; q stands in for attention's output.
    h = x + (q + jnp.tile(k + v, q.shape[1] // k.shape[1])) @ w["wo"]
    if "wgu" in w:
        g, u = jnp.split(h @ w["wgu"], 2, -1)
    else:
        g, u = h @ w["wg"], h @ w["wu"]
    return h + (jax.nn.silu(g) * u) @ w["wd"]


def _fuse(per_layer: list[dict[str, jax.Array]]) -> list[dict[str, jax.Array]]:
    """Each layer's q|k|v and gate|up as one matrix (models.layers.fuse_projections)."""
    return jax.jit(lambda pl: [dict(wqkv=jnp.concatenate([w["wq"], w["wk"], w["wv"]], -1),
                                    wo=w["wo"], wgu=jnp.concatenate([w["wg"], w["wu"]], -1),
                                    wd=w["wd"]) for w in pl])(per_layer)


def _stacked(stack: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    n = stack["wq"].shape[0]

    def body(h, layer):
        w = {k: lax.dynamic_index_in_dim(a, layer, keepdims=False) for k, a in stack.items()}
        return _layer(w, h), None
    return lax.scan(body, x, jnp.arange(n, dtype=jnp.int32))[0]


def _switch(per_layer: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    fns = [functools.partial(_layer, w) for w in per_layer]

    def body(h, layer):
        return lax.switch(layer, fns, h), None
    return lax.scan(body, x, jnp.arange(len(per_layer), dtype=jnp.int32))[0]


def _unrolled(per_layer: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for w in per_layer:
        x = _layer(w, x)
    return x


def _weights(s: dict[str, int], dtype) -> tuple[dict, list[dict]]:
    """The stack [L, ...] and the same values as one buffer per layer, drawn on the device."""
    shapes = _shapes(s)
    @jax.jit
    def draw(key):
        keys = jax.random.split(key, len(NAMES))
        return {n: (0.02 * jax.random.normal(keys[i], (s["layers"], *shapes[n]))).astype(dtype)
                for i, n in enumerate(NAMES)}
    stack = draw(jax.random.key(0))
    per_layer = jax.jit(lambda st: [{n: a[i] for n, a in st.items()}
                                    for i in range(s["layers"])])(stack)
    return stack, per_layer


def main(argv: list[str]) -> None:
    del argv
    s = SMOKE if FLAGS.smoke else FULL
    dtype = jnp.float32 if FLAGS.smoke else jnp.bfloat16
    dev = jax.devices()[0]
    results: dict[str, Any] = dict(
        script="bench_layer_weights", command=" ".join(sys.argv),
        env=dict(jax=jax.__version__, backend=jax.default_backend(), device=dev.device_kind,
                 smoke=FLAGS.smoke), shapes=s, dtype=jnp.dtype(dtype).name,
        peak_hbm_tbps=FLAGS.peak_hbm_tbps, points=[], errors=[])
    out = Path(FLAGS.out)
    stack, per_layer = _weights(s, dtype)
    weight_bytes = sum(a.nbytes for a in stack.values())
    results["weight_bytes"] = weight_bytes
    variants = {"stacked": (jax.jit(_stacked), stack),
                "switch": (jax.jit(_switch), per_layer),
                "switch_fused": (jax.jit(_switch), _fuse(per_layer)),
                "unrolled": (jax.jit(_unrolled), per_layer)}
    for b in map(int, FLAGS.batches):
        x = jax.random.normal(jax.random.key(b), (b, s["d"]), dtype)
        live, point, first = {}, dict(batch=b), None
        for name, (fn, w) in variants.items():
            try:
                t0 = time.perf_counter()
                got = jax.block_until_ready(fn(w, x)).astype(jnp.float32)  # compile, warm
                point[f"{name}_first_call_s"] = time.perf_counter() - t0
                live[name] = (fn, w)
                if first is None:
                    first = got
                else:  # the same function of x: a variant that computes less is caught
                    point[f"{name}_max_abs_diff"] = float(jnp.max(jnp.abs(got - first)))
            except Exception as e:  # one variant failing must not hide the others
                results["errors"].append(dict(batch=b, variant=name, error=repr(e)[:2000],
                                              traceback=traceback.format_exc()))
                print(f"B={b} {name}: ERROR {e!r}"[:2000], flush=True)
        times: dict[str, list[float]] = {n: [] for n in live}
        for _ in range(FLAGS.iters):
            for name, (fn, w) in live.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(w, x))
                times[name].append(time.perf_counter() - t0)
        for name, t in times.items():
            sec = float(np.median(t))
            point[f"{name}_s"] = sec
            point[f"{name}_gbps"] = weight_bytes / sec / 1e9
            point[f"{name}_frac_of_nominal"] = weight_bytes / sec / (FLAGS.peak_hbm_tbps * 1e12)
        results["points"].append(point)
        print(f"B={b}: " + ", ".join(f"{n} {point[f'{n}_s'] * 1e3:.2f} ms "
                                     f"({point[f'{n}_gbps']:.0f} GB/s)" for n in times),
              flush=True)
        out.write_text(json.dumps(results, indent=1))  # a run cut short keeps its points
    out.write_text(json.dumps(results, indent=1))
    sys.exit(1 if results["errors"] else 0)


if __name__ == "__main__":
    app.run(main)
