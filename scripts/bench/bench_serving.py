"""Serving benchmark: HTTP load against xlaserve, llama-server or any OpenAI-compatible /
SGLang-native streaming server, every streamed chunk's arrival recorded.

    # the ITL / TTFT frontier: xlaserve started with each config in turn (the default
    # configs: plain, prefill first with chunks of 512 (--itl_target_ms=0), chunked +
    # mixed, multiplexing, and the default flags: decode first), long prompts during decode
    .venv/bin/python scripts/bench/bench_serving.py --out_dir=bench_out
    # the same load against a server already running on this machine
    .venv/bin/python scripts/bench/bench_serving.py --base_url=http://127.0.0.1:30000 \
        --scenarios=poisson,concurrent
    # xlaserve's defaults and llama-server (F32 and Q4_1, `make peers`) side by side
    .venv/bin/python scripts/bench/bench_serving.py --config=default= --peers=f32,q4_1 \
        --scenarios=concurrent,poisson

Scenarios (--scenarios, each run on every target in turn):
  concurrent          --concurrency requests at once, --input_len in / --output_len out;
  poisson             --num_prompts requests at each --request_rates (Poisson arrivals;
                      lengths from --length_dist); TTFT / ITL / TPOT / E2E percentiles,
                      throughput, goodput under --slo_ttft_ms / --slo_tpot_ms;
  shared_prefix       groups of prompts sharing a long prefix (the prefix cache);
  long_during_decode  --ldd_running streams decode; after --ldd_steady_s, --ldd_long
                      prompts of --ldd_long_len tokens arrive. Reported: the running
                      streams' ITL p50 / p99 / max during the long prompts' prefill
                      (gaps overlapping [arrival, last long prompt's first token]) against
                      their steady ITL before, and the long prompts' TTFT. With several
                      targets this is the frontier plot: ITL p99 during prefill against
                      the long prompts' TTFT, one point per configuration.
  constrained         --concurrency at once, --constrained_share of them JSON-schema
                      constrained (--backend=generate); schema_ttft: TTFT of a new schema
                      against a cached one (scripts/bench/serving_structured.py).
Requests are greedy with EOS ignored (every request makes the tokens asked for); prompts
are random token ids (or --prompt_kind=words), generated locally. Only loopback servers
may be targeted; every loop is bounded by a request count and a timeout. Writes
bench_serving[_<tag>].json and PNGs to --out_dir; the JSON has the command, the git
revision, the machine and every target's flags and server log name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import urllib.request
from pathlib import Path
from typing import Any

import bench_common as bc
import bench_servers as bs
import numpy as np
import serving_metrics as sm
import serving_plots
import serving_structured
import serving_workloads as wl
from absl import app, flags
from serving_client import RequestResult, RequestSpec, make_client, new_result, run_at, send

FLAGS = flags.FLAGS
SCENARIOS = ("concurrent", "poisson", "shared_prefix", "long_during_decode", "constrained",
             "schema_ttft")
DEFAULT_CONFIGS = ["plain=--chunked_prefill_size=-1",
                   "prefill_first=--chunked_prefill_size=512 --itl_target_ms=0",
                   "chunk512_mixed=--chunked_prefill_size=512 --enable_mixed_chunk",
                   "mux=--enable_multiplexing", "default="]

bc.define_run_flags("bench_out", "tiny sizes everywhere (checks the script)",
                    out_help="where the JSON, PNGs and server logs go", compilation_cache=False)
flags.DEFINE_string("tag", "", "suffix of the output names (bench_serving_<tag>.json)")
flags.DEFINE_string("base_url", None, "benchmark this running server (loopback only) "
                    "instead of launching --config / --peers")
flags.DEFINE_enum("backend", "openai", ["openai", "generate"], "/v1/completions or SGLang's "
                  "/generate (llama-server speaks openai only)")
flags.DEFINE_string("model", "default", "the `model` field of OpenAI requests")
flags.DEFINE_multi_string("config", DEFAULT_CONFIGS, "xlaserve configurations, one flag "
                          "set each: 'name=--flag=v --flag2' (a new serve.py flag such as "
                          "--enable_multiplexing needs no code here)")
flags.DEFINE_string("xlaserve_cmd", "{python} scripts/serve.py", "launch command of an "
                    "xlaserve config ({python}: this interpreter)")
flags.DEFINE_string("xlaserve_flags", "--max_total_tokens=32768", "flags of every config "
                    "(before its own; the pool bounds the server's memory)")
flags.DEFINE_list("peers", [], "llama-server variants to run too: f32, q4_1")
flags.DEFINE_string("llama_server_cmd", "{llama_server}", "llama-server launch command "
                    "({llama_server}: the binary `make peers` builds)")
flags.DEFINE_integer("llama_parallel", 0, "llama-server slots (0: enough for the load)")
flags.DEFINE_integer("llama_threads", 2, "llama-server --threads and --threads-batch")
flags.DEFINE_integer("llama_ctx_per_slot", 0, "KV tokens per slot (0: the load's longest)")
flags.DEFINE_string("llama_flags", "", "more llama-server flags")
flags.DEFINE_string("checkpoint_cache_dir", "~/.cache/xlaserve/checkpoints", "where the "
                    "default model's checkpoint is (the F32 GGUF is written from it)")
flags.DEFINE_list("scenarios", ["long_during_decode"], f"of {', '.join(SCENARIOS)}")
flags.DEFINE_integer("seed", 0, "seed of prompts, lengths and arrivals")
flags.DEFINE_integer("vocab_size", 49152, "random ids are drawn from [3, vocab_size)")
flags.DEFINE_enum("prompt_kind", "ids", list(wl.PROMPT_KINDS), "random token ids or words")
flags.DEFINE_enum("length_dist", "random", list(wl.LENGTH_DISTS), "poisson lengths")
flags.DEFINE_float("range_ratio", 0.5, "random lengths are uniform in [ratio * L, L]")
flags.DEFINE_integer("input_len", 128, "prompt tokens (mean for random / sharegpt)")
flags.DEFINE_integer("concurrent_input_len", 0, "the concurrent scenario's prompt tokens "
                     "(0: --input_len), so a burst of short prompts and a Poisson load of "
                     "long ones run side by side")
flags.DEFINE_integer("output_len", 128, "new tokens (mean for random / sharegpt)")
flags.DEFINE_integer("num_prompts", 64, "requests per Poisson rate")
flags.DEFINE_list("request_rates", ["1", "2", "4", "inf"], "Poisson rates (req/s; inf: "
                  "all at once)")
flags.DEFINE_list("concurrency", ["1", "8", "32"], "concurrent scenario sizes")
flags.DEFINE_list("constrained_share", ["0", "0.5", "1"], "constrained: shares of the "
                  "requests that are JSON-schema constrained, run side by side")
flags.DEFINE_integer("schema_ttft_n", 8, "schema_ttft: requests of each kind")
flags.DEFINE_integer("ldd_running", 16, "long_during_decode: streams decoding")
flags.DEFINE_integer("ldd_running_input_len", 64, "their prompt tokens")
flags.DEFINE_integer("ldd_running_max_tokens", 2048, "their token limit (they are stopped "
                     "once the long prompts are done)")
flags.DEFINE_integer("ldd_long", 4, "long prompts arriving")
flags.DEFINE_integer("ldd_long_len", 2048, "their tokens")
flags.DEFINE_integer("ldd_long_output_len", 8, "their new tokens")
flags.DEFINE_float("ldd_steady_s", 4.0, "steady decoding before the long prompts arrive")
flags.DEFINE_integer("sp_groups", 4, "shared_prefix: groups")
flags.DEFINE_integer("sp_per_group", 8, "requests per group")
flags.DEFINE_integer("sp_prefix_len", 512, "shared prefix tokens")
flags.DEFINE_integer("sp_suffix_len", 32, "unique suffix tokens")
flags.DEFINE_float("sp_rate", 4.0, "shared_prefix Poisson rate (req/s)")
flags.DEFINE_float("slo_ttft_ms", 2000.0, "goodput SLO: TTFT")
flags.DEFINE_float("slo_tpot_ms", 200.0, "goodput SLO: TPOT")
flags.DEFINE_float("request_timeout_s", 600.0, "one request's limit")
flags.DEFINE_float("health_timeout_s", 1800.0, "a launched server's start-up limit (a cold "
                   "compile of every bucket takes minutes on a loaded CPU)")


@dataclasses.dataclass(frozen=True)
class Load:
    """The sizes of every scenario (the flags, or tiny ones under --smoke)."""

    input_len: int
    output_len: int
    num_prompts: int
    concurrency: tuple[int, ...]
    rates: tuple[float, ...]
    ldd: tuple[int, int, int, int, int, int, float]  # running, in, max, long, len, out, s
    sp: tuple[int, int, int, int, float]  # groups, per group, prefix, suffix, rate

    def needs(self, scenarios: list[str], length_dist: str) -> tuple[int, int]:
        """(most requests in flight, longest request in tokens) of the scenarios to run:
        what a llama-server's slots and per-slot context must hold."""
        spread = 4 if length_dist == "sharegpt" else 1  # lengths are capped at 4x the mean
        per = {"concurrent": (max(self.concurrency), self.input_len + self.output_len),
               "constrained": (max(self.concurrency), self.input_len + self.output_len),
               "schema_ttft": (1, self.input_len + 8),
               "poisson": (self.num_prompts, spread * (self.input_len + self.output_len)),
               "shared_prefix": (self.sp[0] * self.sp[1],
                                 self.sp[2] + self.sp[3] + self.output_len),
               "long_during_decode": (self.ldd[0] + self.ldd[3],
                                      max(self.ldd[1] + self.ldd[2], self.ldd[4] + self.ldd[5]))}
        picked = [per[n] for n in scenarios]
        return min(64, max(c for c, _ in picked)), max(n for _, n in picked)


def _load() -> Load:
    if FLAGS.smoke:
        return Load(16, 8, 6, (1, 4), (20.0, math.inf), (3, 8, 200, 2, 96, 4, 0.5),
                    (2, 3, 32, 8, 20.0))
    return Load(FLAGS.input_len, FLAGS.output_len, FLAGS.num_prompts,
                tuple(int(c) for c in FLAGS.concurrency),
                tuple(float(r) for r in FLAGS.request_rates),
                (FLAGS.ldd_running, FLAGS.ldd_running_input_len, FLAGS.ldd_running_max_tokens,
                 FLAGS.ldd_long, FLAGS.ldd_long_len, FLAGS.ldd_long_output_len,
                 FLAGS.ldd_steady_s),
                (FLAGS.sp_groups, FLAGS.sp_per_group, FLAGS.sp_prefix_len, FLAGS.sp_suffix_len,
                 FLAGS.sp_rate))


# ---------------------------------------------------------------- scenarios


class Bench:
    """One target's scenarios over one HTTP client."""

    def __init__(self, base_url: str, backend: str, load: Load) -> None:
        self.url, self.backend, self.load = base_url, backend, load
        self.slo = sm.SLO(FLAGS.slo_ttft_ms, FLAGS.slo_tpot_ms)

    def _rng(self, salt: int) -> np.random.Generator:
        return np.random.default_rng([FLAGS.seed, salt])

    async def _send_all(self, specs: list[RequestSpec], offsets: list[float],
                        progress: str = "") -> list[RequestResult]:
        async with make_client(len(specs) + 4) as client:
            return await run_at(client, self.backend, self.url, specs, offsets, FLAGS.model,
                                FLAGS.request_timeout_s, progress)

    async def warm_up(self) -> None:
        specs = wl.requests(self._rng(99), wl.LengthSpec(16, 4), 2, "ids", FLAGS.vocab_size)
        res = await self._send_all(specs, [0.0, 0.0])
        bad = [r.error for r in res if not r.ok]
        if bad:
            raise bs.ClientError(f"warm-up requests to {self.url} failed: {bad}")

    async def concurrent(self) -> list[dict[str, Any]]:
        out = []
        lengths = wl.LengthSpec(FLAGS.concurrent_input_len or self.load.input_len,
                                self.load.output_len)
        for i, c in enumerate(self.load.concurrency):
            specs = wl.requests(self._rng(100 + i), lengths, c, FLAGS.prompt_kind,
                                FLAGS.vocab_size)
            res = await self._send_all(specs, [0.0] * c, f"concurrent {c}")
            s = sm.summarize(res, sm.duration(res), self.slo)
            bc.log(f"  concurrent {c}: {s['output_tok_s']:.1f} output tok/s, "
                   f"TTFT p50 {_ms(s['ttft_ms']['p50'])}, ITL p50 {_ms(s['itl_ms']['p50'])}")
            out.append({"concurrency": c, **s})
        return out

    async def poisson(self) -> list[dict[str, Any]]:
        out = []
        lengths = wl.LengthSpec(self.load.input_len, self.load.output_len, FLAGS.length_dist,
                                FLAGS.range_ratio, max_input_len=4 * self.load.input_len,
                                max_output_len=4 * self.load.output_len)
        for i, rate in enumerate(self.load.rates):
            rng = self._rng(200 + i)
            specs = wl.requests(rng, lengths, self.load.num_prompts, FLAGS.prompt_kind,
                                FLAGS.vocab_size)
            res = await self._send_all(specs, wl.poisson_offsets(rng, len(specs), rate),
                                       f"poisson {rate} req/s")
            s = sm.summarize(res, sm.duration(res), self.slo)
            bc.log(f"  poisson {rate} req/s: {s['completed']}/{s['requests']} done, "
                   f"{s['output_tok_s']:.1f} output tok/s, TTFT p99 "
                   f"{_ms(s['ttft_ms']['p99'])}, ITL p99 {_ms(s['itl_ms']['p99'])}, "
                   f"goodput {s['goodput_req_s']:.2f} req/s")
            out.append({"request_rate": rate if math.isfinite(rate) else "inf", **s})
        return out

    async def shared_prefix(self) -> dict[str, Any]:
        groups, per, prefix, suffix, rate = self.load.sp
        rng = self._rng(300)
        specs = wl.shared_prefix_requests(rng, groups, per, prefix, suffix,
                                          self.load.output_len, FLAGS.vocab_size)
        res = await self._send_all(specs, wl.poisson_offsets(rng, len(specs), rate),
                                   "shared_prefix")
        s = sm.summarize(res, sm.duration(res), self.slo)
        bc.log(f"  shared_prefix: {s['completed']}/{s['requests']} done, TTFT p50 "
               f"{_ms(s['ttft_ms']['p50'])}, {s['total_tok_s']:.1f} total tok/s")
        return {"groups": groups, "per_group": per, "prefix_len": prefix,
                "suffix_len": suffix, "request_rate": rate, **s}

    async def long_during_decode(self) -> dict[str, Any]:
        n_run, run_in, run_max, n_long, long_len, long_out, steady_s = self.load.ldd
        rng = self._rng(400)
        running = wl.requests(rng, wl.LengthSpec(run_in, run_max), n_run, "ids",
                              FLAGS.vocab_size, "running")
        longs = wl.requests(rng, wl.LengthSpec(long_len, long_out), n_long, "ids",
                            FLAGS.vocab_size, "long")
        t0 = time.perf_counter()
        async with make_client(n_run + n_long + 4) as client:
            run_res = [new_result(s) for s in running]
            tasks = [asyncio.create_task(send(client, self.backend, self.url, s, FLAGS.model,
                                              FLAGS.request_timeout_s, r))
                     for s, r in zip(running, run_res, strict=True)]
            # Bounded wait for every stream to be decoding (its first token is out).
            deadline = time.perf_counter() + FLAGS.request_timeout_s
            while (not all(r.chunk_t or t.done() for r, t in zip(run_res, tasks, strict=True))
                   and time.perf_counter() < deadline):
                await asyncio.sleep(0.02)
            steady_from = time.perf_counter()
            await asyncio.sleep(steady_s)
            window_start = time.perf_counter()
            long_res = await run_at(client, self.backend, self.url, longs, [0.0] * n_long,
                                    FLAGS.model, FLAGS.request_timeout_s)
            await asyncio.sleep(min(1.0, steady_s))  # a little decode after, for the record
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks)
        a = sm.long_during_decode(run_res, long_res, steady_from, window_start)
        bc.log(f"  long_during_decode: steady ITL p50 {_ms(a['steady_itl_ms']['p50'])}; "
               f"during prefill p99 {_ms(a['during_prefill_itl_ms']['p99'])}, max "
               f"{_ms(a['during_prefill_itl_ms']['max'])}; long TTFT max "
               f"{_ms(a['long_ttft_ms']['max'])}")
        return {"running": n_run, "running_input_len": run_in, "long": n_long,
                "long_len": long_len, "long_output_len": long_out, "steady_s": steady_s,
                "steady_from_s": steady_from - t0, "window_start_s": window_start - t0,
                **a, "requests": [r.to_json(t0) for r in run_res + long_res]}


    async def constrained(self) -> dict[str, Any]:
        return await serving_structured.constrained(
            self, [float(x) for x in FLAGS.constrained_share], FLAGS.vocab_size,
            FLAGS.prompt_kind)

    async def schema_ttft(self) -> dict[str, Any]:
        return await serving_structured.schema_ttft(self, FLAGS.schema_ttft_n,
                                                    FLAGS.vocab_size)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} ms"


# ---------------------------------------------------------------- targets


def _targets(load: Load) -> list[bs.Target]:
    if FLAGS.base_url:
        return [bs.url_target(FLAGS.base_url, FLAGS.backend)]
    out = [bs.xlaserve_target(c, FLAGS.xlaserve_cmd, FLAGS.xlaserve_flags, FLAGS.backend)
           for c in FLAGS.config]
    if FLAGS.peers:
        import llama_peer
        slots, longest = load.needs(FLAGS.scenarios, FLAGS.length_dist)
        parallel = FLAGS.llama_parallel or slots
        ctx = FLAGS.llama_ctx_per_slot or bc.pow2_at_least(longest, 256)
        out += [llama_peer.llama_target(v, parallel, ctx, FLAGS.llama_threads,
                                        FLAGS.llama_server_cmd, FLAGS.checkpoint_cache_dir,
                                        FLAGS.llama_flags) for v in FLAGS.peers]
    bs.names_unique(out)
    return out


def _engine_counts(base_url: str) -> dict[str, Any] | None:
    """xlaserve's step counts by mode, prefill steps by path (the prefill policy's
    decisions), compilations after warm-up and the policy's start-up inputs, from
    /debug/execution_trace; None where the server has no such endpoint."""
    try:
        with urllib.request.urlopen(f"{base_url}/debug/execution_trace?n=0", timeout=30) as r:
            d = json.load(r)
    except (OSError, ValueError):
        return None
    return {k: d.get(k) for k in ("step_counts", "prefill_paths", "compiles_after_warmup",
                                  "prefill_policy")}


def _delta(after: dict[str, Any] | None, before: dict[str, Any] | None) -> dict[str, Any] | None:
    """The counts a scenario added (after - before)."""
    if after is None or before is None:
        return None
    out = dict(after)
    for k in ("step_counts", "prefill_paths"):
        a, b = after.get(k) or {}, before.get(k) or {}
        out[k] = {m: a[m] - b.get(m, 0) for m in a if a[m] - b.get(m, 0)}
    return out


async def _run_scenarios(srv: bs.Running, target: bs.Target, load: Load) -> dict[str, Any]:
    bench = Bench(srv.base_url, "openai" if target.kind == "llama-server" else target.backend,
                  load)
    await bench.warm_up()
    rec: dict[str, Any] = {}
    for name in FLAGS.scenarios:
        bc.log(f"{target.name}: {name}")
        before = _engine_counts(srv.base_url) if target.kind != "llama-server" else None
        res = await getattr(bench, name)()
        after = _engine_counts(srv.base_url) if before is not None else None
        load_avg = bc.load_average()
        if isinstance(res, dict):
            res["engine"], res["load_average"] = _delta(after, before), load_avg
        else:
            rec[f"{name}_engine"] = _delta(after, before)
            rec[f"{name}_load_average"] = load_avg
        rec[name] = res
        bc.log(f"  {name}: load average {load_avg}")
    return rec


def run_target(target: bs.Target, load: Load, out_dir: Path) -> dict[str, Any]:
    rec: dict[str, Any] = {"name": target.name, "kind": target.kind, "flags": target.flags,
                           "argv": list(target.argv)}
    with bs.running(target, out_dir, FLAGS.health_timeout_s) as srv:
        rec["startup_s"] = srv.startup_s
        rec["log"] = srv.log_path.name if target.kind != "url" else None
        rec["scenarios"] = asyncio.run(_run_scenarios(srv, target, load))
    return rec


def main(argv: list[str]) -> None:
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    unknown = set(FLAGS.scenarios) - set(SCENARIOS)
    if unknown:
        raise app.UsageError(f"--scenarios: {sorted(unknown)} not in {SCENARIOS}")
    load = _load()
    out_dir = Path(FLAGS.out_dir)
    targets = _targets(load)
    result: dict[str, Any] = {"script": "bench_serving", "command": bc.command_line(),
                              "git_revision": bc.git_revision(),
                              "machine": bc.machine_info(),
                              "load": dataclasses.asdict(load), "scenarios": FLAGS.scenarios,
                              "backend": FLAGS.backend, "prompt_kind": FLAGS.prompt_kind,
                              "length_dist": FLAGS.length_dist, "targets": []}
    t0 = time.perf_counter()
    name = f"bench_serving{'_' + FLAGS.tag if FLAGS.tag else ''}"
    for t in targets:
        result["targets"].append(run_target(t, load, out_dir))
        # Written after every target too, so a run cut short keeps what it measured.
        bc.write_json(out_dir, f"{name}.partial.json", result)
    result["wall_s"] = time.perf_counter() - t0
    result["machine"]["load_average_end"] = bc.load_average()
    bc.write_json(out_dir, f"{name}.json", result)
    (out_dir / f"{name}.partial.json").unlink(missing_ok=True)
    serving_plots.plot_all(result, out_dir, name)


if __name__ == "__main__":
    app.run(main)
