"""The execution paths a runner's RunnerConfig and mesh turn on, in dispatch order: the
first path that claims a batch runs it (a speculative TARGET_VERIFY batch, a multi-step
batch, then a two-batch-overlap
split, then a data-parallel step, then the plain step, which takes every batch). The
split-prefill and fused paths claim none: the multiplexing loop calls their own verbs; nor
does the draft-model path, whose drafts the scheduler asks for (runtime/paths/draft.py).
The protocol is runtime/paths/base.py.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from models.config import ModelConfig
from runtime.config import CacheConfig, RunnerConfig
from runtime.paths.base import ExecPath, LaunchedForward
from runtime.paths.dp import DPPath, check_dp
from runtime.paths.draft import DraftPath
from runtime.paths.fused import FusedPath
from runtime.paths.multi import MultiStepPath
from runtime.paths.plain import PlainPath
from runtime.paths.spec import SpecPath
from runtime.paths.split import SplitPath
from runtime.paths.tbo import TboPath, check_tbo

__all__ = ["ExecPath", "LaunchedForward", "check_paths", "enabled_paths"]


def check_paths(model_cfg: ModelConfig, cfg: RunnerConfig, cache: CacheConfig,
                mesh: Mesh | None) -> None:
    """What the enabled paths need of the model, flags and mesh, as start-up errors
    raised before any weight or pool is placed."""
    dp = 1 if mesh is None else mesh.shape.get("dp", 1)
    if dp > 1:
        check_dp(dp, cfg, cache)
    if cfg.enable_two_batch_overlap:
        check_tbo(model_cfg, cfg, mesh)


def enabled_paths(runner: Any) -> dict[str, ExecPath]:
    """The runner's paths by name, in dispatch order."""
    cfg = runner.cfg
    split = SplitPath(runner) if cfg.enable_split_prefill else None
    paths = [SpecPath(runner) if cfg.speculative_num_draft_tokens else None,
             MultiStepPath(runner) if cfg.num_scheduler_steps > 1 else None,
             TboPath(runner) if cfg.enable_two_batch_overlap else None,
             DPPath(runner) if runner.dp > 1 else None, PlainPath(runner), split,
             FusedPath(runner, split) if cfg.multiplex_fused else None,
             DraftPath(runner) if getattr(runner, "draft_model", None) is not None else None]
    return {p.name: p for p in paths if p is not None}
