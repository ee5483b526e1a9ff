"""bench_serving.py's structured-output scenarios (SGLang's /generate with
`sampling_params.json_schema`):

  constrained  --concurrency requests at once with --constrained_share of them (every
               k-th) JSON-schema constrained, the others free, run side by side for each
               share: throughput and ITL of the constrained and the free requests, and
               the ratios to the all-free run;
  schema_ttft  --schema_ttft_n single requests, alternating a schema never seen before
               (compiled on arrival) and one seen before (cached): TTFT medians and ratio.

The schema is an array of at least output_len small integers, so a constrained request
cannot end before it has made the tokens asked for and both kinds of rows make equally
many tokens.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any, Protocol

import bench_common as bc
import numpy as np
import serving_metrics as sm
import serving_workloads as wl
from serving_client import RequestResult, RequestSpec


class BenchLike(Protocol):
    load: Any
    slo: sm.SLO

    def _rng(self, salt: int) -> np.random.Generator: ...
    async def _send_all(self, specs: list[RequestSpec], offsets: list[float],
                        progress: str = "") -> list[RequestResult]: ...


def array_schema(min_items: int, salt: str = "") -> str:
    """Integers in [0, 999], at least min_items of them; salt makes a distinct schema."""
    schema: dict[str, Any] = {"type": "array", "minItems": min_items,
                              "items": {"type": "integer", "minimum": 0, "maximum": 999}}
    if salt:
        schema["description"] = salt
    return json.dumps(schema)


def _pick(n: int, share: float) -> set[int]:
    """round(share * n) of n indices, spread evenly (every k-th)."""
    k = round(share * n)
    return {int(i) for i in np.linspace(0, n, k, endpoint=False)} if k else set()


async def constrained(bench: BenchLike, shares: list[float], vocab: int,
                      prompt_kind: str) -> dict[str, Any]:
    """Every share in turn, as often as listed (repeat them, interleaved, for medians)."""
    out = []
    lengths = wl.LengthSpec(bench.load.input_len, bench.load.output_len)
    schema = array_schema(bench.load.output_len)
    for c in bench.load.concurrency:
        base = wl.requests(bench._rng(500), lengths, c, prompt_kind, vocab)
        # Unrecorded: the first batch this wide after start-up pays first-touch costs.
        await bench._send_all(base, [0.0] * c, f"constrained warm-up {c}")
        for share in shares:
            chosen = _pick(c, share)
            specs = [dataclasses.replace(s, json_schema=schema if i in chosen else None,
                                         tag="constrained" if i in chosen else "free")
                     for i, s in enumerate(base)]
            res = await bench._send_all(specs, [0.0] * c, f"constrained {share:.2f} of {c}")
            s = sm.summarize(res, sm.duration(res), bench.slo)
            per_tag = {tag: sm.summarize(part, sm.duration(part), bench.slo)
                       for tag in ("constrained", "free")
                       if (part := [r for r in res if r.tag == tag])}
            bc.log(f"  constrained share {share:.2f} of {c}: {s['output_tok_s']:.1f} output "
                   f"tok/s, ITL p50 {s['itl_ms']['p50']:.0f} ms, failed "
                   f"{s['requests'] - s['completed']}")
            out.append({"concurrency": c, "share": share, **s, "by_kind": per_tag})
    return {"runs": out, "by_share": by_share(out)}


def by_share(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over the repeated runs of each (concurrency, share), and their ratios to
    the unconstrained runs' (the shares run interleaved, so drift on a shared machine hits
    every share alike)."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        med = {}
        for share in sorted({r["share"] for r in rows if r["concurrency"] == c}):
            runs = [r for r in rows if r["concurrency"] == c and r["share"] == share]
            med[share] = {"runs": len(runs),
                          "output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
                          "itl_p50_ms": statistics.median(r["itl_ms"]["p50"] for r in runs),
                          "itl_p99_ms": statistics.median(r["itl_ms"]["p99"] for r in runs)}
        free = med.get(0.0)
        for share, m in med.items():
            if free:
                m["throughput_vs_free"] = m["output_tok_s"] / free["output_tok_s"]
                m["itl_p50_vs_free"] = m["itl_p50_ms"] / free["itl_p50_ms"]
            out.append({"concurrency": c, "share": share, **m})
            bc.log(f"  median of {m['runs']}: share {share:.2f} of {c}: "
                   f"{m['output_tok_s']:.1f} tok/s, ITL p50 {m['itl_p50_ms']:.0f} ms")
    return out


async def schema_ttft(bench: BenchLike, n: int, vocab: int) -> dict[str, Any]:
    cached = array_schema(4, "cached")
    warm = await bench._send_all([_spec(bench, vocab, cached, 0)], [0.0])  # compiles it
    ttft: dict[str, list[float]] = {"new": [], "cached": []}
    for i in range(n):  # alternating, one at a time: both kinds see the same machine
        pair = (("new", array_schema(4, f"new-{i}")), ("cached", cached))
        for j, (kind, schema) in enumerate(pair):
            # A prompt of its own each: a shared one would hit the prefix cache.
            (r,) = await bench._send_all([_spec(bench, vocab, schema, 2 * i + j + 1)], [0.0])
            if r.ok and r.ttft is not None:
                ttft[kind].append(1e3 * r.ttft)
    med = {k: statistics.median(v) if v else None for k, v in ttft.items()}
    ratio = med["new"] / med["cached"] if med["new"] and med["cached"] else None
    bc.log(f"  schema_ttft: new {med['new']} ms, cached {med['cached']} ms, ratio {ratio}")
    return {"n": n, "ttft_ms": ttft, "median_ms": med, "new_vs_cached": ratio,
            "warm_ok": warm[0].ok}


def _spec(bench: BenchLike, vocab: int, schema: str, salt: int) -> RequestSpec:
    (spec,) = wl.requests(bench._rng(600 + salt), wl.LengthSpec(bench.load.input_len, 8), 1,
                          "ids", vocab)
    return dataclasses.replace(spec, json_schema=schema)
