"""Benchmark the Pallas ragged paged attention kernels on one device; write JSON.

On the GPU (H200 defaults; no network needed, a few minutes):

    .venv/bin/python scripts/bench/bench_kernels.py --out=bench_kernels.json

On the CPU, tiny sizes and interpret mode, to check the script end to end:

    .venv/bin/python scripts/bench/bench_kernels.py --smoke --out=/tmp/bench_kernels_smoke.json

Sections (--sections picks them), each recorded even when another fails (a failure is
an entry in "errors"), the JSON rewritten after each one so a run cut short keeps them:
  correctness  the kernels against paged_attention_ref on this device: decode, extend
               (on cached prefixes) and mixed batches, the mixed one also with sliding
               window and soft cap; bf16 -> Mosaic GPU, f32 -> Triton; and the GPU MoE
               path's grouped expert matmul (pallas_kernels/grouped_matmul.py)
  roofline     a measured copy bandwidth next to the nominal --peak_hbm_tbps
  decode       achieved HBM bandwidth of decode attention at long context, side by side
               with the XLA reference (paged gather) and jax.nn.dot_product_attention
               on the same K/V laid out densely
  prefill      TFLOP/s of causal extend attention, same three contenders
  kv_write     models.kv_pool.write_kv against the pool size (in place or copying?)
  sweep        Mosaic block_kv x num_slots, and num_splits, on two decode shapes
Every timing loops over the pool's layers inside one jit, so each call reads distinct
memory (no L2 reuse) and dispatch costs are amortized; contenders alternate A B A B and
medians are reported.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models.kv_pool import KVPool, write_kv  # noqa: E402
from pallas_kernels import grouped_matmul  # noqa: E402
from pallas_kernels.ragged_paged_attention import (  # noqa: E402
    paged_attention,
    paged_attention_ref,
)
from runtime.batch_builder import BucketShape, pack_rows  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_kernels.json", "JSON results path")
flags.DEFINE_bool("smoke", False, "tiny sizes in interpret mode (CPU check of this script)")
flags.DEFINE_float("peak_hbm_tbps", 4.8, "nominal HBM bandwidth, TB/s (H200: 4.8)")
flags.DEFINE_float("peak_bf16_tflops", 989.0, "nominal dense bf16 TFLOP/s (H200: 989)")
flags.DEFINE_list("models", ["smollm2", "llama8b"], "head layouts to run")
flags.DEFINE_list("decode_batches", ["8", "64"], "decode batch sizes")
flags.DEFINE_list("decode_contexts", ["8192", "32768"], "decode context lengths")
flags.DEFINE_integer("prefill_rows", 2, "extend rows in the prefill benchmark")
flags.DEFINE_integer("prefill_tokens", 2048, "new tokens per extend row")
flags.DEFINE_integer("page_size", 16, "KV page size")
flags.DEFINE_integer("iters", 10, "timed calls per contender")
flags.DEFINE_float("target_gb_per_call", 4.0, "layers per timed call are chosen to read ~this")
flags.DEFINE_bool("sweep", True, "sweep the Mosaic kernel's block_kv and num_slots")
flags.DEFINE_list("sections", ["correctness", "roofline", "decode", "prefill", "kv_write"],
                  "sections to run (sweep: --sweep)")

# (query heads, KV heads, head_dim)
HEADS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}


@dataclasses.dataclass
class _Row:
    input_ids: list[int]
    start_pos: int
    pages: list[int]


def _interpret() -> bool:
    return FLAGS.smoke or jax.default_backend() == "cpu"


def _batch(extend, decode, page_size, pages_per_seq, rng):
    """extend: (new, prefix) per row; decode: seq_len per row (0: a padding row). Pages
    are a random permutation of 1.. (page 0 is padding), so rows scatter through the pool.
    The page table lists the pages of each row's earlier context."""
    specs = list(extend) + [(1, n - 1) for n in decode if n > 0]
    need = [-(-(p + n) // page_size) for n, p in specs]
    perm = rng.permutation(np.arange(1, sum(need) + 1)).tolist()
    rows = []
    for n_pages, (n, prefix) in zip(need, specs, strict=True):
        pages, perm = perm[:n_pages], perm[n_pages:]
        rows.append(_Row([0] * n, prefix, pages))
    te, be = sum(n for n, _ in extend), len(extend)
    shape = BucketShape(te, be, len(decode), pages_per_seq)
    arrays = pack_rows(rows[:be], rows[be:], shape, page_size)
    table = np.zeros_like(arrays["page_table"])
    for i, r in zip([*range(be), *range(be, be + len(rows) - be)], rows, strict=True):
        n = -(-r.start_pos // page_size)
        table[i, :n] = r.pages[:n]
    arrays["page_table"] = table
    meta = {k: jnp.asarray(arrays[k]) for k in ("page_table", "seq_lens", "query_start",
                                                "positions")}
    return meta, te, be, sum(need) + 1


def _pools(key, layers, num_pages, page_size, hkv, dh, dtype):
    shape = (layers, hkv, num_pages, page_size, dh)  # models.kv_pool layout
    k1, k2 = jax.random.split(key)
    make = jax.jit(lambda k: jax.random.normal(k, shape, dtype))
    return make(k1), make(k2)


def _attn_fn(kind: str, te: int, be: int, sm_scale: float, **kw):
    """-> attn(q, k_new, v_new, k_pool, v_pool, layer, page_table, seq_lens, query_start,
    positions): the kernels ("pallas", kw may hold their tuning knobs) or the reference."""
    common = dict(num_extend_tokens=te, num_extend_seqs=be, sm_scale=sm_scale,
                  window=kw.pop("window", None), sinks=kw.pop("sinks", None),
                  logit_softcap=kw.pop("logit_softcap", 0.0))
    if kind == "pallas":
        return functools.partial(paged_attention, interpret=_interpret(), **common, **kw)
    return functools.partial(paged_attention_ref, **common)


def _over_layers(attn, layers: int):
    """jit(q, k_new, v_new, k_pool, v_pool, meta) -> sum over layers of attention outputs."""

    def run(q, k_new, v_new, k_pool, v_pool, meta):
        def body(layer, acc):
            o = attn(q, k_new, v_new, k_pool, v_pool, layer, meta["page_table"],
                     meta["seq_lens"], meta["query_start"], meta["positions"])
            return acc + o.astype(jnp.float32)
        return lax.fori_loop(0, layers, body, jnp.zeros(q.shape, jnp.float32))
    return jax.jit(run)


def _new_kv(key, t, hkv, dh, dtype):
    k1, k2 = jax.random.split(key)
    return (jax.random.normal(k1, (t, hkv, dh), dtype), jax.random.normal(k2, (t, hkv, dh),
                                                                          dtype))


def _dense_over_layers(layers: int, causal: bool, implementation):
    """jax.nn.dot_product_attention over dense K/V [L, B, S, Hkv, Dh], q [B, T, Hq, Dh]."""

    def run(q, k, v):
        def body(layer, acc):
            o = jax.nn.dot_product_attention(q, k[layer], v[layer], is_causal=causal,
                                             implementation=implementation)
            return acc + o.astype(jnp.float32)
        return lax.fori_loop(0, layers, body, jnp.zeros(q.shape, jnp.float32))
    return jax.jit(run)


def _dense_attention(layers, causal, q, k, v):
    """The fastest dot_product_attention that compiles here: cuDNN, else XLA."""
    for impl in ("cudnn", "xla"):
        fn = _dense_over_layers(layers, causal, impl)
        try:
            jax.block_until_ready(fn(q, k, v))
            return fn, impl
        except Exception:  # cuDNN rejects some shapes (and is absent on CPU)
            continue
    raise RuntimeError("no dot_product_attention implementation compiled")


def _time_side_by_side(contenders: dict, iters: int,
                       failed: dict[str, str] | None = None) -> dict[str, float]:
    """{name: (fn, args)} -> median seconds per call, calls interleaved A B A B. A
    contender that fails to compile or run is left out and its error put in `failed`
    (when given), so the others are still timed: one GPU run must yield every number it
    can. Without `failed` the error propagates."""
    live = {}
    for name, (fn, args) in contenders.items():
        try:
            jax.block_until_ready(fn(*args))  # compile and warm
        except Exception as e:
            if failed is None:
                raise
            failed[name] = repr(e)[:2000]
            print(f"{name}: ERROR {e!r}"[:2000], flush=True)
            continue
        live[name] = (fn, args)
    times = {name: [] for name in live}
    for _ in range(iters):
        for name, (fn, args) in live.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def _max_err(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _correctness_batches(s: int) -> dict[str, tuple[list, list]]:
    """mode -> (extend rows as (new, prefix), decode seq_lens; 0 is a padding row). Rows
    span several pages and KV blocks, start mid-page and extend on cached prefixes."""
    extend, decode = [(s + 1, 0), (37, 300), (5, s)], [1, s, s + 1, 520, 0]
    if FLAGS.smoke:  # fewer rows and KV blocks: the interpreters walk each one in Python
        extend, decode = [(s + 1, 0), (5, s + 3)], [1, 2 * s + 5, 0]
    return {"decode": ([], decode), "extend": (extend, []), "mixed": (extend, decode)}


# --smoke: each interpreted case costs seconds, so the single-kind batches take one dtype
# each (test_pallas_attention.py covers every combination).
_SMOKE_DTYPES = {"decode": (jnp.float32,), "extend": (jnp.bfloat16,),
                 "mixed": (jnp.bfloat16, jnp.float32)}


def bench_correctness(rng) -> list[dict]:
    hq, hkv, dh = HEADS["smollm2"]
    s = FLAGS.page_size
    out = []
    for mode, (extend, decode) in _correctness_batches(s).items():
        meta, te, be, num_pages = _batch(extend, decode, s, 40, rng)
        t = te + len(decode)
        # The padding decode row: zeros from the kernels, don't-care in the reference.
        real = np.array([True] * te + [n > 0 for n in decode])
        variants = {"window": 100, "logit_softcap": 20.0,
                    "sinks": jnp.linspace(-2.0, 4.0, hq, dtype=jnp.float32)}
        extras = ({}, variants) if mode == "mixed" else ({},)
        extras = extras[:1] if FLAGS.smoke else extras
        for dtype, tol in ((jnp.bfloat16, 2e-2), (jnp.float32, 1e-5 if _interpret() else 1e-4)):
            if FLAGS.smoke and dtype not in _SMOKE_DTYPES[mode]:
                continue
            k_pool, v_pool = _pools(jax.random.key(1), 2, num_pages, s, hkv, dh, dtype)
            k_new, v_new = _new_kv(jax.random.key(3), t, hkv, dh, dtype)
            q = (2 * jax.random.normal(jax.random.key(2), (t, hq, dh))).astype(dtype)
            args = (q, k_new, v_new, k_pool, v_pool, jnp.int32(1), meta["page_table"],
                    meta["seq_lens"], meta["query_start"], meta["positions"])
            for extra in extras:
                t0 = time.perf_counter()
                name, variants = jnp.dtype(dtype).name, sorted(extra)
                try:
                    # The reference at full f32 precision: XLA on a GPU may otherwise use
                    # tf32.
                    with jax.default_matmul_precision("highest"):
                        ref = jax.jit(_attn_fn("ref", te, be, dh ** -0.5, **extra))(*args)
                    got = jax.jit(_attn_fn("pallas", te, be, dh ** -0.5, **extra))(*args)
                    err = _max_err(got[real], ref[real])
                except Exception as e:  # one case failing must not hide the others
                    out.append(dict(mode=mode, dtype=name, variants=variants, ok=False,
                                    error=repr(e)[:2000], traceback=traceback.format_exc()))
                    print(f"correctness {mode} {name} {variants}: ERROR {e!r}"[:2000], flush=True)
                    continue
                secs = time.perf_counter() - t0  # both compiles and runs
                out.append(dict(mode=mode, dtype=name, variants=variants, max_abs_err=err, tol=tol,
                                ok=err < tol, seconds=secs))
                print(f"correctness {mode} {name} {variants}: max err {err:.3g} "
                      f"({'ok' if err < tol else 'FAIL'}, {secs:.1f} s)", flush=True)
    return out


def _grouped(x, w, es, interpret: bool):
    """The GPU MoE path's expert product (models/moe.py): rows tiled by expert, each tile
    through its expert's weights read in place, then back in row order."""
    plan = grouped_matmul.plan_tiles(es, w.shape[0], 16)
    tiles = grouped_matmul.tile_matmul(grouped_matmul.gather_tiles(x, plan), w, plan.expert,
                                       interpret=interpret)
    return grouped_matmul.scatter_tiles(tiles, plan, x.shape[0])


def bench_grouped_correctness(rng) -> list[dict]:
    """The grouped expert matmul against its jnp reference on this device: Qwen3-30B-A3B's
    per-GPU expert shapes under ep=8 (16 experts, [2048, 768]) at 1, 32 and 128 rows routed
    at random, some rows to no expert (--smoke: 5 experts of [64, 32], 1 and 20 rows)."""
    e, k, n, rows = (5, 64, 32, (1, 20)) if FLAGS.smoke else (16, 2048, 768, (1, 32, 128))
    dtypes = ((jnp.float32, 1e-5),) if FLAGS.smoke else ((jnp.bfloat16, 2e-2),
                                                          (jnp.float32, 1e-4))
    run = jax.jit(functools.partial(_grouped, interpret=_interpret()))
    out = []
    for m in rows:
        es = jnp.asarray(rng.integers(0, e + 1, m), jnp.int32)  # e: no expert
        for dtype, tol in dtypes:
            name = jnp.dtype(dtype).name
            x = jnp.asarray(rng.standard_normal((m, k)), dtype)
            w = jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), dtype)
            t0 = time.perf_counter()
            try:
                with jax.default_matmul_precision("highest"):
                    ref = jax.jit(grouped_matmul.grouped_matmul_ref)(x, w, es)
                err = _max_err(run(x, w, es), ref)
            except Exception as ex:  # one case failing must not hide the others
                out.append(dict(mode="grouped_matmul", dtype=name, rows=m, ok=False,
                                error=repr(ex)[:2000], traceback=traceback.format_exc()))
                print(f"correctness grouped_matmul {m} rows {name}: ERROR {ex!r}"[:2000])
                continue
            secs = time.perf_counter() - t0
            out.append(dict(mode="grouped_matmul", dtype=name, rows=m, variants=[],
                            max_abs_err=err, tol=tol, ok=err < tol, seconds=secs))
            print(f"correctness grouped_matmul {m} rows {name}: max err {err:.3g} "
                  f"({'ok' if err < tol else 'FAIL'}, {secs:.1f} s)", flush=True)
    return out


def bench_roofline() -> dict:
    n = (1 << 20) if FLAGS.smoke else int(FLAGS.target_gb_per_call * 2 ** 30) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = _time_side_by_side({"copy": (copy, (x,))}, FLAGS.iters)["copy"]
    tbps = 2 * x.nbytes / t / 1e12  # read + write
    print(f"roofline: measured copy {tbps:.3f} TB/s (nominal {FLAGS.peak_hbm_tbps})")
    return dict(copy_bytes=2 * x.nbytes, seconds=t, measured_tbps=tbps,
                nominal_tbps=FLAGS.peak_hbm_tbps)


def _layers_for(bytes_per_layer: int, cap: int) -> int:
    if FLAGS.smoke:
        return 2
    return int(np.clip(FLAGS.target_gb_per_call * 2 ** 30 // bytes_per_layer, 1, cap))


def bench_decode(model: str, batch: int, context: int, rng, measured_tbps,
                 variants: dict[str, dict] | None = None, page_size: int | None = None
                 ) -> dict:
    """Decode attention's HBM bandwidth at one shape. Without `variants`: the kernels at
    their defaults ("pallas") against the XLA reference and dot_product_attention. With
    `variants` {name: tuning knobs}: those kernel configurations alone, timed side by side
    (interleaved, so a drifting clock or a first-run effect cannot favour one)."""
    hq, hkv, dh = HEADS[model]
    s, dtype = page_size or FLAGS.page_size, jnp.bfloat16
    kv_bytes_per_layer = 2 * batch * context * hkv * dh * 2
    layers = _layers_for(kv_bytes_per_layer, 32)
    meta, _, _, num_pages = _batch([], [context] * batch, s, -(-context // s), rng)
    k_pool, v_pool = _pools(jax.random.key(3), layers, num_pages, s, hkv, dh, dtype)
    q = jax.random.normal(jax.random.key(4), (batch, hq, dh), dtype)
    args = (q, *_new_kv(jax.random.key(5), batch, hkv, dh, dtype), k_pool, v_pool, meta)
    scale = dh ** -0.5
    contenders = {name: (_over_layers(_attn_fn("pallas", 0, 0, scale, **kw), layers), args)
                  for name, kw in (variants or {"pallas": {}}).items()}
    dpa_impl = None
    if not variants:
        contenders["ref"] = (_over_layers(_attn_fn("ref", 0, 0, scale), layers), args)
        # The same K/V, densely laid out per row [L, B, context, Hkv, Dh].
        pt = meta["page_table"]
        dense = jax.jit(lambda p: p[:, :, pt].transpose(0, 2, 3, 4, 1, 5).reshape(
            layers, batch, -1, hkv, dh)[:, :, :context])
        kd, vd = dense(k_pool), dense(v_pool)
        qd = q[:, None]  # [B, 1, Hq, Dh]
        dpa, dpa_impl = _dense_attention(layers, False, qd, kd, vd)
        contenders["dpa"] = (dpa, (qd, kd, vd))
    failed: dict[str, str] = {}
    t = _time_side_by_side(contenders, FLAGS.iters, failed)
    moved = layers * kv_bytes_per_layer
    res = dict(model=model, batch=batch, context=context, layers=layers,
               page_size=s, kv_bytes_per_call=moved, dpa_implementation=dpa_impl,
               failed=failed, variants=variants)
    for name, sec in t.items():
        res[f"{name}_s"] = sec
        res[f"{name}_tbps"] = moved / sec / 1e12
        res[f"{name}_frac_of_nominal"] = res[f"{name}_tbps"] / FLAGS.peak_hbm_tbps
    if "pallas" in t:
        if measured_tbps:
            res["pallas_frac_of_measured_copy"] = res["pallas_tbps"] / measured_tbps
        for other in ("ref", "dpa"):
            if other in t:
                res[f"speedup_vs_{other}"] = t[other] / t["pallas"]
    print(f"decode {model} B={batch} ctx={context} L={layers}: "
          + ", ".join(f"{n} {res[f'{n}_tbps']:.3g} TB/s" for n in t)
          + "".join(f", {n} ERROR" for n in failed))
    return res


def bench_prefill(model: str, rng) -> dict:
    hq, hkv, dh = HEADS[model]
    s, dtype = FLAGS.page_size, jnp.bfloat16
    rows, n = FLAGS.prefill_rows, FLAGS.prefill_tokens
    meta, te, be, num_pages = _batch([(n, 0)] * rows, [], s, -(-n // s), rng)
    layers = 2 if FLAGS.smoke else 4
    k_pool, v_pool = _pools(jax.random.key(5), layers, num_pages, s, hkv, dh, dtype)
    q = jax.random.normal(jax.random.key(6), (te, hq, dh), dtype)
    args = (q, *_new_kv(jax.random.key(7), te, hkv, dh, dtype), k_pool, v_pool, meta)
    scale = dh ** -0.5
    # Dense K/V for dot_product_attention: the same amount of data (its values do not
    # matter for timing), laid out [L, rows, n, Hkv, Dh].
    dense = jax.jit(lambda p: p[:, :, 1:1 + rows * -(-n // s)].transpose(0, 2, 3, 1, 4).reshape(
        layers, rows, -1, hkv, dh)[:, :, :n])
    kd, vd = dense(k_pool), dense(v_pool)
    qd = q.reshape(rows, n, hq, dh)
    dpa, dpa_impl = _dense_attention(layers, True, qd, kd, vd)
    failed: dict[str, str] = {}
    t = _time_side_by_side({
        "pallas": (_over_layers(_attn_fn("pallas", te, be, scale), layers), args),
        "ref": (_over_layers(_attn_fn("ref", te, be, scale), layers), args),
        "dpa": (dpa, (qd, kd, vd)),
    }, FLAGS.iters, failed)
    # QK^T and PV over the causal pairs: 2 matmuls x 2 flops per multiply-add.
    flops = layers * rows * 4 * hq * dh * n * (n + 1) // 2
    res = dict(model=model, rows=rows, tokens_per_row=n, layers=layers,
               page_size=s, flops_per_call=flops, dpa_implementation=dpa_impl, failed=failed)
    for name, sec in t.items():
        res[f"{name}_s"] = sec
        res[f"{name}_tflops"] = flops / sec / 1e12
    if "pallas" in t:
        res["pallas_frac_of_nominal"] = res["pallas_tflops"] / FLAGS.peak_bf16_tflops
        for other in ("ref", "dpa"):
            if other in t:
                res[f"speedup_vs_{other}"] = t[other] / t["pallas"]
    print(f"prefill {model} {rows}x{n}: "
          + ", ".join(f"{k} {res[f'{k}_tflops']:.3g} TFLOP/s" for k in t))
    return res


def bench_kv_write() -> list[dict]:
    """write_kv of one decode step (64 tokens, SmolLM2 heads, 30 layers) into pools of two
    sizes: an in-place update costs the same for both; a copying one grows with the pool."""
    _, hkv, dh = HEADS["smollm2"]
    s, t, n_layers = FLAGS.page_size, 64, 30
    # All layers' K/V [L, T, Hkv, Dh] in one scatter, as the model writes after its layers.
    layers = jnp.arange(n_layers, dtype=jnp.int32)
    k = jnp.ones((n_layers, t, hkv, dh), jnp.bfloat16)
    slots = jnp.arange(t, dtype=jnp.int32) * s + s  # one token in each of pages 1..64
    out = []
    for pages in ((64, 256) if FLAGS.smoke else (1024, 16384)):
        zeros = jax.jit(lambda n=pages: jnp.zeros((n_layers, hkv, n, s, dh), jnp.bfloat16))
        pool = KVPool(zeros(), zeros())
        step = jax.jit(lambda kv, sl, k: write_kv(kv, layers, sl, k, k), donate_argnums=0)
        pool = step(pool, slots, k)  # compile
        times = []
        for _ in range(FLAGS.iters):
            t0 = time.perf_counter()
            pool = jax.block_until_ready(step(pool, slots, k))
            times.append(time.perf_counter() - t0)
        out.append(dict(pool_bytes=2 * pool.k.nbytes, tokens=t, layers=n_layers,
                        seconds=float(np.median(times))))
        print(f"kv_write pool {2 * pool.k.nbytes / 2 ** 30:.2f} GiB: "
              f"{out[-1]['seconds']:.2e} s")
        del pool
    return out


def _sweep_points() -> list[tuple[str, int, int, int | None, dict[str, dict]]]:
    """(model, batch, context, page size (None: --page_size), variants): Mosaic variants,
    each shape's timed side by side with the defaults. A big-batch shape (block_kv x
    num_slots; 128 x 4 needs more than an H200's 227 KiB of SMEM), the same with 64-token
    pages (each TMA copy 16 KiB instead of 4), and a small-batch one (num_splits, whose
    default is a heuristic). In smoke mode, two each. The first H200 sweep timed each
    variant alone, and its first one (64 x 2) read 2.49 TB/s against 1.6-1.75 for the
    rest: side by side says whether that holds."""
    if FLAGS.smoke:
        return [("llama8b", 2, 256, None,
                 {"default": {}, "bk64_s2": dict(block_kv=64, num_slots=2)}),
                ("smollm2", 2, 256, None, {"default": {}, "splits2": dict(num_splits=2)})]
    big = {"default": {}, **{f"bk{bk}_s{n}": dict(block_kv=bk, num_slots=n)
                             for bk, n in ((64, 2), (64, 3), (64, 4), (128, 2), (128, 3))}}
    pages64 = {"default": {}, "bk64_s2": dict(block_kv=64, num_slots=2),
               "bk128_s2": dict(block_kv=128, num_slots=2)}
    small = {"default": {}, **{f"splits{k}": dict(num_splits=k) for k in (1, 4, 8, 16)}}
    return [("llama8b", 64, 8192, None, big), ("llama8b", 64, 8192, 64, pages64),
            ("llama8b", 8, 32768, None, big), ("smollm2", 8, 8192, None, small)]


def main(argv):
    del argv
    if FLAGS.smoke:
        FLAGS.decode_batches, FLAGS.decode_contexts = ["1"], ["64"]
        FLAGS.prefill_rows, FLAGS.prefill_tokens, FLAGS.iters = 1, 16, 1
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    results = dict(env=dict(jax=jax.__version__, backend=jax.default_backend(),
                            device=dev.device_kind, smoke=FLAGS.smoke,
                            interpret=_interpret()),
                   peak=dict(hbm_tbps=FLAGS.peak_hbm_tbps, bf16_tflops=FLAGS.peak_bf16_tflops),
                   correctness=[], decode=[], prefill=[], kv_write=[], sweep=[], errors=[])

    def section(name, fn, *args, **kw):
        try:
            got = fn(*args, **kw)
        except Exception as e:  # keep going: one GPU run should yield every number it can
            results["errors"].append(dict(section=name, error=repr(e),
                                          traceback=traceback.format_exc()))
            print(f"{name}: ERROR {e!r}")
            got = None
        Path(FLAGS.out).write_text(json.dumps(results, indent=1))  # a cut-short run keeps it
        return got

    want = set(FLAGS.sections)
    if "correctness" in want:
        results["correctness"] = section("correctness", bench_correctness, rng) or []
        if grouped_matmul.pltriton is not None:  # the GPU MoE path's kernel, where it exists
            results["correctness"] += section("correctness grouped_matmul",
                                              bench_grouped_correctness, rng) or []
    roof = section("roofline", bench_roofline) if "roofline" in want else None
    results["roofline"] = roof
    measured = roof["measured_tbps"] if roof else None
    for model in FLAGS.models:
        for batch in map(int, FLAGS.decode_batches) if "decode" in want else ():
            for ctx in map(int, FLAGS.decode_contexts):
                r = section(f"decode {model} {batch} {ctx}", bench_decode, model, batch, ctx,
                            rng, measured)
                if r:
                    results["decode"].append(r)
        r = section(f"prefill {model}", bench_prefill, model, rng) if "prefill" in want else None
        if r:
            results["prefill"].append(r)
    if "kv_write" in want:
        results["kv_write"] = section("kv_write", bench_kv_write) or []
    if FLAGS.sweep:
        for model, batch, ctx, page, variants in _sweep_points():
            r = section(f"sweep {model} {batch} {ctx} page {page or FLAGS.page_size}",
                        bench_decode, model, batch, ctx, rng, measured, variants, page)
            if r:
                results["sweep"].append(r)
    Path(FLAGS.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {FLAGS.out}")
    failed = results["errors"] or not all(c["ok"] for c in results["correctness"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    app.run(main)
