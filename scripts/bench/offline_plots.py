"""bench_offline.py's PNG: output tok/s of xlaserve and the peers (transformers' batched
generate, llama-server's variants) at each concurrency, single-stream decode, with the
compute and memory-bandwidth bounds measured in the same run."""

from __future__ import annotations

from typing import Any

import bench_common as bc


def rounds_values(rounds: list[dict[str, Any]], *path: str) -> list[float]:
    vals = []
    for rec in rounds:
        v: Any = rec
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        if v is not None:
            vals.append(float(v))
    return vals


def plot(result: dict[str, Any], out_dir: str, name: str = "bench_offline.png") -> None:
    plt = bc.pyplot()
    if plt is None:
        return
    rounds, s, w = result["rounds"], result["summary"], result["workload"]
    llama = list(rounds[0].get("llama_server", {}))
    fig, (ax_c, ax_t, ax_s) = plt.subplots(1, 3, figsize=(17, 4.8),
                                           gridspec_kw={"width_ratios": [3, 3, 2]})
    _sweep(ax_c, rounds, w, llama)
    bars = [(f"xlaserve\n{w['num_prompts']} requests",
             rounds_values(rounds, "xlaserve", "throughput", "output_tok_s"))]
    bars += [(f"transformers\nbatch {b}",
              rounds_values(rounds, "transformers", f"batch_{b}", "output_tok_s"))
             for b in w["hf_batch_sizes"]]
    _bars(ax_t, [b for b in bars if b[1]],
          f"output tok/s, {w['input_len']} in / {w['output_len']} out")
    bound = s["matmul_gflops"] * 1e9 / result["flops_per_output_token"]
    dtype = result["model"]["dtype"]
    # The probe is an f32 GEMM: bf16's roof (AMX, vdpbf16ps) is higher, so say what it is.
    roof = " compute roofline" if dtype == "float32" else " f32 matmul probe's roof"
    for ax in (ax_c, ax_t):
        ax.axhline(bound, color="k", ls="--", lw=1)
        ax.text(ax.get_xlim()[0], bound, roof, va="bottom", fontsize=8)
    single = [("xlaserve", rounds_values(rounds, "xlaserve", "single", "decode_tok_s")),
              ("transformers", rounds_values(rounds, "transformers", "single", "decode_tok_s"))]
    single += [(f"llama-server\n{v.upper()}",
                rounds_values(rounds, "llama_server", v, "single", "decode_tok_s"))
               for v in llama]
    _bars(ax_s, [b for b in single if b[1]], "single-stream decode tok/s")
    mem = s["mem_read_gbps"] * 1e9 / result["model"]["weight_bytes"]
    ax_s.axhline(mem, color="k", ls="--", lw=1)
    weights = result["model"].get("weights", dtype)
    ax_s.text(0, mem, f" {weights} weights / read bandwidth", va="bottom", fontsize=8)
    fig.suptitle(f"{result['model']['name']} {weights} offline, {len(rounds)} rounds (median, "
                 f"dots: rounds); load {result['machine']['load_average']} (provisional: shared "
                 "machine)")
    bc.save_figure(fig, out_dir, name)


def _sweep(ax: Any, rounds: list[dict[str, Any]], w: dict[str, Any],
           llama: list[str]) -> None:
    """Output tok/s against concurrent requests: xlaserve, each llama-server variant, and
    transformers at its batch sizes (a batch is its concurrency)."""
    cs = w["concurrency"]
    lines = [("xlaserve", cs, [("xlaserve", f"c{c}") for c in cs])]
    lines += [(f"llama-server {v.upper()}", cs, [("llama_server", v, f"c{c}") for c in cs])
              for v in llama]
    lines.append(("transformers", w["hf_batch_sizes"],
                  [("transformers", f"batch_{b}") for b in w["hf_batch_sizes"]]))
    for i, (label, xs, paths) in enumerate(lines):
        ys = [bc.median(rounds_values(rounds, *p, "output_tok_s")) for p in paths]
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y == y]  # drop NaN
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", color=f"C{i}", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrent requests", ylabel="output tok/s",
           title=f"throughput, {w['input_len']} in / {w['output_len']} out")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _bars(ax: Any, bars: list[tuple[str, list[float]]], title: str) -> None:
    for i, (_, vals) in enumerate(bars):
        ax.bar(i, bc.median(vals), color=f"C{i}", alpha=0.7)
        ax.plot([i] * len(vals), vals, "k.", ms=6)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars])
    ax.set(title=title, ylabel="tokens / s")
    ax.grid(True, axis="y", alpha=0.3)


