"""Per-op time of the CPU packed matmul (cpu_kernels) at one decoder's exact shapes, f32
and bf16 side by side: the matmuls of a decode step, by shape.

    nice -n 19 .venv/bin/python scripts/bench/bench_cpu_matmul.py --out_dir=bench_out/cpu_matmul
    nice -n 19 .venv/bin/python scripts/bench/bench_cpu_matmul.py --rows=1,32 --rounds=21

The shapes are llama.pack_for_cpu's fused calls of SmolLM2-135M by default (--hidden etc.
for another model): qkv [D, (Hq + 2 Hkv) Dh], wo [Hq Dh, D], gate_up [D, 2 F], down [F, D],
and lm_head [D, V]. Each timed call is one jitted program that multiplies --layers
distinct weights of the shape in turn, each input depending on the last output, as a
decode step does: the weights come from memory, not cache, and XLA cannot run the calls
concurrently. Contenders: f32, weight-only int8 (`int8`, cpu_kernels.pack_int8), bf16
with the weights widened to f32 (`bf16`), bf16 `vdpbf16ps` (`bf16_dot`) and bf16 on AMX
tiles (`bf16_amx`), each where the CPU has it (cpu_kernels.bf16_targets; by default every
one it has), the same bf16 weights compressed to 12 bits (cpu_kernels.pack_x12) decoded
into the widening (`x12`) or the `vdpbf16ps` products (`x12_dot`); and, when asked for, the peer
PyTorch runs on the same shapes: `torch_f32` / `torch_bf16`, torch.nn.functional.linear
(oneDNN, on every CPU thread; bf16 through AMX where the CPU has it) over the same chain
of distinct weights (the `reference` extra). The JSON names
the bf16 kernel that serves here (cpu_kernels.bf16_kernel). Each round times every
contender once in turn; the table gives medians over rounds, the weight bytes read per us
(GB/s) and GFLOP/s. Writes bench_cpu_matmul.json (and a PNG with the `bench` extra).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
from collections.abc import Callable
from typing import Any

import bench_common as bc
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import cpu_kernels

FLAGS = flags.FLAGS
bc.define_run_flags("bench_out/cpu_matmul", "tiny shapes, few rounds (CI)")
flags.DEFINE_list("rows", ["1", "32"], "M: rows of x (decode batch sizes)")
flags.DEFINE_list("ops", ["qkv", "wo", "gate_up", "down", "lm_head"], "which shapes")
flags.DEFINE_list("contenders", [], "f32, int8, bf16 (widening), bf16_dot, bf16_amx, x12, "
                  "x12_dot, torch_f32, torch_bf16; default: f32, int8 and every bf16 and "
                  "12-bit kernel this CPU runs")
flags.DEFINE_integer("rounds", 15, "timed rounds (each times every contender once)")
flags.DEFINE_integer("layers", 30, "distinct weights per call (lm_head: --head_copies)")
flags.DEFINE_integer("head_copies", 3, "distinct lm_head weights per call")
flags.DEFINE_integer("hidden", 576, "D")
flags.DEFINE_integer("intermediate", 1536, "F")
bc.define_head_flags()
flags.DEFINE_integer("vocab", 49152, "V")


def _shapes() -> dict[str, tuple[int, int]]:
    """op -> (K, N) of the fused packed weights."""
    d, f, dh = FLAGS.hidden, FLAGS.intermediate, FLAGS.head_dim
    return {"qkv": (d, (FLAGS.heads + 2 * FLAGS.kv_heads) * dh), "wo": (FLAGS.heads * dh, d),
            "gate_up": (d, 2 * f), "down": (f, d), "lm_head": (d, FLAGS.vocab)}


def _chain(m: int, k: int, n: int, target: str | None) -> Callable:
    """jit(x [M, K], weights) -> x after one matmul per weight, each feeding the next."""
    def f(x: jax.Array, weights: list[cpu_kernels.PackedWeight]) -> jax.Array:
        for w in weights:
            y = cpu_kernels.packed_matmul(x, w, target=target)  # [M, N]
            x = x + 1e-3 * jnp.tile(y, (1, -(-k // n)))[:, :k]  # [M, K]
        return x
    return jax.jit(f)


def _torch_chain(k: int, weights: list[np.ndarray], dtype: str) -> Callable[[], None]:
    """The peer's chain: torch.nn.functional.linear over the same weights ([N, K], as
    torch stores them) in `dtype`, each input depending on the last output."""
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    ws = [torch.from_numpy(np.ascontiguousarray(w.T)).to(dt) for w in weights]

    def run(x: np.ndarray) -> None:
        with torch.inference_mode():
            h = torch.from_numpy(x).to(dt)  # [M, K]
            for w in ws:
                y = torch.nn.functional.linear(h, w)  # [M, N]
                h = h + 1e-3 * y.tile((1, -(-k // y.shape[1])))[:, :k]
    return run


def _run_ours(chain: Callable, x: jax.Array, weights: list[cpu_kernels.PackedWeight]) -> None:
    chain(x, weights).block_until_ready()


def _time_op(op: str, k: int, n: int, rows: list[int], rng: np.random.Generator
             ) -> list[dict[str, Any]]:
    copies = FLAGS.head_copies if op == "lm_head" else FLAGS.layers
    w32 = [rng.standard_normal((k, n), np.float32) * 0.05 for _ in range(copies)]
    names = _contenders()
    packed = {"f32": [cpu_kernels.pack(jnp.asarray(w)) for w in w32],
              "int8": [cpu_kernels.pack_int8(jnp.asarray(w)) for w in w32]}
    targets = _targets()
    w16 = [cpu_kernels.pack(jnp.asarray(w, jnp.bfloat16)) for w in w32]
    if any(c.startswith("x12") for c in names):
        packed["x12"] = [cpu_kernels.pack_x12(jnp.asarray(w, jnp.bfloat16)) for w in w32]
    packed.update({c: packed["x12"] if c.startswith("x12") else w16
                   for c in targets if c not in packed and c in names})
    torch_runs = {c: _torch_chain(k, w32, c.removeprefix("torch_"))
                  for c in names if c.startswith("torch_")}
    out = []
    for m in rows:
        x = rng.standard_normal((m, k), np.float32)
        xj = jnp.asarray(x)
        fns: dict[str, Callable[[], Any]] = {}
        for c in names:
            if c in torch_runs:
                fns[c] = functools.partial(torch_runs[c], x)
            else:
                fns[c] = functools.partial(_run_ours, _chain(m, k, n, targets[c]), xj,
                                           packed[c])
        for fn in fns.values():  # compile and fault the weights in
            fn()
        secs: dict[str, list[float]] = {c: [] for c in fns}
        for _ in range(FLAGS.rounds):
            for c, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                secs[c].append((time.perf_counter() - t0) / copies)
        for c, s in secs.items():
            med = bc.median(s)
            nbytes = int(k * n * (4 if c.endswith("f32") else 1 if c == "int8"
                                  else 1.5 if c.startswith("x12") else 2))
            out.append({"op": op, "k": k, "n": n, "rows": m, "contender": c,
                        "median_us": med * 1e6, "weight_gb_s": nbytes / med / 1e9,
                        "gflop_s": 2 * m * k * n / med / 1e9, "us_per_round": [v * 1e6 for v in s]})
            bc.log(f"{op:8s} M={m:3d} {c:9s} {med * 1e6:9.1f} us  {nbytes / med / 1e9:5.1f} GB/s"
                   f"  {2 * m * k * n / med / 1e9:6.1f} GFLOP/s")
    return out


def _targets() -> dict[str, str | None]:
    """Contender -> the packed_matmul target it runs (None: the weights' dtype picks it)."""
    bf16 = cpu_kernels.bf16_targets()
    x12 = cpu_kernels.x12_targets()
    return {"f32": None, "int8": None, "bf16": bf16["widen"],
            **{f"bf16_{n}": t for n, t in bf16.items() if n != "widen"},
            **{"x12" if n == "widen" else f"x12_{n}": t for n, t in x12.items()}}


def _contenders() -> list[str]:
    """--contenders, checked against what this CPU and install run; by default every
    kernel of ours (the PyTorch peer only when asked for)."""
    ours = list(_targets())
    have = ours + (["torch_f32", "torch_bf16"] if importlib.util.find_spec("torch") else [])
    missing = [c for c in FLAGS.contenders if c not in have]
    if missing:
        raise app.UsageError(f"--contenders {missing}: this CPU and install run {have} "
                             "(torch_*: pip install -e '.[reference]')")
    return FLAGS.contenders or ours


def _plot(records: list[dict[str, Any]]) -> None:
    plt = bc.pyplot()
    if plt is None:
        return
    rows = sorted({r["rows"] for r in records})
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, m in zip(axes[0], rows, strict=True):
        ops = [o for o in FLAGS.ops if any(r["op"] == o and r["rows"] == m for r in records)]
        us = {c: [next(r["median_us"] for r in records
                       if r["op"] == o and r["rows"] == m and r["contender"] == c) for o in ops]
              for c in _contenders()}
        bc.grouped_bars(ax, ops, us, "us per call (median)")
        ax.set_title(f"M = {m}")
    bc.save_figure(fig, FLAGS.out_dir, "bench_cpu_matmul.png")


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.smoke:
        bc.set_flags(dict(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16,
                          vocab=256, layers=2, head_copies=1, rounds=2))
    bc.enable_compilation_cache(FLAGS.compilation_cache_dir)
    machine = bc.machine_info()
    rng = np.random.default_rng(0)
    rows = [int(r) for r in FLAGS.rows]
    shapes = _shapes()
    records = [r for op in FLAGS.ops for r in _time_op(op, *shapes[op], rows, rng)]
    result = {"script": "bench_cpu_matmul", "command": bc.command_line(),
              "git_revision": bc.git_revision(), "machine": machine,
              "machine_load_average_end": bc.load_average(), "shapes": shapes,
              "bf16_serving_kernel": cpu_kernels.bf16_kernel(), "records": records}
    bc.write_json(FLAGS.out_dir, "bench_cpu_matmul.json", result)
    _plot(records)


if __name__ == "__main__":
    app.run(main)
