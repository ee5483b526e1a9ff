"""Engine: the offline API. Owns a Scheduler (host) and a ModelRunner (device).

    engine = Engine(ServerArgs())
    out = engine.generate(["What is the capital of France?"], SamplingParams(temperature=0))

`step()` is one scheduler iteration. With overlap scheduling (the default) it launches
batch N+1 before reading back batch N, so host scheduling hides behind device work.
`engine.trace` (runtime/exec_trace.py) records every step's path and timing, and each
finished request's meta_info says which steps it took part in.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax

from models.config import ModelConfig
from models.forward_mode import ForwardMode
from runtime import multihost
from runtime.batch_builder import BucketShape
from runtime.bucket_plan import cost_key
from runtime.config import CacheConfig, SchedulerConfig, ServerArgs
from runtime.dp_attention import DPScheduler
from runtime.engine_info import EngineInfo
from runtime.engine_setup import RunnerSetup, load_draft_model, load_model, platform
from runtime.exec_trace import ExecutionTrace, StepRecord
from runtime.grammar import GrammarCache, RequestGrammar
from runtime.model_runner import ModelRunner, PendingStep
from runtime.multiplexing import IntervalPolicy, MultiplexLoop, SplitLauncher, Splitter
from runtime.paths import LaunchedForward
from runtime.paths.draft import DraftPath, draft_cost_key
from runtime.paths.spec import verify_cost_key
from runtime.policy_setup import build_policy
from runtime.request import Req, SamplingParams
from runtime.schedule_batch import ScheduleBatch
from runtime.scheduler import ReqEvent, Scheduler, SchedulerStats
from runtime.spec_decode import SpecDecoding
from runtime.split_prefill import SplitPrefill
from runtime.traced_launch import TracedStep, launch_traced, read_back

if TYPE_CHECKING:  # imported with a tokenizer only: token-id engines run without `tokenizers`
    from runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestOutput:
    """What a request has produced so far; `delta` is the text new since the last event."""

    rid: str
    text: str
    output_ids: list[int]
    finished: bool
    delta: str = ""
    meta_info: dict[str, Any] = dataclasses.field(default_factory=dict)


class _Tracked:
    """Engine-side state of one request: its detokenizer and timestamps."""

    def __init__(self, req: Req, tokenizer: Tokenizer | None) -> None:
        self.req = req
        self.detok = None
        if tokenizer is not None:
            from runtime.tokenizer import IncrementalDetokenizer

            self.detok = IncrementalDetokenizer(tokenizer, req.sampling.skip_special_tokens)
        self.created = time.perf_counter()
        self.first_token: float | None = None
        self.emitted = ""  # text already handed out by stream events

    def visible_text(self) -> str:
        """Text that is safe to show: cut at a matched stop string; while running, hold
        back a tail that could still become the start of a stop string."""
        if self.detok is None:
            return ""
        text = self.detok.text + (self.detok.flush() if self.req.finished else "")
        if self.req.finished and self.req.finish_reason is not None:
            return self.req.finish_reason.trim(text)
        hold = max((len(s) - 1 for s in self.req.sampling.stop), default=0)
        return text[:len(text) - hold] if hold else text


class StepLoop:
    """The plain engine loop: one scheduler batch per iteration. With overlap it launches
    batch N+1 before it reads back batch N, so host scheduling hides behind device work.
    Every step goes into `trace`.

    With `splitter` (the split-prefill path) it also runs the prefill policy's layer
    intervals: a step the policy sized as "interval" launches its decode rows as a DECODE
    step and starts a split prefill of its extend rows; each later iteration launches a
    DECODE step of the other streams and the next interval, as many layers as the policy
    fits beside it (PrefillPolicy.interval_layers), until the last one and its sampling."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, overlap: bool,
                 trace: ExecutionTrace, splitter: Splitter | None = None) -> None:
        self.scheduler, self.runner, self.overlap = scheduler, runner, overlap
        self.trace = trace
        self.launcher = (None if splitter is None
                         else SplitLauncher(runner, splitter, trace))
        self.split: SplitPrefill | None = None
        self._pending: list[TracedStep] = []

    @property
    def has_pending(self) -> bool:
        return bool(self._pending) or self.split is not None

    def step(self) -> list[ReqEvent]:
        t0 = time.perf_counter()
        if self.split is not None:
            return self._split_step(t0)
        batch = self.scheduler.next_batch()
        if batch is not None and batch.decision is not None and batch.decision.path == "interval":
            events: list[ReqEvent] = []
            if self._pending and _constrained(batch):  # as _split_step's
                events, self._pending = self._process(self._pending), []
            return events + self._settle(self._start_split(batch, t0))
        if batch is not None and self._pending and _constrained(batch):
            return self._step_deferred(batch, t0)
        return self._settle([] if batch is None
                            else [launch_traced(self.trace, self.runner, batch, t0)])

    def _settle(self, launched: list[TracedStep]) -> list[ReqEvent]:
        """Read back the steps due: with overlap the previous iteration's, else these."""
        if self.overlap:
            ready, self._pending = self._pending, launched
        else:
            ready = launched
        return self._process(ready)

    def _process(self, done: list[TracedStep]) -> list[ReqEvent]:
        events: list[ReqEvent] = []
        for step in done:
            events += self.scheduler.process_results(step.pending.batch,
                                                     read_back(self.trace, step))
            self.trace.processed(step.record, time.perf_counter())
            self._observe(step.record)
        return events

    def _observe(self, rec: StepRecord) -> None:
        """Tell the prefill policy what a DECODE step, or a MIXED step it sized, took on
        the device: known where the host waited for it (else the device finished earlier
        by an unknown amount) and the trace placed its start."""
        policy, decision = getattr(self.scheduler, "policy", None), rec.decision
        if (policy is None or not rec.waited or rec.ready is None
                or rec.device_start is None):
            return
        took = rec.ready - rec.device_start
        if rec.mode == ForwardMode.DECODE.value:
            policy.observe_decode(took)
        elif (rec.mode == ForwardMode.MIXED.value and decision is not None
              and decision.predicted_ms is not None):
            policy.observe(decision.predicted_ms / 1e3 / decision.scale, took)

    def _start_split(self, batch: ScheduleBatch, t0: float) -> list[TracedStep]:
        """The policy's "interval" step: its decode rows as a DECODE step, and the first
        interval of a split prefill of its extend rows (held by the scheduler)."""
        assert self.launcher is not None, "an interval decision needs the split programs"
        splitter = self.launcher.splitter
        prefill = ScheduleBatch(ForwardMode.SPLIT_PREFILL, batch.extend_rows, [],
                                decision=batch.decision)
        if not splitter.can_split(prefill):
            raise RuntimeError(f"the prefill policy's interval has no split program for "
                               f"{self.runner.bucket_for(prefill)}")
        self.split = splitter.start_split(prefill)
        decode = ScheduleBatch(ForwardMode.DECODE, [], batch.decode_rows)
        return self._advance(decode, t0)

    def _split_step(self, t0: float) -> list[ReqEvent]:
        """An iteration with a split prefill in flight: a DECODE step of the other
        streams (if any) and the next interval."""
        decode = self.scheduler.next_decode()
        events: list[ReqEvent] = []
        if decode is not None and _constrained(decode):
            # Its rows' grammar masks need the tokens still in flight: read them first.
            events, self._pending = self._process(self._pending), []
        return events + self._settle(self._advance(decode, t0))

    def _advance(self, decode: ScheduleBatch | None, t0: float) -> list[TracedStep]:
        """Launch `decode` and the split's next interval beside it (all its layers when
        nothing decodes); after the last, its sampling, and release its requests."""
        split, launcher, policy = self.split, self.launcher, self.scheduler.policy
        assert split is not None and launcher is not None and policy is not None
        launched = []
        if decode is None:
            launcher.run_rest(split)
        else:
            launched.append(launch_traced(self.trace, self.runner, decode, t0))
            row = split.batch.extend_rows[0]
            want = policy.interval_layers(split.remaining, self.runner.step_cost(decode),
                                          launcher.splitter.layer_cost(split),
                                          row.start_pos, len(row.input_ids))
            launcher.run_up_to(split, want, launched[0].record.step)
        if split.done:
            self.split = None
            launched.append(launcher.finish(split))
            self.scheduler.release_prefill()
        return launched

    def _step_deferred(self, batch: ScheduleBatch, t0: float) -> list[ReqEvent]:
        """Overlap with grammar rows: their masks need the tokens of the step in flight.
        Launch this batch's forward, consume the previous step's tokens while it runs,
        then launch its sampling with the masks (SGLang's order)."""
        fwd = self.runner.launch_forward(batch)
        events = self._process(self._pending)
        self._pending = [launch_traced(self.trace, _SampleLauncher(self.runner, fwd), batch,
                                       t0)]
        return events


class _SampleLauncher:
    """launch_traced's runner for a batch whose forward is already launched."""

    def __init__(self, runner: ModelRunner, fwd: LaunchedForward) -> None:
        self._runner, self._fwd = runner, fwd

    @property
    def compiles_after_warmup(self) -> int:
        return self._runner.compiles_after_warmup

    def launch(self, batch: ScheduleBatch) -> PendingStep:
        return self._runner.launch_sample(self._fwd)

    def bucket_for(self, batch: ScheduleBatch) -> BucketShape:
        return self._fwd.shape


def _spec_decoding(args: ServerArgs, runner: ModelRunner) -> SpecDecoding | None:
    """The scheduler's speculative decoding (--speculative_algorithm), over the runner's
    TARGET_VERIFY programs, switched by the runner's measured decode and verify costs (a
    draft model's DRAFT_DECODE step counted with its verify step)."""
    if not args.speculative_algorithm:
        return None
    k, buckets = runner.cfg.speculative_num_draft_tokens, runner.cfg.decode_buckets
    if k != args.speculative_num_draft_tokens:
        raise ValueError(f"speculative_num_draft_tokens={args.speculative_num_draft_tokens} "
                         "needs a runner compiled with RunnerConfig."
                         f"speculative_num_draft_tokens={args.speculative_num_draft_tokens} "
                         f"(it has {k})")

    drafter = None
    if args.speculative_algorithm == "standalone":
        drafter = runner.paths.get("draft")
        if drafter is None:
            raise ValueError("--speculative_algorithm=standalone needs a runner built with "
                             "the draft model (ModelRunner(draft=...))")

    def costs(rows: int) -> tuple[float, float] | None:
        b = next(b for b in buckets if b >= rows)
        decode_s = runner.costs.get(cost_key(ForwardMode.DECODE, BucketShape(0, 0, b, 0)))
        verify_s = runner.costs.get(verify_cost_key(b))
        if drafter is not None and verify_s is not None:  # the draft's k steps come first
            draft_s = runner.costs.get(draft_cost_key(b))
            verify_s = None if draft_s is None else verify_s + draft_s
        return None if decode_s is None or verify_s is None else (decode_s, verify_s)

    return SpecDecoding(k, buckets[-1], drafter=drafter, costs=costs)


def _constrained(batch: ScheduleBatch) -> bool:
    return any(r.req.grammar is not None for r in batch.rows)


class Engine:
    """Continuous-batching generation engine (offline API; the HTTP server wraps it).

    Its loop is one object chosen at start-up: StepLoop, or with --enable_split_prefill /
    --enable_multiplexing the MultiplexLoop of runtime/multiplexing.py. In the StepLoop the
    scheduler puts decode first by default (`policy`, runtime/prefill_policy.py)."""

    def __init__(self, args: ServerArgs, *, model: tuple[ModelConfig, dict] | None = None,
                 tokenizer: Tokenizer | None = None, runner: ModelRunner | None = None,
                 draft_model: tuple[ModelConfig, dict] | None = None) -> None:
        self.args = args
        if args.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir",
                              os.path.expanduser(args.compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        # A multi-process mesh (runtime/multihost.py): this is rank 0, the followers replay
        # its runner's calls.
        self.mirror: multihost.StepMirror | None = None
        if runner is None:
            multihost.initialize(args)
            if args.node_rank != 0:
                raise ValueError(f"node_rank={args.node_rank}: only rank 0 runs an engine; "
                                 "the other ranks run multihost.run_follower")
            args.validate(platform(args))  # what this machine cannot run, before loading
            leader = multihost.Leader(args) if args.nnodes > 1 else None
            if model is None:
                model_cfg, params, tokenizer = load_model(args)
            else:
                model_cfg, params = model
            if draft_model is None:
                draft_model = load_draft_model(args)
            # The draft's weights are placed by now, and its pool is sized beside the
            # target's.
            setup = RunnerSetup.from_args(args, model_cfg,
                                          None if draft_model is None else draft_model[0])
            if leader is not None:
                leader.broadcast(("setup", setup))
            runner = setup.build(params, draft=draft_model)
            if leader is not None:
                self.mirror = multihost.StepMirror(leader)
                self.mirror.attach(runner)
        elif args.nnodes > 1:
            raise ValueError("a multi-process engine builds its own runner (runner=None)")
        self.runner = runner
        self.model_cfg = runner.model_cfg
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_ids if tokenizer else self.model_cfg.eos_token_ids
        # The scheduler may use fewer pages than the runner's pool holds (max_total_tokens),
        # so one compiled runner serves engines of any smaller pool size. Under data-parallel
        # attention each rank schedules its own share of the pool and of the requests.
        dp = runner.dp
        if args.dp != dp:
            raise ValueError(f"dp={args.dp}, but the runner's mesh has dp={dp}")
        num_pages = runner.cache_cfg.num_pages // dp
        if args.max_total_tokens is not None:
            num_pages = min(num_pages, args.max_total_tokens // (dp * args.page_size) + 1)
        config = dataclasses.replace(SchedulerConfig.from_server_args(
            args, CacheConfig(page_size=runner.cache_cfg.page_size, num_pages=num_pages),
            runner.max_seq_len, dp), sliding_window=self.model_cfg.uniform_window)
        if runner.ring_pages and not config.disable_prefix_cache:
            # A cached prefix's sliding-layer K/V lived in its request's ring, overwritten
            # past the window and reused by the next request of that slot: nothing to hit.
            logger.info("sliding-window rings: prefix cache off")
            config = dataclasses.replace(config, disable_prefix_cache=True)
        decode_fn = tokenizer.decode if tokenizer else None
        # Decode first by default (runtime/prefill_policy.py), sized from step costs
        # measured now; None: prefill first, or the path a flag picked.
        self.policy = build_policy(args, runner)
        self.spec = _spec_decoding(args, runner)
        self.scheduler: Scheduler | DPScheduler = (
            Scheduler(config, eos_token_ids=eos, decode_fn=decode_fn, policy=self.policy,
                      spec=self.spec)
            if dp == 1 else DPScheduler(config, dp, eos, decode_fn))
        self.trace = ExecutionTrace(args.trace_buffer_steps)
        if self.spec is not None and isinstance(self.spec.drafter, DraftPath):
            self.spec.drafter.trace = self.trace  # its launches are steps of this engine
        self.trace.policy = None if self.policy is None else self.policy.to_json()
        self._profile_dir: str | None = None
        self._profile_start = 0.0
        overlap = not args.disable_overlap_schedule
        if args.num_scheduler_steps not in (1, runner.cfg.num_scheduler_steps):
            raise ValueError(f"num_scheduler_steps={args.num_scheduler_steps} needs a runner "
                             "compiled with RunnerConfig.num_scheduler_steps="
                             f"{args.num_scheduler_steps} (it has "
                             f"{runner.cfg.num_scheduler_steps})")
        if args.enable_multiplexing or args.enable_split_prefill:
            splitter = runner.paths.get("split_prefill")
            if splitter is None:
                raise ValueError("split prefill / multiplexing need a runner compiled with "
                                 "RunnerConfig.enable_split_prefill")
            policy = IntervalPolicy(args.split_prefill_layers,
                                    args.multiplex_itl_target_ms / 1000,
                                    args.multiplex_decode_slowdown,
                                    args.multiplex_fill_fraction,
                                    args.multiplex_max_stall_ms / 1000)
            self.loop: StepLoop | MultiplexLoop = MultiplexLoop(
                self.scheduler, runner, splitter, policy, overlap,
                interleave=args.enable_multiplexing,
                fused=runner.paths.get("fused") if args.multiplex_fused else None,
                trace=self.trace)
        else:
            # The policy's layer intervals run on the split-prefill path where the runner
            # compiled it for them (RunnerConfig.policy_split_tokens).
            splitter = (runner.paths.get("split_prefill")
                        if self.policy is not None and self.policy.split is not None else None)
            self.loop = StepLoop(self.scheduler, runner, overlap, self.trace, splitter)
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.grammars = (GrammarCache(tokenizer.backend.to_str(), self.model_cfg.vocab_size,
                                      eos) if tokenizer is not None else None)
        self.info = EngineInfo.build(args, self.model_cfg, runner.cfg, runner.max_seq_len,
                                     runner.num_executables, self.scheduler.config, tokenizer)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                    rid: str | None = None) -> str:
        """Queue a prompt (text, tokenized without special tokens added beyond the model's
        BOS rule, or token ids). Raises ValueError for invalid input."""
        sampling = sampling or SamplingParams()
        sampling.validate(self.model_cfg.vocab_size)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass input_ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
            bad = [i for i in ids if not 0 <= i < self.model_cfg.vocab_size]
            if bad:
                raise ValueError(f"input_ids {bad[:5]} outside [0, {self.model_cfg.vocab_size})")
        rid = rid or f"req-{next(self._ids)}"
        req = Req(rid=rid, prompt_ids=ids, sampling=sampling,
                  grammar=self._grammar(sampling))
        self.scheduler.add(req)
        tracked = self._tracked[rid] = _Tracked(req, self.tokenizer)
        self.trace.add_request(rid, tracked.created)
        return rid

    def _grammar(self, sampling: SamplingParams) -> RequestGrammar | None:
        """The request's matcher (GrammarError, a ValueError, if its constraint can't
        compile); a cache hit when the server compiled it beforehand."""
        spec = sampling.grammar
        if spec is None:
            return None
        if self.grammars is None:
            raise ValueError("constrained decoding needs a tokenizer")
        return self.grammars.matcher(spec)

    def abort(self, rid: str) -> None:
        """Abort a request wherever it is; its pages are freed at once."""
        req = self.scheduler.abort(rid)
        if self.spec is not None and req is not None:
            self.spec.forget(req)
        if self._tracked.pop(rid, None) is not None:
            self.trace.finish_request(rid, time.perf_counter())

    # ---- the loop ------------------------------------------------------------------------

    def has_work(self) -> bool:
        return not self.scheduler.is_idle() or self.loop.has_pending

    def step(self) -> list[RequestOutput]:
        """One loop iteration: launch its work, read back the previous one (overlap) or
        this one, and turn the events into outputs."""
        outputs = [self._output(e) for e in self.loop.step()]
        if not self.has_work():
            self.trace.end_busy_period()
        return outputs

    def _output(self, event: ReqEvent) -> RequestOutput:
        t = self._tracked[event.req.rid]
        req = event.req
        now = time.perf_counter()
        if event.new_token_ids and t.first_token is None:
            t.first_token = now
        if t.detok is not None and event.new_token_ids:
            t.detok.feed(event.new_token_ids)
        text = t.visible_text()
        delta, t.emitted = text[len(t.emitted):], text
        meta: dict[str, Any] = {"prompt_tokens": len(req.prompt_ids),
                                "completion_tokens": len(req.output_ids),
                                "cached_tokens": req.cached_tokens,
                                "prefill_intervals": req.prefill_intervals}
        if event.finished:
            self._tracked.pop(req.rid, None)
            spec = self.spec.forget(req) if self.spec is not None else None
            if spec is not None:
                meta.update(spec.to_json())
            meta["retracted"] = req.num_retractions > 0
            meta["num_retractions"] = req.num_retractions
            meta.update(self.trace.finish_request(
                req.rid, now, first_token=t.first_token, num_retractions=req.num_retractions,
                cached_tokens=req.cached_tokens))
            reason = req.finish_reason
            meta["finish_reason"] = reason.to_json() if reason else None
            meta["e2e_latency"] = now - t.created
            if t.first_token is not None:
                meta["ttft"] = t.first_token - t.created
            if req.sampling.logprobs or req.sampling.top_logprobs:
                meta["output_token_logprobs"] = list(req.output_logprobs)
                meta["output_top_logprobs"] = list(req.output_top_logprobs)
        return RequestOutput(rid=req.rid, text=text, output_ids=list(req.output_ids),
                             finished=event.finished, delta=delta, meta_info=meta)

    # ---- what changes while it runs ----------------------------------------------------

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    @property
    def compiles_after_warmup(self) -> int:
        return self.runner.compiles_after_warmup

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests run or wait."""
        return self.scheduler.flush_cache()

    # ---- profiling -----------------------------------------------------------------------

    @property
    def profiling(self) -> bool:
        return self._profile_dir is not None

    def start_profile(self, output_dir: str) -> None:
        """Start a jax.profiler trace into output_dir (opens in TensorBoard / Perfetto).
        ValueError if one is already running or the profiler refuses."""
        if self._profile_dir is not None:
            raise ValueError(f"a profile is already running (into {self._profile_dir})")
        os.makedirs(output_dir, exist_ok=True)
        try:
            jax.profiler.start_trace(output_dir)
        except RuntimeError as e:  # e.g. another profile in this process
            raise ValueError(f"cannot start the profiler: {e}") from e
        self._profile_dir = output_dir
        self._profile_start = time.perf_counter()

    def stop_profile(self) -> tuple[str, float]:
        """Stop the profile; returns its directory and start time (perf_counter)."""
        if self._profile_dir is None:
            raise ValueError("no profile is running: start one first")
        out, self._profile_dir = self._profile_dir, None
        try:
            jax.profiler.stop_trace()
        except RuntimeError as e:  # stopped behind our back (another user in this process)
            raise ValueError(f"cannot stop the profiler: {e}") from e
        return out, self._profile_start

    # ---- conveniences --------------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts to completion (continuously batched) and return their outputs."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        rids = [self.add_request(p, s) for p, s in zip(prompts, sampling, strict=True)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(rids):
            for out in self.step():
                if out.finished:
                    done[out.rid] = out
        return [done[r] for r in rids]

    def stream(self, prompt: str | Sequence[int],
               sampling: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield this request's outputs as they arrive (other requests keep running)."""
        rid = self.add_request(prompt, sampling)
        while True:
            for out in self.step():
                if out.rid == rid:
                    yield out
                    if out.finished:
                        return

    def run_until_idle(self) -> None:
        while self.has_work():
            self.step()

    def close(self) -> None:
        """Release what outlives a Python object: on a multi-process mesh, the followers
        (they exit). Idempotent; the engine takes no steps after it."""
        if self.mirror is not None:
            self.mirror.close()
