"""Latency statistics of the serving benchmark, from the recorded chunk arrivals.

All latencies in milliseconds. TTFT: send to first chunk; ITL: gaps between a request's
successive chunks; TPOT: (last chunk - first chunk) / (output tokens - 1) per request; E2E:
send to last chunk. Goodput (DistServe's definition, as SGLang's bench_serving reports
it): completed requests per second whose TTFT, TPOT and E2E all meet the SLO.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from serving_client import RequestResult

PCTS = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class SLO:
    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0
    e2e_ms: float = float("inf")

    def met(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft is None:
            return False
        tpot = r.tpot if r.tpot is not None else 0.0
        return (r.ttft * 1e3 <= self.ttft_ms and tpot * 1e3 <= self.tpot_ms
                and r.e2e * 1e3 <= self.e2e_ms)


def stats_ms(secs: Sequence[float]) -> dict[str, float | int | None]:
    """p50 / p90 / p99 / max / mean in ms of values in seconds (None when empty)."""
    if not len(secs):
        return {"n": 0, "mean": None, "max": None, **{f"p{p}": None for p in PCTS}}
    a = np.asarray(secs, np.float64) * 1e3
    return {"n": int(a.size), "mean": float(a.mean()), "max": float(a.max()),
            **{f"p{p}": float(np.percentile(a, p)) for p in PCTS}}


def summarize(results: Sequence[RequestResult], duration_s: float,
              slo: SLO) -> dict[str, Any]:
    """The load's headline numbers; duration_s is first send to last arrival."""
    done = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in done)
    in_tok = sum(r.input_len for r in done)
    good = sum(slo.met(r) for r in results)
    return {
        "requests": len(results), "completed": len(done),
        "failed": sum(1 for r in results if not r.ok and not r.cancelled),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration_s, "input_tokens": in_tok, "output_tokens": out_tok,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_tok_s": out_tok / duration_s if duration_s > 0 else 0.0,
        "total_tok_s": (in_tok + out_tok) / duration_s if duration_s > 0 else 0.0,
        "goodput_req_s": good / duration_s if duration_s > 0 else 0.0,
        "slo": dataclasses.asdict(slo), "slo_attainment": good / max(1, len(results)),
        "ttft_ms": stats_ms([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": stats_ms([g for r in done for g in r.itls]),
        "tpot_ms": stats_ms([r.tpot for r in done if r.tpot is not None]),
        "e2e_ms": stats_ms([r.e2e for r in done if r.e2e is not None]),
    }


def duration(results: Sequence[RequestResult]) -> float:
    sends = [r.send_t for r in results]
    ends = [r.chunk_t[-1] for r in results if r.chunk_t]
    return (max(ends) - min(sends)) if ends and sends else 0.0


def _gaps_in(results: Sequence[RequestResult], lo: float, hi: float) -> list[float]:
    """Chunk gaps of `results` that overlap the window (lo, hi): a gap that spans the
    window's start is a stream waiting for the prefill, so it counts."""
    return [b - a for r in results for a, b in zip(r.chunk_t, r.chunk_t[1:], strict=False)
            if b > lo and a < hi]


def _gaps_before(results: Sequence[RequestResult], lo: float, hi: float) -> list[float]:
    return [b - a for r in results for a, b in zip(r.chunk_t, r.chunk_t[1:], strict=False)
            if a >= lo and b <= hi]


def long_during_decode(running: Sequence[RequestResult], longs: Sequence[RequestResult],
                       steady_from: float, window_start: float) -> dict[str, Any]:
    """The running streams' ITL before the long prompts arrived (steady: gaps inside
    [steady_from, window_start]) and during their prefill (gaps overlapping [window_start,
    the last long prompt's first token]), and the long prompts' TTFT."""
    firsts = [r.chunk_t[0] for r in longs if r.chunk_t]
    window_end = max(firsts) if firsts else window_start
    steady = stats_ms(_gaps_before(running, steady_from, window_start))
    during = stats_ms(_gaps_in(running, window_start, window_end))
    ratio = (during["p99"] / steady["p50"] if during["p99"] and steady["p50"] else None)
    return {
        "window_s": window_end - window_start,
        "steady_itl_ms": steady, "during_prefill_itl_ms": during,
        "during_p99_over_steady_p50": ratio,
        "long_ttft_ms": stats_ms([r.ttft for r in longs if r.ttft is not None]),
        "long_completed": sum(1 for r in longs if r.ok),
        "running_decoding_through_window": sum(
            1 for r in running if r.chunk_t and r.chunk_t[-1] >= window_end),
        "running_failed": sum(1 for r in running if r.error),
    }
