"""PNG plots of bench_serving.py's JSON (matplotlib, the `bench` extra; without it the JSON
is the result and no plot is drawn):

  <name>_frontier.png   long_during_decode: the running streams' ITL p99 during the long
                        prefill against the long prompts' TTFT, one point per target
                        (lower left is better on both axes);
  <name>_timeline.png   long_during_decode: every running stream's inter-token gaps over
                        time, the prefill window shaded (a freeze is a spike);
  <name>_poisson.png    TTFT and ITL percentiles and output throughput against the request
                        rate, every target on the same axes;
  <name>_concurrent.png output tok/s against concurrent requests.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import bench_common as bc


def _with(result: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    return [t for t in result["targets"] if scenario in t.get("scenarios", {})]


def plot_all(result: dict[str, Any], out_dir: Path, name: str) -> list[Path]:
    plt = bc.pyplot()
    if plt is None:
        return []
    out = []
    if _with(result, "long_during_decode"):
        out += [_frontier(plt, result, out_dir, name), _timeline(plt, result, out_dir, name)]
    if _with(result, "poisson"):
        out.append(_poisson(plt, result, out_dir, name))
    if _with(result, "concurrent"):
        out.append(_concurrent(plt, result, out_dir, name))
    return out


def _title(result: dict[str, Any]) -> str:
    return (f"rev {result['git_revision'][:10]}, load {result['machine']['load_average']} on "
            f"{result['machine']['cpu_count']} CPUs (provisional on a shared machine)")


def _frontier(plt: Any, result: dict[str, Any], out_dir: Path, name: str) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    steady = []
    for i, t in enumerate(_with(result, "long_during_decode")):
        s = t["scenarios"]["long_during_decode"]
        x = (s["long_ttft_ms"]["max"] or math.nan) / 1e3
        y = s["during_prefill_itl_ms"]["p99"] or math.nan
        ax.plot([x], [y], "o", color=f"C{i}", ms=9, label=t["name"])
        ax.plot([x], [s["during_prefill_itl_ms"]["max"] or math.nan], "x", color=f"C{i}")
        ax.annotate(t["name"], (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
        if s["steady_itl_ms"]["p50"]:
            steady.append(s["steady_itl_ms"]["p50"])
    if steady:
        ax.axhline(bc.median(steady), color="k", ls="--", lw=1)
        ax.text(ax.get_xlim()[0], bc.median(steady), " steady ITL p50 (median of targets)",
                va="bottom", fontsize=8)
    s0 = _with(result, "long_during_decode")[0]["scenarios"]["long_during_decode"]
    ax.set(xlabel="long prompts' TTFT, max (s)",
           ylabel="running streams' ITL during the prefill (ms): o p99, x max",
           title=f"{s0['running']} streams decoding, {s0['long']} x {s0['long_len']}-token "
                 f"prompts arrive\n{_title(result)}")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return bc.save_figure(fig, out_dir, f"{name}_frontier.png")


def _timeline(plt: Any, result: dict[str, Any], out_dir: Path, name: str) -> Path:
    targets = _with(result, "long_during_decode")
    fig, axes = plt.subplots(len(targets), 1, figsize=(9, 2.2 * len(targets) + 0.8),
                             squeeze=False, sharey=True)
    for ax, t in zip(axes[:, 0], targets, strict=True):
        s = t["scenarios"]["long_during_decode"]
        for r in s["requests"]:
            c = r["chunk_s"]
            if r["tag"] == "running" and len(c) > 1:
                # A gap's value held over the interval it spans: a freeze is a plateau.
                ax.step(c[1:], [1e3 * (b - a) for a, b in zip(c, c[1:], strict=False)],
                        where="pre", lw=0.6, alpha=0.6)
        ax.axvspan(s["window_start_s"], s["window_start_s"] + s["window_s"], color="0.85")
        ax.set(ylabel="gap (ms)", title=t["name"], yscale="log")
    axes[-1, 0].set_xlabel("time since the running streams were sent (s); shaded: the long "
                           "prompts' prefill")
    fig.suptitle(_title(result), fontsize=9)
    return bc.save_figure(fig, out_dir, f"{name}_timeline.png")


def _rate_x(rates: list[Any]) -> tuple[list[float], float]:
    finite = [float(r) for r in rates if r != "inf"]
    inf_at = 2 * max(finite) if finite else 1.0
    return [inf_at if r == "inf" else float(r) for r in rates], inf_at


def _poisson(plt: Any, result: dict[str, Any], out_dir: Path, name: str) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("ttft_ms", "p50", "TTFT p50 (ms)"), ("ttft_ms", "p99", "TTFT p99 (ms)"),
              ("itl_ms", "p99", "ITL p99 (ms)"), ("output_tok_s", None, "output tok/s")]
    inf_at = 1.0
    for i, t in enumerate(_with(result, "poisson")):
        pts = t["scenarios"]["poisson"]
        xs, inf_at = _rate_x([p["request_rate"] for p in pts])
        for ax, (key, pct, label) in zip(axes.flat, panels, strict=True):
            ys = [p[key] if pct is None else (p[key][pct] or math.nan) for p in pts]
            ax.plot(xs, ys, "o-", color=f"C{i}", label=t["name"])
            ax.set(xlabel="request rate (req/s; rightmost: all at once)", ylabel=label)
    for ax in axes.flat:
        ax.axvline(inf_at, color="0.7", ls=":", lw=1)
        ax.grid(True, alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"Poisson arrivals ({result['length_dist']} lengths)\n{_title(result)}",
                 fontsize=9)
    return bc.save_figure(fig, out_dir, f"{name}_poisson.png")


def _concurrent(plt: Any, result: dict[str, Any], out_dir: Path, name: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, t in enumerate(_with(result, "concurrent")):
        pts = t["scenarios"]["concurrent"]
        ax.plot([p["concurrency"] for p in pts], [p["output_tok_s"] for p in pts], "o-",
                color=f"C{i}", label=t["name"])
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrent requests", ylabel="output tok/s",
           title=f"{result['load']['input_len']} in / {result['load']['output_len']} out\n"
                 f"{_title(result)}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return bc.save_figure(fig, out_dir, f"{name}_concurrent.png")
