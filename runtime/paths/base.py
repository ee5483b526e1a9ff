"""The execution-path protocol: what ModelRunner asks of each way a step can run.

A path (runtime/paths/*.py) owns its executables (their programs stay in the path's own
module: runtime/split_prefill.py, fused_step.py, tbo_step.py, multi_step.py,
dp_attention.py) and the launches that call them. ModelRunner owns the device state
(weights, KV pool, sampler slots), the shared sampler and the compile budget, and
plans, lowers, installs and launches by looping over its enabled paths
(runtime/paths/__init__.py picks them from RunnerConfig and the mesh), so it names none.

The verbs, each optional (this base class's defaults do nothing):
  names / plan_parts   the executables it compiles, for the count and the budget check
  lowerings            (name, lower) of each, over the runner's abstract device state
  install              take the compiled executables by name
  sampler_rows         row counts its logits come in (one shared sampler program each)
  bucket_for           the bucket of a batch it claims
  launch               run a batch it claims whole (forward and sampling): a PendingStep
  forward              run a batch's forward it claims: a LaunchedForward for the
                       shared sampler (an engine loop may launch that half later)
  after_warmup         work once everything is compiled (e.g. seed measured costs)
Other verbs are a path's own (the split-prefill path's start / interval / finish, which
the multiplexing loop calls on it directly).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from runtime.batch_builder import BucketShape
from runtime.executable_budget import PlanPart
from runtime.schedule_batch import BatchRow, ScheduleBatch

if TYPE_CHECKING:
    from runtime.model_runner import ModelRunner
    from runtime.runner_sampling import PendingStep

Lowering = tuple[str, Callable[[], Any]]


@dataclasses.dataclass
class LaunchedForward:
    """A launched forward whose sampling is not launched yet (logits stay on device).

    padded: the BatchRow of each logits row (None: padding); order: the padded index of
    each real row in result order; shape: the padded step the trace shows; cost: the
    DeviceCosts key its device time is charged to (None: not measured); detail: the
    path's own trace record (StepRecord.detail), e.g. a two-batch-overlap split."""

    batch: ScheduleBatch
    shape: BucketShape
    logits: jax.Array  # [len(padded), V]
    padded: list[BatchRow | None]
    order: np.ndarray
    cost: str | None = None
    detail: Any = None


class ExecPath:
    """One execution path of a runner (see the module docstring); `runner` is the
    ModelRunner whose device state its launches update."""

    name = ""
    # The path's compiled programs (its module's *Executables: names, install(compiled)),
    # if it keeps them in one.
    programs: Any = None

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    def names(self) -> list[str]:
        return [] if self.programs is None else self.programs.names

    def plan_parts(self) -> list[PlanPart]:
        return []

    def lowerings(self, params: Any, kv: Any, state: Any) -> Iterable[Lowering]:
        return ()

    def install(self, compiled: Mapping[str, Callable]) -> None:
        if self.programs is not None:
            self.programs.install(compiled)

    def sampler_rows(self) -> set[int]:
        return set()

    def bucket_for(self, batch: ScheduleBatch) -> BucketShape | None:
        return None

    def launch(self, batch: ScheduleBatch) -> PendingStep | None:
        return None

    def forward(self, batch: ScheduleBatch) -> LaunchedForward | None:
        return None

    def after_warmup(self) -> None:
        pass
