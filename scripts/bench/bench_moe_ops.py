"""Per-op latency of one MoE layer (models/moe.py) at EP=1 and EP=N, side by side.

    .venv/bin/python scripts/bench/bench_moe_ops.py --out_dir=bench_out
    .venv/bin/python scripts/bench/bench_moe_ops.py --eps=1,4 --tokens=8,64,512 --iters=20

The layer is the tiny-moe preset's layer 0 (or --model: any HF MoE folder), on random
tokens. Each stage is its own jitted program (under shard_map over `ep` when EP > 1), fed
the previous stage's outputs, so its time is that stage alone:
  dispatch  route (router matmul, softmax top-k) and pack the per-peer send buffers;
  exchange  the dispatch all_to_all (tokens and expert ids to their experts' owners);
  experts   the local experts' SwiGLU over the received pairs (sorted, ragged_dot);
  combine   the return all_to_all and the weighted sum back into token order;
  layer     the whole MoE MLP in one program (moe.MoeMlp), as the model runs it.
On one CPU the EP=N "devices" are threads of one process sharing 2 cores: the exchange is
a memory copy and every rank competes for the same cores, so EP=N here measures the
overhead of the dispatch machinery, not a speed-up. The per-op split is what the two-batch
overlap cost model takes (docs/tbo.md); interconnect times come from published bandwidths.
Writes bench_moe_ops.json (and a PNG with the `bench` extra) to --out_dir.
"""

from __future__ import annotations

import os

# The EP mesh needs several devices; on a CPU host they are fakes (before jax loads).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import functools  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import bench_common as bc  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from jax import shard_map  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from models import moe, registry  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from runtime import checkpoint  # noqa: E402
from runtime.sharding import make_mesh  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "bench_out", "where the JSON (and PNG) go")
flags.DEFINE_string("model", "tiny-moe", "a models/registry.py preset or an HF MoE folder")
flags.DEFINE_list("eps", ["1", "4"], "expert-parallel sizes to compare")
flags.DEFINE_list("tokens", ["8", "64", "512"], "tokens in the layer (decode rows or prefill)")
flags.DEFINE_integer("iters", 20, "timed calls per stage")
flags.DEFINE_integer("warmup", 3, "untimed calls per stage first")
flags.DEFINE_bool("smoke", False, "one small token count, few calls (CI)")
flags.DEFINE_string("compilation_cache_dir", "~/.cache/xlaserve/jax", "see ServerArgs; '' off")

STAGES = ("dispatch", "exchange", "experts", "combine", "layer")
_E = P(moe.EP_AXIS)


def _stages(cfg: ModelConfig, lp: dict, ep: int) -> dict[str, Callable]:
    """Each stage as a jitted program over rank-stacked arrays ([ep * R, ...] globally)."""
    n_local = cfg.num_experts // ep
    axis = moe.EP_AXIS if ep > 1 else None
    lp_specs = {k: _E if k in moe.EXPERT_KEYS else P() for k in lp}

    def dispatch(lp, x):
        w, ids = moe.route(x, lp["router"], cfg)
        send_x, send_e, where = moe.dispatch(x, ids, ep, n_local)
        return send_x, send_e, where.dest, where.slot, w

    def exchange(send_x, send_e):
        return moe.exchange(send_x, axis), moe.exchange(send_e, axis)

    def combine(ys, dest, slot, w):
        return moe.combine(moe.exchange(ys, axis), moe.Dispatch(dest=dest, slot=slot), w)

    fns = {"dispatch": (dispatch, (lp_specs, _E), (_E,) * 5),
           "exchange": (exchange, (_E, _E), (_E, _E)),
           "experts": (lambda rx, re, lp: moe.experts(rx, re, lp), (_E, _E, lp_specs), _E),
           "combine": (combine, (_E,) * 4, _E)}
    mesh = make_mesh(ep=ep) if ep > 1 else None
    out = {name: jax.jit(f if mesh is None else shard_map(f, mesh=mesh, in_specs=i,
                                                          out_specs=o))
           for name, (f, i, o) in fns.items()}
    out["layer"] = jax.jit(moe.MoeMlp(cfg, mesh))
    return out


def _time_stages(cfg: ModelConfig, lp: dict, x: jax.Array, ep: int, iters: int,
                 warmup: int) -> dict[str, Any]:
    f = _stages(cfg, lp, ep)
    send_x, send_e, dest, slot, w = f["dispatch"](lp, x)
    recv_x, recv_e = f["exchange"](send_x, send_e)
    ys = f["experts"](recv_x, recv_e, lp)
    calls = {"dispatch": functools.partial(f["dispatch"], lp, x),
             "exchange": functools.partial(f["exchange"], send_x, send_e),
             "experts": functools.partial(f["experts"], recv_x, recv_e, lp),
             "combine": functools.partial(f["combine"], ys, dest, slot, w),
             "layer": functools.partial(f["layer"], lp, x)}
    out = {}
    for name in STAGES:
        secs = bc.time_calls(lambda c=calls[name]: jax.block_until_ready(c()), iters, warmup)
        out[name] = bc.summarize(secs)
    out["buffer_pairs_per_rank"] = int(send_x.shape[0] * send_x.shape[1] // ep)
    return out


def _load() -> tuple[ModelConfig, dict]:
    if FLAGS.model in registry.PRESETS:
        return registry.load_preset(FLAGS.model)
    return checkpoint.load_hf_safetensors(FLAGS.model)


def _plot(records: list[dict[str, Any]]) -> None:
    plt = bc.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"T={r['tokens']} EP={r['ep']}" for r in records]
    bottom = [0.0] * len(records)
    for stage in STAGES[:-1]:
        ms = [r["stages"][stage]["median_s"] * 1e3 for r in records]
        ax.bar(labels, ms, bottom=bottom, label=stage)
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    ax.set_ylabel("median ms (stages run apart)")
    ax.legend()
    bc.save_figure(fig, FLAGS.out_dir, "bench_moe_ops.png")


def main(argv: list[str]) -> None:
    del argv
    machine = bc.machine_info()
    bc.enable_compilation_cache(FLAGS.compilation_cache_dir)
    iters, warmup = (2, 1) if FLAGS.smoke else (FLAGS.iters, FLAGS.warmup)
    tokens = [8] if FLAGS.smoke else [int(v) for v in FLAGS.tokens]
    cfg, params = _load()
    lp = jax.tree.map(lambda w: jnp.asarray(w[0], jnp.float32), params["layers"])
    eps = [int(e) for e in FLAGS.eps]
    records = []
    for t in tokens:
        x = jax.random.normal(jax.random.key(t), (-(-t // max(eps)) * max(eps), cfg.hidden_size))
        for ep in eps:  # side by side per token count
            rec = {"tokens": t, "ep": ep, "stages": _time_stages(cfg, lp, x, ep, iters, warmup)}
            records.append(rec)
            bc.log(f"T={t:5d} EP={ep}: " + "  ".join(
                f"{s} {rec['stages'][s]['median_s'] * 1e3:7.3f} ms" for s in STAGES))
    machine["load_average_end"] = bc.load_average()
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    bc.write_json(FLAGS.out_dir, "bench_moe_ops.json", {
        "script": "bench_moe_ops", "command": bc.command_line(), "machine": machine,
        "model": FLAGS.model, "config": cfg, "iters": iters, "warmup": warmup,
        "points": records})
    _plot(records)


if __name__ == "__main__":
    app.run(main)
