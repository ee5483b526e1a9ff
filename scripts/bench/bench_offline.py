"""Offline throughput of Engine.generate, side by side with transformers in the same run.

    .venv/bin/python scripts/bench/bench_offline.py --out_dir=bench_out      # several minutes
    .venv/bin/python scripts/bench/bench_offline.py --smoke --out_dir=/tmp/bo # tiny model, seconds

Workloads (greedy, EOS ignored, so every request makes exactly the tokens asked for):
  throughput     --num_prompts random-token prompts of --input_len tokens, --output_len
                 new tokens each, all submitted at once (continuous batching);
  single stream  one chat prompt ("What is the capital of France?", 37 tokens with the
                 template) and --single_new_tokens new tokens; decode tok/s counts the
                 tokens after the first over the time after the first token. Each round
                 runs every xlaserve dtype's and llama-server variant's single stream
                 --single_repeats times, interleaved, each between two read probes, and
                 reports the medians: this machine's read bandwidth swings up to 2x from
                 one minute to the next, so only runs seconds apart compare.
With the `reference` extra installed, transformers runs the same prompts: batched
`generate` at each --hf_batch_sizes (in xlaserve's dtype, all-ones attention mask,
min_new_tokens = max_new_tokens), and the same single stream. The contenders alternate
round by round (A B A B, --repeats rounds; round r uses prompts drawn with seed + r, so
the prefix cache never serves one round's prompts from an earlier round) and medians are
reported, with ratios xlaserve / transformers paired within each round. The machine's
roofline is measured at the start of every round; the throughput run's useful FLOPs
(prefill logits for the last prompt token only) over its time give its fraction of the
compute roofline. The --concurrency sweep sends c requests at once to xlaserve and to
each llama-server variant (--llama_concurrency cuts a variant's points); its point at
--num_prompts is the throughput run itself. Writes bench_offline.json and
bench_offline.png to --out_dir, and with --also_dtypes=bfloat16,int8 (as `make bench` runs
it) bench_offline_bf16.* and bench_offline_int8.* as well: the bf16 engine and the
weight-only int8 one (--quantization=int8, f32 activations) measured in the same rounds,
against the same llama-server runs. transformers has no int8 counterpart here.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench_common as bc
import jax
import llama_peer
import numpy as np
import offline_peers
import offline_plots as op
import offline_summary as osum
from absl import app, flags

import cpu_kernels
from models.config import ModelConfig
from runtime.config import ServerArgs
from runtime.engine import Engine

FLAGS = flags.FLAGS
SHORT_DTYPE = {"float32": "f32", "bfloat16": "bf16", "int8": "int8", "bf16x12": "bf16x12"}
# Weight formats that are a quantization over f32 activations, not a dtype; transformers
# has no counterpart of them here.
QUANTIZED = {"int8"}
# bf16 weights stored in 12 bits (--compress_weights): the same model as bfloat16, whose
# transformers run is its reference.
COMPRESSED = {"bf16x12"}
bc.define_run_flags("bench_out", "tiny random model, tiny workload (checks the script)",
                    checkpoint_cache=True)
flags.DEFINE_integer("num_prompts", 32, "requests in the throughput run")
bc.define_length_flags("request")
flags.DEFINE_integer("seed", 0, "seed of the random prompts (round r uses seed + r)")
flags.DEFINE_integer("repeats", 2, "rounds; each runs every contender once (A B A B)")
flags.DEFINE_string("single_prompt", "What is the capital of France?", "single-stream prompt")
bc.define_single_stream_flags("xlaserve's dtypes and llama-server's variants (A B C, C B A, "
                              "...)")
flags.DEFINE_integer("prefill_len", 512, "tokens of the prefill measurement (one random "
                     "prompt, one new token; prefill tok/s = tokens / TTFT)")
flags.DEFINE_enum("reference", "auto", ["auto", "on", "off"],
                  "transformers side by side: auto = when torch and transformers import")
flags.DEFINE_list("hf_batch_sizes", ["8", "32"], "transformers generate batch sizes")
flags.DEFINE_integer("hf_threads", 0, "torch threads, 0 = os.cpu_count() (on a loaded machine "
                     "OpenMP's spinning threads can slow torch down many times over)")
flags.DEFINE_integer("max_running_requests", 32, "see ServerArgs")
flags.DEFINE_string("dtype", None, "xlaserve's weights: float32 / bfloat16 / int8 "
                    "(weight-only int8 over f32 activations, serve.py's "
                    "--quantization=int8) / bf16x12 (bfloat16 in 12 bits, serve.py's "
                    "--compress_weights); default: the server's dtype")
flags.DEFINE_list("also_dtypes", [], "further xlaserve weight formats (as --dtype) measured "
                  "in the same rounds against the same peer runs (transformers in each "
                  "dtype, none for int8): bench_offline_<bf16|f32|int8>.json / .png beside "
                  "--dtype's bench_offline.*")
flags.DEFINE_list("concurrency", ["1", "8", "32", "64"], "concurrent requests of the "
                  "side-by-side sweep (xlaserve and llama-server)")
flags.DEFINE_enum("llama_server", "auto", ["auto", "on", "off"], "llama-server side by "
                  "side: auto = when `make peers` has built it")
flags.DEFINE_list("llama_variants", ["f32", "q4_1"], "llama-server model files: f32 and "
                  "bf16 (from xlaserve's weights), q4_1 (the shipped GGUF)")
flags.DEFINE_string("llama_server_cmd", "{llama_server}", "llama-server launch command")
flags.DEFINE_integer("llama_threads", 2, "llama-server --threads / --threads-batch")
flags.DEFINE_multi_string("llama_concurrency", [], "VARIANT=C1,C2,...: the sweep points of "
                          "one llama-server variant where not all of --concurrency (a "
                          "subset of it; repeat the flag per variant)")
flags.DEFINE_multi_string("xla_concurrency", [], "FORMAT=C1,C2,...: the sweep points of one "
                          "xlaserve weight format (--dtype / --also_dtypes) where not all of "
                          "--concurrency, as --llama_concurrency; its throughput run "
                          "(--num_prompts requests) runs whatever they are")
flags.DEFINE_multi_string("xla_steps", [], "FORMAT=K: xlaserve's decode steps per program "
                          "for one weight format (serve.py's --num_scheduler_steps, when no "
                          "request can be admitted); 1 for the others")
flags.DEFINE_list("hf_dtypes", [], "the formats transformers runs in (default: every "
                  "measured one it has: float32, bfloat16)")

@dataclasses.dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    single_new_tokens: int
    hf_batch_sizes: tuple[int, ...]
    concurrency: tuple[int, ...] = ()
    prefill_len: int = 512

    def prompts(self, seed: int, vocab: int, n: int | None = None) -> list[list[int]]:
        # ids from 3 up: 0-2 are unk / bos / eos-pad in SmolLM2's vocabulary.
        rng = np.random.default_rng(seed)
        return rng.integers(3, vocab, (n or self.num_prompts, self.input_len)).tolist()


def _workload() -> Workload:
    if FLAGS.smoke:
        return Workload(num_prompts=4, input_len=16, output_len=8, single_new_tokens=8,
                        hf_batch_sizes=(2, 4), concurrency=(1, 4), prefill_len=32)
    return Workload(FLAGS.num_prompts, FLAGS.input_len, FLAGS.output_len,
                    FLAGS.single_new_tokens, tuple(int(b) for b in FLAGS.hf_batch_sizes),
                    tuple(int(c) for c in FLAGS.concurrency), FLAGS.prefill_len)


# ---------------------------------------------------------------- xlaserve


def _server_args(w: Workload, weights: str | None) -> ServerArgs:
    """The server's defaults, except: KV-length buckets cut to the smallest default bucket
    these requests fit (no batch here could use a longer one; fewer executables to compile
    at start-up), and no top-logprobs (no request asks for them)."""
    longest = _longest_request(w)
    kv = tuple(b for b in (256, 1024, 4096, 8192) if b >= longest)[:1] or (8192,)
    quantization = weights if weights in QUANTIZED else None
    compress = weights in COMPRESSED
    base = ServerArgs(dtype="float32" if quantization else "bfloat16" if compress else weights,
                      quantization=quantization, compress_weights=compress,
                      max_running_requests=FLAGS.max_running_requests,
                      num_scheduler_steps=_steps().get(weights or "", 1),
                      kv_len_buckets=kv, max_top_logprobs=0,
                      checkpoint_cache_dir=FLAGS.checkpoint_cache_dir,
                      compilation_cache_dir=FLAGS.compilation_cache_dir or None)
    return bc.smoke_args(base) if FLAGS.smoke else base


def unavailable(weights: str | None) -> str | None:
    """Why this machine cannot serve a weight format (None: it can): 12-bit bf16 needs
    AVX-512BW on the CPU (cpu_kernels.isa). Such a format is skipped and the report says
    so, rather than the whole run stopping."""
    if weights in COMPRESSED and jax.default_backend() == "cpu":
        return cpu_kernels.x12_unavailable_reason()
    return None


def _write_skipped(weights: str, reason: str, machine: dict[str, Any]) -> None:
    """The result file of a skipped format: what was skipped, why, where, by which command
    (so the report names it, and no older file stands in for this run)."""
    bc.log(f"skipping {weights}: {reason}")
    bc.write_json(FLAGS.out_dir, f"bench_offline_{SHORT_DTYPE[weights]}.json",
                  {"script": "bench_offline", "command": bc.command_line(),
                   "git_revision": bc.git_revision(), "machine": machine,
                   "tag": SHORT_DTYPE[weights], "skipped": reason})


def _make_engine(args: ServerArgs) -> tuple[Engine, str]:
    t0 = time.perf_counter()
    if FLAGS.smoke:
        engine, name = Engine(args, model=bc.tiny_model()), "tiny-random"
    else:
        engine, name = Engine(args), "SmolLM2-135M-Instruct"
    bc.log(f"xlaserve engine ready in {time.perf_counter() - t0:.1f} s "
           "(checkpoint, compile or compile cache)")
    return engine, name


def _single_prompt_ids(engine: Engine) -> list[int]:
    if engine.tokenizer is None:  # the tiny model has none: 37 fixed ids
        return list(range(3, 40))
    msgs = [{"role": "user", "content": FLAGS.single_prompt}]
    return list(engine.tokenizer.apply_chat_template(msgs, tokenize=True))


# ---------------------------------------------------------------- transformers


def reference_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


class HFReference:
    """transformers on the same weights (the GGUF, dequantized) in xlaserve's dtype, on all
    CPU threads: a bf16 xlaserve meets a bf16 transformers."""

    def __init__(self, smoke: bool, cfg: ModelConfig, dtype: str,
                 like: HFReference | None = None) -> None:
        """like: an f32 reference already loaded, whose model is copied in this dtype (the
        values loading the GGUF in it gives: rounded from the same f32; half a minute less
        than a second GGUF load)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        import transformers
        transformers.logging.set_verbosity_error()  # sampling-flag chatter under greedy
        torch.set_num_threads(FLAGS.hf_threads or os.cpu_count() or 1)
        self.torch = torch
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        t0 = time.perf_counter()
        if like is not None:
            model = copy.deepcopy(like.model)
        else:
            model = self._tiny(cfg) if smoke else self._smollm2()
        self.model = model.to(self.dtype).eval()
        self.pad = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
        bc.log(f"transformers {transformers.__version__} model ({dtype}) ready in "
               f"{time.perf_counter() - t0:.1f} s, {torch.get_num_threads()} threads")

    def _smollm2(self) -> Any:
        from transformers import AutoModelForCausalLM

        from runtime.checkpoint import default_gguf_path
        path = default_gguf_path()
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path),
            dtype=self.dtype)

    def _tiny(self, cfg: ModelConfig) -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM
        self.torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings))

    def generate(self, prompts: Sequence[Sequence[int]], n: int) -> tuple[Any, list[float]]:
        """Greedy, exactly n new tokens per row; also the time after each generated step."""
        from transformers import StoppingCriteria, StoppingCriteriaList
        torch = self.torch
        stamps: list[float] = []

        class _Clock(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                min_new_tokens=n, do_sample=False, pad_token_id=self.pad,
                stopping_criteria=StoppingCriteriaList([_Clock()]))
        return out[:, ids.shape[1]:], stamps

    def throughput(self, prompts: list[list[int]], batch: int, n: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        made = 0
        for i in range(0, len(prompts), batch):
            out, _ = self.generate(prompts[i:i + batch], n)
            made += out.numel()
        return {"batch_size": batch,
                **bc.throughput_record(time.perf_counter() - t0, sum(map(len, prompts)), made)}

    def ttft(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        _, stamps = self.generate([ids], 1)
        return stamps[0] - t0

    def single(self, ids: list[int], n: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        out, stamps = self.generate([ids], n)
        toks = out[0].tolist()
        return {"prompt_tokens": len(ids), "new_tokens": len(toks), "ttft_s": stamps[0] - t0,
                "e2e_s": stamps[-1] - t0,
                "decode_tok_s": (len(toks) - 1) / (stamps[-1] - stamps[0]),
                "output_ids": toks}


# ---------------------------------------------------------------- one round


def throughput_flops(cfg: ModelConfig, w: Workload) -> float:
    """Useful FLOPs of the throughput run: each prompt's prefill (logits for its last token
    only: that is where the first new token comes from), then output_len - 1 decode steps
    (the last new token is never fed back)."""
    rows = [bc.RowWork(0, w.input_len)]
    rows += [bc.RowWork(w.input_len + j, 1) for j in range(w.output_len - 1)]
    return w.num_prompts * bc.step_flops(cfg, rows)


def run_round(r: int, xla: dict[str, Engine], hf: dict[str, HFReference], w: Workload,
              single_ids: list[int], llama: offline_peers.LlamaPeers | None,
              llama_pts: dict[str, tuple[int, ...]],
              xla_pts: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """One round: every xlaserve dtype, then transformers in each, then llama-server, on
    the same prompts. "xlaserve" and "transformers" hold a record per dtype (_view splits
    them into one round per dtype)."""
    cfg = next(iter(xla.values())).model_cfg
    rec: dict[str, Any] = {"round": r, "load_average": bc.load_average()}
    roof = bc.measure_roofline(small=FLAGS.smoke)
    rec["roofline"] = roof.to_json()
    bc.log(f"round {r}: roofline {roof.matmul_gflops:.1f} GFLOP/s, "
           f"{roof.mem_read_gbps:.1f} GB/s; load {rec['load_average']}")
    prompts = w.prompts(FLAGS.seed + r, cfg.vocab_size)
    pre_ids = np.random.default_rng(FLAGS.seed + 5000 + r).integers(
        3, cfg.vocab_size, w.prefill_len).tolist()
    # The point at --num_prompts concurrent is the throughput run itself (its prompts, and
    # for xlaserve its measurement): transformers' batch of that size meets the same load.
    sweep = {c: prompts if c == w.num_prompts
             else w.prompts(FLAGS.seed + 1000 * (r + 1) + c, cfg.vocab_size, c)
             for c in w.concurrency}
    singles = _single_streams(r, xla, llama, w, single_ids)
    rec["xlaserve"] = {d: {"single": singles["xlaserve", d],
                           **_xla_round(f"round {r}: xlaserve {d}", engine, roof, w, prompts,
                                        pre_ids, {c: ps for c, ps in sweep.items()
                                                  if c in xla_pts[d]})}
                       for d, engine in xla.items()}
    if hf:
        rec["transformers"] = {}
        for d, h in hf.items():
            rec["transformers"][d] = t = _hf_round(f"round {r}: transformers {d}", h, prompts,
                                                   w, single_ids)
            t["prefill"] = _prefill(cfg, roof, h.ttft(pre_ids), w.prefill_len)
    if llama is not None:
        rec["llama_server"] = _llama_round(r, llama, llama_pts, sweep, w)
        for v, lr in rec["llama_server"].items():
            lr["single"] = singles["llama_server", v]
            lr["prefill"] = _prefill(cfg, roof, llama.ttft(v, pre_ids), w.prefill_len)
    return rec


def _single_streams(r: int, xla: dict[str, Engine], llama: offline_peers.LlamaPeers | None,
                    w: Workload, single_ids: list[int]) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> the round's single stream of each xlaserve dtype ("xlaserve", d) and
    llama-server variant ("llama_server", v), interleaved (bc.interleaved_singles)."""
    n = w.single_new_tokens
    contenders = [(("xlaserve", d), f"xlaserve {d}",
                   lambda e=e: bc.xla_single(e, single_ids, n)) for d, e in xla.items()]
    if llama is not None:
        contenders += [(("llama_server", v), f"llama-server {v}",
                        lambda v=v: llama.single(v, single_ids, n)) for v in llama.servers]
    return bc.interleaved_singles(contenders, FLAGS.single_repeats, FLAGS.smoke, f"round {r}: ")


def _xla_round(tag: str, engine: Engine, roof: bc.Roofline, w: Workload,
               prompts: list[list[int]], pre_ids: list[int],
               sweep: dict[int, list[list[int]]]) -> dict[str, Any]:
    """One engine's throughput run, prefill and concurrency sweep."""
    cfg = engine.model_cfg
    x = bc.xla_throughput(engine, prompts, w.output_len)
    x["gflops"] = throughput_flops(cfg, w) / x["wall_s"] / 1e9
    x["frac_compute"] = x["gflops"] / roof.matmul_gflops
    bc.log(f"{tag} {w.num_prompts} requests: {x['output_tok_s']:.1f} output "
           f"tok/s, {x['total_tok_s']:.1f} total tok/s ({x['wall_s']:.1f} s, "
           f"{x['frac_compute']:.1%} of compute roofline)")
    p = _prefill(cfg, roof, engine.generate([pre_ids], bc.greedy(1))[0].meta_info["ttft"],
                 w.prefill_len)
    bc.log(f"{tag} {w.prefill_len}-token prefill: {p['prefill_tok_s']:.1f} "
           f"tok/s ({p['frac_compute']:.1%} of compute roofline)")
    out = {"throughput": x, "prefill": p}
    for c, ps in sweep.items():
        if c == w.num_prompts:  # the throughput run above: the same requests at once
            out[f"c{c}"] = t = dict(x)
        else:
            out[f"c{c}"] = t = bc.xla_throughput(engine, ps, w.output_len)
        bc.log(f"{tag} {c} concurrent: {t['output_tok_s']:.1f} output tok/s")
    return out


def _view(rec: dict[str, Any], dtype: str, cfg: ModelConfig, w: Workload) -> dict[str, Any]:
    """One dtype's round: its xlaserve and transformers records with the shared peers."""
    view = {k: v for k, v in rec.items() if k != "transformers"}
    view["xlaserve"] = rec["xlaserve"][dtype]
    if dtype in rec.get("transformers", {}):
        view["transformers"] = rec["transformers"][dtype]
    _sweep_fractions(view, cfg, w, bc.Roofline(**rec["roofline"]))
    return view


def _prefill(cfg: ModelConfig, roof: bc.Roofline, ttft: float, n: int) -> dict[str, Any]:
    """A fresh n-token prefill's rate (first token's logits included) and its share of the
    matmul probe."""
    flops = bc.step_flops(cfg, [bc.RowWork(0, n)])
    return {"tokens": n, "ttft_s": ttft, "prefill_tok_s": n / ttft,
            "frac_compute": flops / ttft / 1e9 / roof.matmul_gflops}


def _sweep_fractions(rec: dict[str, Any], cfg: ModelConfig, w: Workload,
                     roof: bc.Roofline) -> None:
    """Each sweep point's useful GFLOP/s as a fraction of this round's matmul probe (the
    same FLOPs for every contender: the same model and tokens)."""
    points = [rec["xlaserve"]] + list(rec.get("llama_server", {}).values())
    for p in points:
        for c in w.concurrency:
            t = p.get(f"c{c}")
            if t is None:  # a llama-server variant run at fewer points (--llama_concurrency)
                continue
            flops = throughput_flops(cfg, dataclasses.replace(w, num_prompts=c))
            t["frac_compute"] = flops / t["wall_s"] / 1e9 / roof.matmul_gflops


def llama_points(w: Workload) -> dict[str, tuple[int, ...]]:
    """Each llama-server variant's sweep points: --concurrency, or its --llama_concurrency."""
    try:
        return offline_peers.sweep_points(FLAGS.llama_variants, w.concurrency,
                                          FLAGS.llama_concurrency)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def _steps() -> dict[str, int]:
    """--xla_steps: format -> num_scheduler_steps."""
    out = {}
    for spec in FLAGS.xla_steps:
        d, _, k = spec.partition("=")
        if d not in SHORT_DTYPE or not k.isdigit() or int(k) < 1:
            raise app.UsageError(f"--xla_steps={spec}: want FORMAT=K with FORMAT one of "
                                 f"{sorted(SHORT_DTYPE)} and K >= 1")
        out[d] = int(k)
    return out


def xla_points(w: Workload) -> dict[str, tuple[int, ...]]:
    """Each xlaserve weight format's sweep points: --concurrency, or its --xla_concurrency."""
    try:
        return offline_peers.sweep_points(list(SHORT_DTYPE), w.concurrency,
                                          FLAGS.xla_concurrency, "--xla_concurrency",
                                          "the weight formats")
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def _llama_round(r: int, llama: offline_peers.LlamaPeers, points: dict[str, tuple[int, ...]],
                 sweep: dict[int, list[list[int]]], w: Workload) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in llama.servers:
        rec: dict[str, Any] = {}
        for c, ps in sweep.items():
            if c not in points[v]:
                continue
            rec[f"c{c}"] = t = llama.throughput(v, ps, w.output_len)
            bc.log(f"round {r}: llama-server {v} {c} concurrent: {t['output_tok_s']:.1f} "
                   "output tok/s")
        out[v] = rec
    return out


def _hf_round(tag: str, hf: HFReference, prompts: list[list[int]], w: Workload,
              single_ids: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in w.hf_batch_sizes:
        t = hf.throughput(prompts, b, w.output_len)
        out[f"batch_{b}"] = t
        bc.log(f"{tag} batch {b}: {t['output_tok_s']:.1f} output tok/s, "
               f"{t['total_tok_s']:.1f} total tok/s ({t['wall_s']:.1f} s)")
    s = hf.single(single_ids, w.single_new_tokens)
    out["single"] = s
    bc.log(f"{tag} single stream: {s['decode_tok_s']:.1f} decode tok/s, "
           f"ttft {s['ttft_s'] * 1e3:.0f} ms")
    return out


def warm_up(xla: dict[str, Engine], hf: dict[str, HFReference], single_ids: list[int],
            llama: offline_peers.LlamaPeers | None) -> None:
    """First calls pay one-time costs (page faults on fresh buffers, lazy init in torch);
    keep them out of round 0."""
    for engine in xla.values():
        engine.generate([single_ids, single_ids[::-1]], bc.greedy(4))
    for h in hf.values():
        h.generate([single_ids, single_ids[::-1]], 4)
    for v in llama.servers if llama is not None else ():
        llama.throughput(v, [single_ids, single_ids[::-1]], 4)


def want_llama() -> bool:
    """Whether llama-server runs side by side: asked for, or (auto) built by `make peers`;
    a smoke run compares it only when asked (--llama_server=on). Checked before anything
    slow starts, so a missing peer fails at once."""
    if FLAGS.llama_server == "off" or (FLAGS.llama_server == "auto" and FLAGS.smoke):
        return False
    try:
        if "{llama_server}" in FLAGS.llama_server_cmd:
            llama_peer.find_llama_server()
    except llama_peer.PeerMissing as e:
        if FLAGS.llama_server == "on":
            raise
        bc.log(f"llama-server not compared: {e}")
        return False
    return True


def _longest_request(w: Workload) -> int:
    """Tokens of the longest request any measurement sends (prompt + new tokens). The chat
    template makes the single-stream prompt 37 tokens; 64 leaves room."""
    return max(w.input_len + w.output_len, 64 + w.single_new_tokens, w.prefill_len + 1)


def start_llama(w: Workload) -> offline_peers.LlamaPeers:
    # Each llama-server slot must hold the prefill measurement's prompt too (a 512-token
    # prompt in a 256-token slot is a 400 from llama-server).
    ctx = bc.pow2_at_least(_longest_request(w), 256)
    return offline_peers.LlamaPeers(FLAGS.llama_variants, max(w.concurrency, default=1), ctx,
                                    FLAGS.llama_threads, FLAGS.llama_server_cmd,
                                    FLAGS.checkpoint_cache_dir, Path(FLAGS.out_dir))


# ---------------------------------------------------------------- main


def main(argv: list[str]) -> None:
    del argv
    t_start = time.perf_counter()
    w = _workload()
    # A bad --llama_concurrency, --xla_concurrency or format fails before anything slow.
    llama_pts, xla_pts, _ = llama_points(w), xla_points(w), _steps()
    machine = bc.machine_info()
    bc.log(f"load average {machine['load_average']} on {machine['cpu_count']} CPUs")
    with_llama = want_llama()
    args: dict[str, ServerArgs] = {}
    xla: dict[str, Engine] = {}
    for want in [FLAGS.dtype, *FLAGS.also_dtypes]:
        if want is not None and want not in SHORT_DTYPE:
            raise app.UsageError(f"--dtype / --also_dtypes: {want!r} is not one of "
                                 f"{sorted(SHORT_DTYPE)}")
    hf_names = {d for d in SHORT_DTYPE if d not in QUANTIZED | COMPRESSED}
    if not set(FLAGS.hf_dtypes) <= hf_names:
        raise app.UsageError(f"--hf_dtypes={','.join(FLAGS.hf_dtypes)}: transformers runs in "
                             f"{sorted(hf_names)}")
    formats = [FLAGS.dtype, *FLAGS.also_dtypes]
    skipped = {d: why for d in formats if (why := unavailable(d))}
    if formats[0] in skipped:
        raise app.UsageError(f"--dtype={formats[0]}: {skipped[formats[0]]}")
    for d, why in skipped.items():
        _write_skipped(d, why, machine)
    for want in [d for d in formats if d not in skipped]:
        a = _server_args(w, want)
        engine, name = _make_engine(a)
        d = a.quantization or ("bf16x12" if a.compress_weights else str(engine.runner.cfg.dtype))
        if d in xla:
            raise app.UsageError(f"--also_dtypes repeats {d}, already measured")
        xla[d], args[d] = engine, a
    first = next(iter(xla.values()))
    want_ref = FLAGS.reference == "on" or (FLAGS.reference == "auto" and reference_available())
    hf: dict[str, HFReference] = {}
    hf_formats = [d for d in xla if d in (FLAGS.hf_dtypes or hf_names)]
    if not set(FLAGS.hf_dtypes) <= set(hf_formats):
        raise app.UsageError(f"--hf_dtypes={','.join(FLAGS.hf_dtypes)}: not all of them are "
                             f"measured here ({sorted(xla)})")
    for d in hf_formats if want_ref else ():
        # From an f32 model already loaded, a copy (never up from bf16: that would lose bits).
        hf[d] = HFReference(FLAGS.smoke, first.model_cfg, d, hf.get("float32"))
    if not hf:
        bc.log("transformers not compared (pip install -e '.[reference]' to compare)")
    single_ids = _single_prompt_ids(first)
    bc.log(f"single-stream prompt: {len(single_ids)} tokens")
    llama = start_llama(w) if with_llama else None
    try:
        warm_up(xla, hf, single_ids, llama)
        repeats = 1 if FLAGS.smoke else FLAGS.repeats
        rounds = [run_round(r, xla, hf, w, single_ids, llama, llama_pts, xla_pts)
                  for r in range(repeats)]
    finally:
        if llama is not None:
            llama.stop()
    machine["load_average_end"] = bc.load_average()
    cfg = first.model_cfg
    for k, d in enumerate(xla):
        # The first dtype is bench_offline.*; each further one
        # bench_offline_<bf16|f32|int8>.*, with the same peer measurements.
        tag = "" if k == 0 else SHORT_DTYPE[d]
        engine = xla[d]
        dtype = str(engine.runner.cfg.dtype)
        model = bc.model_summary(cfg, name, dtype, d if d != dtype else None,
                                 bc.decode_weight_bytes(engine))
        result = {"script": "bench_offline", "command": bc.command_line(),
                  "git_revision": bc.git_revision(), "machine": machine,
                  "model": model, "tag": tag,
                  "engine_args": dataclasses.asdict(args[d]), "workload": dataclasses.asdict(w),
                  "flops_per_output_token": throughput_flops(cfg, w) / (w.num_prompts
                                                                         * w.output_len),
                  "transformers_threads": hf[d].torch.get_num_threads() if d in hf else None,
                  "transformers_dtype": d if d in hf else None,
                  "llama_server": llama.info() if llama else None,
                  "skipped_formats": skipped,
                  "rounds": [_view(rec, d, cfg, w) for rec in rounds]}
        result["summary"] = osum.summarize(result["rounds"], w, FLAGS.smoke,
                                           result["model"]["weight_bytes"], d,
                                           transformers_asked=d in hf_formats)
        result["wall_s"] = time.perf_counter() - t_start
        bc.log(f"xlaserve {d}:")
        osum.print_summary(result["summary"])
        stem = "bench_offline" + (f"_{tag}" if tag else "")
        bc.write_json(FLAGS.out_dir, f"{stem}.json", result)
        op.plot(result, FLAGS.out_dir, f"{stem}.png")


if __name__ == "__main__":
    app.run(main)
