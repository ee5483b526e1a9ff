"""Time of the CPU paged attention kernels (cpu_kernels) at one model's head shapes: decode
rows and prefill (extend) prompts, f32 and bf16 pages.

    nice -n 19 .venv/bin/python scripts/bench/bench_cpu_attention.py --out_dir=bench_out/cpu_attn
    .venv/bin/python scripts/bench/bench_cpu_attention.py --decode=32:256 --extend=2048 --iters=20

Each timed call is one jitted program that runs the kernel over every layer of the pool in
turn (a fori_loop, each layer's output the next layer's query), as a forward does: each
layer's K/V pages are memory no other layer reads. Decode points are B rows with C cached
tokens each, their pages scattered over the pool (--scatter_pages) or consecutive; extend
points are one prompt of T tokens from position 0 (its keys are this step's K/V). Per
point: the median per call over --iters, the K/V bytes read per second (decode) and the
attention GFLOP/s (extend: causal QK^T and PV, 4 * Dh FLOPs per query-key pair and head).
Writes bench_cpu_attention.json (and a PNG with the `bench` extra).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax

import cpu_kernels

FLAGS = flags.FLAGS
bc.define_run_flags("bench_out/cpu_attention", "tiny shapes, few iterations (CI)")
flags.DEFINE_list("decode", ["1:192", "32:192", "32:1024"], "decode points, ROWS:CONTEXT")
flags.DEFINE_list("extend", ["512", "2048"], "extend points: prompt tokens (one row)")
flags.DEFINE_list("kv_dtypes", ["float32", "bfloat16"], "pool dtypes")
flags.DEFINE_integer("layers", 30, "layers of the pool, all read by each call")
bc.define_head_flags()
flags.DEFINE_integer("page_size", 16, "tokens per page")
flags.DEFINE_bool("scatter_pages", True, "decode rows' pages in random pool order")
flags.DEFINE_integer("iters", 20, "timed calls per point (after 2 untimed)")


def _layers_loop(kernel: Any) -> Any:
    """jit(q, *args) -> the kernel over every layer, each output the next query."""
    def f(q: jax.Array, *args: jax.Array) -> jax.Array:
        return lax.fori_loop(0, FLAGS.layers, lambda l, x: kernel(x, l, *args), q)
    return jax.jit(f)


def _median_ms(fn: Any, args: tuple) -> float:
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    secs = []
    for _ in range(FLAGS.iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        secs.append(time.perf_counter() - t0)
    return bc.median(secs) * 1e3


def _pools(n_pages: int, dtype: str, rng: np.random.Generator) -> list[jax.Array]:
    shape = (FLAGS.layers, FLAGS.kv_heads, n_pages, FLAGS.page_size, FLAGS.head_dim)
    return [jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in "kv"]


def _decode(rows: int, ctx: int, dtype: str, rng: np.random.Generator) -> dict[str, Any]:
    hq, hkv, dh, s = FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim, FLAGS.page_size
    per_row = -(-ctx // s)
    n_pages = rows * per_row + 1  # page 0 unused, as the engine keeps it
    order = rng.permutation(n_pages - 1) if FLAGS.scatter_pages else np.arange(n_pages - 1)
    table = jnp.asarray(order.reshape(rows, per_row) + 1, jnp.int32)
    k_pool, v_pool = _pools(n_pages, dtype, rng)
    q = jnp.asarray(rng.standard_normal((rows, hq, dh), np.float32))
    kv_new = jnp.asarray(rng.standard_normal((rows, hkv, dh), np.float32), dtype)
    lens = jnp.full((rows,), ctx + 1, jnp.int32)  # ctx cached, plus the row's own key
    kernel = functools.partial(cpu_kernels.decode_attention, sm_scale=dh ** -0.5)
    fn = _layers_loop(lambda x, l, *a: kernel(x, *a[:4], l, *a[4:]))
    ms = _median_ms(fn, (q, kv_new, kv_new, k_pool, v_pool, table, lens))
    kv_bytes = 2 * rows * ctx * hkv * dh * jnp.dtype(dtype).itemsize * FLAGS.layers
    return {"mode": "decode", "rows": rows, "context": ctx, "kv_dtype": dtype, "median_ms": ms,
            "kv_gb_s": kv_bytes / ms / 1e6}


def _extend(tokens: int, dtype: str, rng: np.random.Generator) -> dict[str, Any]:
    hq, hkv, dh = FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim
    k_pool, v_pool = _pools(2, dtype, rng)
    q = jnp.asarray(rng.standard_normal((tokens, hq, dh), np.float32))
    kv_new = jnp.asarray(rng.standard_normal((tokens, hkv, dh), np.float32), dtype)
    table = jnp.zeros((1, 0), jnp.int32)  # a fresh prompt: no cached prefix
    starts = jnp.asarray([0, tokens], jnp.int32)
    positions = jnp.arange(tokens, dtype=jnp.int32)
    kernel = functools.partial(cpu_kernels.extend_attention, sm_scale=dh ** -0.5)
    fn = _layers_loop(lambda x, l, *a: kernel(x, *a[:4], l, *a[4:]))
    ms = _median_ms(fn, (q, kv_new, kv_new, k_pool, v_pool, table, starts, positions))
    pairs = tokens * (tokens + 1) // 2  # causal query-key pairs
    flops = 4 * dh * pairs * hq * FLAGS.layers
    return {"mode": "extend", "tokens": tokens, "kv_dtype": dtype, "median_ms": ms,
            "gflop_s": flops / ms / 1e6}


def _plot(records: list[dict[str, Any]]) -> None:
    plt = bc.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"decode {r['rows']}x{r['context']}" if r["mode"] == "decode"
              else f"extend {r['tokens']}" for r in records if r["kv_dtype"] == FLAGS.kv_dtypes[0]]
    ms = {dtype: [r["median_ms"] for r in records if r["kv_dtype"] == dtype]
          for dtype in FLAGS.kv_dtypes}
    bc.grouped_bars(ax, labels, ms, f"ms per call ({FLAGS.layers} layers, median)")
    bc.save_figure(fig, FLAGS.out_dir, "bench_cpu_attention.png")


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.smoke:
        bc.set_flags(dict(decode=["2:40"], extend=["70"], layers=2, heads=4, kv_heads=2,
                          iters=2))
    bc.enable_compilation_cache(FLAGS.compilation_cache_dir)
    machine = bc.machine_info()
    rng = np.random.default_rng(0)
    records = []
    for dtype in FLAGS.kv_dtypes:
        for point in FLAGS.decode:
            rows, ctx = (int(x) for x in point.split(":"))
            records.append(_decode(rows, ctx, dtype, rng))
            bc.log(f"decode {rows}x{ctx} {dtype}: {records[-1]['median_ms']:.2f} ms, "
                   f"{records[-1]['kv_gb_s']:.1f} GB/s of K/V")
        for tokens in (int(t) for t in FLAGS.extend):
            records.append(_extend(tokens, dtype, rng))
            bc.log(f"extend {tokens} {dtype}: {records[-1]['median_ms']:.1f} ms, "
                   f"{records[-1]['gflop_s']:.1f} GFLOP/s")
    result = {"script": "bench_cpu_attention", "command": bc.command_line(),
              "git_revision": bc.git_revision(), "machine": machine,
              "machine_load_average_end": bc.load_average(),
              "shape": {"layers": FLAGS.layers, "heads": FLAGS.heads, "kv_heads": FLAGS.kv_heads,
                        "head_dim": FLAGS.head_dim, "page_size": FLAGS.page_size},
              "records": records}
    bc.write_json(FLAGS.out_dir, "bench_cpu_attention.json", result)
    _plot(records)


if __name__ == "__main__":
    app.run(main)
