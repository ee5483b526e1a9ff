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
from models.kv_pool import ring_pages_for
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

__all__ = ["ExecPath", "LaunchedForward", "check_paths", "enabled_paths", "ring_pages"]


def check_paths(model_cfg: ModelConfig, cfg: RunnerConfig, cache: CacheConfig,
                mesh: Mesh | None) -> None:
    """What the enabled paths need of the model, flags and mesh, as start-up errors
    raised before any weight or pool is placed."""
    dp = 1 if mesh is None else mesh.shape.get("dp", 1)
    if cfg.sliding_window_rings:
        check_rings(model_cfg, cfg, mesh)
    if dp > 1:
        check_dp(dp, cfg, cache)
    if cfg.enable_two_batch_overlap:
        check_tbo(model_cfg, cfg, mesh)


def check_rings(model_cfg: ModelConfig, cfg: RunnerConfig, mesh: Mesh | None) -> None:
    """Sliding-window rings (models/kv_pool.py) run on the plain, multi-step and
    speculative-verify paths, on one device or a tp mesh (models/kv_pool.with_rings); the
    others write the pool layer by layer or through their own programs and would not
    address the rings, so they are refused rather than run on the wrong pages."""
    if not model_cfg.has_window or model_cfg.uniform_window:
        raise ValueError("sliding_window_rings is for models with sliding and global layers "
                         f"(Gemma 3, gpt-oss); {model_cfg.architecture} has "
                         + ("every layer sliding (its pages outside the window are freed "
                            "already)" if model_cfg.uniform_window else "no sliding window"))
    if model_cfg.mla is not None:
        raise ValueError("sliding_window_rings: not for multi-head latent attention")
    off = [name for name, on in (
        ("dp / ep meshes", mesh is not None and mesh.shape.get("dp", 1)
         * mesh.shape.get("ep", 1) > 1),
        ("enable_split_prefill / multiplexing", cfg.enable_split_prefill),
        ("multiplex_fused", cfg.multiplex_fused),
        ("enable_two_batch_overlap", cfg.enable_two_batch_overlap)) if on]
    if off:
        raise ValueError("sliding_window_rings runs the plain, multi-step and verify steps, "
                         f"one device or tp; not with {', '.join(off)} yet")


def ring_pages(model_cfg: ModelConfig, cfg: RunnerConfig, page_size: int) -> int:
    """Pages of one sliding-window ring (0: no rings): the window and the most tokens
    one row can feed in a step (the largest extend bucket, or a verify row's)."""
    if not cfg.sliding_window_rings:
        return 0
    longest = max([*cfg.extend_token_buckets, *(s[0] for s in cfg.mixed_shapes),
                   cfg.speculative_num_draft_tokens + 1])
    return ring_pages_for(max(model_cfg.layer_windows), longest, page_size)


def enabled_paths(runner: Any) -> dict[str, ExecPath]:
    """The runner's paths by name, in dispatch order."""
    cfg = runner.cfg
    split = (SplitPath(runner) if cfg.enable_split_prefill or cfg.policy_split_tokens
             else None)
    paths = [SpecPath(runner) if cfg.speculative_num_draft_tokens else None,
             MultiStepPath(runner) if cfg.num_scheduler_steps > 1 else None,
             TboPath(runner) if cfg.enable_two_batch_overlap else None,
             DPPath(runner) if runner.dp > 1 else None, PlainPath(runner), split,
             FusedPath(runner, split) if cfg.multiplex_fused else None,
             DraftPath(runner) if getattr(runner, "draft_model", None) is not None else None]
    return {p.name: p for p in paths if p is not None}
