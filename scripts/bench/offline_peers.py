"""llama-server in bench_offline.py: each variant (F32 from xlaserve's weights, the shipped
Q4_1) started once with --parallel slots for the largest concurrency, then measured with
the same prompts as xlaserve: c requests at once over HTTP (its API; continuous batching
over its slots), greedy with EOS ignored, and one single stream.

Output tok/s = output tokens / (first send to last token), the offline definition;
single-stream decode tok/s = (tokens - 1) / (last token - first token), as xlaserve's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench_servers as bs
import llama_peer
import serving_metrics as sm
from serving_client import RequestSpec, make_client, run_at


def sweep_points(variants: Sequence[str], concurrency: Sequence[int], specs: Sequence[str],
                 flag: str = "--llama_concurrency",
                 members: str = "--llama_variants") -> dict[str, tuple[int, ...]]:
    """Each variant's sweep points: `concurrency`, or the points a spec VARIANT=C1,C2,...
    names (`flag`: bench_offline's --llama_concurrency for llama-server's variants, its
    --xla_concurrency for xlaserve's weight formats). ValueError on a bad spec."""
    points = {v: tuple(concurrency) for v in variants}
    for spec in specs:
        v, _, cs = spec.partition("=")
        try:
            want = tuple(int(c) for c in cs.split(","))
        except ValueError:
            want = ()
        if v not in points or not want or not set(want) <= set(concurrency):
            raise ValueError(
                f"{flag}={spec}: want VARIANT=C1,C2,... with VARIANT one of {members} "
                f"{list(points)} and the points among --concurrency {list(concurrency)}")
        points[v] = tuple(c for c in concurrency if c in want)
    return points


class LlamaPeers:
    """The started llama-server variants; stop() ends them all."""

    def __init__(self, variants: Sequence[str], parallel: int, ctx_per_slot: int,
                 threads: int, cmd: str, checkpoint_cache_dir: str, log_dir: Path) -> None:
        self.servers: dict[str, bs.Running] = {}
        try:
            for v in variants:
                t = llama_peer.llama_target(v, parallel, ctx_per_slot, threads, cmd,
                                            checkpoint_cache_dir)
                self.servers[v] = bs.Running(t, log_dir, health_timeout_s=300)
        except Exception:
            self.stop()
            raise
        self.parallel, self.threads = parallel, threads

    def info(self) -> dict[str, Any]:
        return {v: {"argv": list(s.target.argv), "startup_s": s.startup_s,
                    "model_bytes": _model_bytes(s.target)}
                for v, s in self.servers.items()}

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()

    def _run(self, variant: str, prompts: Sequence[Sequence[int]],
             n: int) -> list[Any]:
        specs = [RequestSpec(list(p), len(p), n) for p in prompts]

        async def go() -> list[Any]:
            async with make_client(len(specs) + 2) as client:
                return await run_at(client, "openai", self.servers[variant].base_url, specs,
                                    [0.0] * len(specs), "default", 900.0)
        res = asyncio.run(go())
        bad = [r.error or "incomplete" for r in res if not r.ok]
        if bad:
            raise bs.ClientError(f"llama-server {variant}: {len(bad)} requests failed: "
                                 f"{bad[:3]}")
        return res

    def throughput(self, variant: str, prompts: Sequence[Sequence[int]],
                   n: int) -> dict[str, Any]:
        res = self._run(variant, prompts, n)
        secs = sm.duration(res)
        made = sum(r.output_tokens for r in res)
        inp = sum(map(len, prompts))
        return {"concurrency": len(prompts), "wall_s": secs, "input_tokens": inp,
                "output_tokens": made, "output_tok_s": made / secs,
                "total_tok_s": (inp + made) / secs,
                "ttft_ms": sm.stats_ms([r.ttft for r in res]),
                "itl_ms": sm.stats_ms([g for r in res for g in r.itls])}

    def ttft(self, variant: str, ids: Sequence[int]) -> float:
        """Seconds to the first token of one request (a prefill, over HTTP)."""
        (r,) = self._run(variant, [ids], 1)
        return r.ttft

    def single(self, variant: str, ids: Sequence[int], n: int) -> dict[str, Any]:
        (r,) = self._run(variant, [ids], n)
        return {"prompt_tokens": len(ids), "new_tokens": r.output_tokens, "ttft_s": r.ttft,
                "e2e_s": r.e2e,
                "decode_tok_s": (r.output_tokens - 1) / (r.chunk_t[-1] - r.chunk_t[0])}


def _model_bytes(target: bs.Target) -> int | None:
    """Size of the GGUF a llama-server reads per decode step (its weights' bytes)."""
    argv = list(target.argv)
    path = Path(argv[argv.index("--model") + 1])
    return path.stat().st_size if path.is_file() else None
