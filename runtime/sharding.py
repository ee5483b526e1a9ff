"""Device mesh and the logical-axis rules that place each parameter on it.

Every parameter dimension gets a logical name (`vocab`, `q_heads`, `mlp`, ...); one
rules table maps logical names to mesh axes. Tensor parallelism is Megatron style:
wq/wk/wv/w_gate/w_up are column-parallel (split on their output dim), wo/w_down are
row-parallel (split on their input dim), embed/lm_head split on vocab, norms
replicated. Parameters are replicated across `dp`. MoE expert weights are split on their
expert dim over `ep` (models/moe.py dispatches tokens to them); the router and the
shared expert follow the dense rules. An FP8 weight's block-scale grid (models/fp8.py)
is split with it: a column-parallel weight's N with the scale's Nb, a row-parallel
weight's K with its Kb (fp8_scale_spec).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.fp8 import Fp8Weight
from models.registry import model_module

# Logical name of every dimension of every parameter (see models/params_layout.md).
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
    "attn_norm": ("layers", "embed"),
    "mlp_norm": ("layers", "embed"),
    "post_attn_norm": ("layers", "embed"),
    "post_mlp_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "q_heads"),
    "wk": ("layers", "embed", "kv_heads"),
    "wv": ("layers", "embed", "kv_heads"),
    "wo": ("layers", "q_heads", "embed"),
    "bq": ("layers", "q_heads"),
    "bk": ("layers", "kv_heads"),
    "bv": ("layers", "kv_heads"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    "q_norm": ("layers", None),
    "k_norm": ("layers", None),
    "sinks": ("layers", "q_heads"),  # one logit per query head: split with the heads
    "router": ("layers", "embed", None),
    "we_gate": ("layers", "experts", "embed", None),
    "we_up": ("layers", "experts", "embed", None),
    "we_down": ("layers", "experts", None, "embed"),
    "ws_gate": ("layers", "embed", "mlp"),
    "ws_up": ("layers", "embed", "mlp"),
    "ws_down": ("layers", "mlp", "embed"),
    "ws_router": ("layers", "embed", None),
    "bo": ("layers", "embed"),
    "router_bias": ("layers", None),
    "we_gate_up": ("layers", "experts", "embed", None),
    "be_gate_up": ("layers", "experts", None),
    "be_down": ("layers", "experts", "embed"),
    # Multi-head latent attention (models/mla.py): replicated (serving_mesh refuses tp).
    "wq_a": ("layers", "embed", None),
    "q_a_norm": ("layers", None),
    "wq_b": ("layers", None, None),
    "w_kv_a": ("layers", "embed", None),
    "kv_a_norm": ("layers", None),
    "w_uk": ("layers", None, None, None),
    "w_uv": ("layers", None, None, None),
}

# Logical name -> mesh axis (None: replicated). The layer axis stays whole because
# split prefill dynamic_slices it; `embed` stays whole so activations need no gather.
DEFAULT_RULES: dict[str, str | None] = {
    "vocab": "tp",
    "q_heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "experts": "ep",
    "pages": "dp",
    "embed": None,
    "layers": None,
}


def make_mesh(dp: int = 1, tp: int = 1, devices: Sequence[jax.Device] | None = None,
              ep: int = 1) -> Mesh:
    """A (dp, tp, ep) mesh with Auto axes (so plain jit + shardings propagate as GSPMD)."""
    if devices is None:
        devices = jax.devices()
    if min(dp, tp, ep) < 1:
        raise ValueError(f"dp, tp and ep must be >= 1, got dp={dp} tp={tp} ep={ep}")
    n = dp * tp * ep
    if len(devices) < n:
        raise ValueError(f"mesh dp={dp} x tp={tp} x ep={ep} needs {n} devices, "
                         f"have {len(devices)}")
    grid = np.array(list(devices)[:n]).reshape(dp, tp, ep)  # [dp, tp, ep]
    return Mesh(grid, ("dp", "tp", "ep"))


def _pieces(logical: str | None, size: int, cfg: ModelConfig) -> int:
    """How many pieces a dim may be cut into: whole heads for attention dims (fused
    [H*Dh] in weights, [H] in a KV cache), so each tp shard owns complete heads and
    attention needs no collective inside a head; single elements otherwise."""
    if logical == "q_heads":
        return cfg.num_heads
    if logical == "kv_heads":
        return cfg.num_kv_heads
    return size


def logical_to_spec(
    logical: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    cfg: ModelConfig,
    rules: Mapping[str, str | None] = DEFAULT_RULES,
) -> PartitionSpec:
    """PartitionSpec for one array; a dim whose pieces the mesh axis does not divide is
    replicated instead (e.g. SmolLM2's 9 query heads with tp=2)."""
    spec: list[str | None] = []
    for name, size in zip(logical, shape, strict=True):
        axis = rules.get(name) if name is not None else None
        n = mesh.shape.get(axis, 1) if axis is not None else 1
        if n == 1 or _pieces(name, size, cfg) % n:
            axis = None  # a mesh without this axis, a size-1 axis, or an uneven split
        spec.append(axis)
    return PartitionSpec(*spec)


def param_specs(
    cfg: ModelConfig, mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES
) -> dict:
    """The parameter tree of PartitionSpecs, same structure as `param_shapes(cfg)`."""
    def spec(key: str, shape: tuple[int, ...]) -> PartitionSpec:
        return logical_to_spec(PARAM_AXES[key], shape, mesh, cfg, rules)

    shapes = model_module(cfg).param_shapes(cfg)
    tree = {k: spec(k, v) for k, v in shapes.items() if k != "layers"}
    tree["layers"] = {k: spec(k, v) for k, v in shapes["layers"].items()}
    return tree


def param_shardings(
    cfg: ModelConfig, mesh: Mesh, rules: Mapping[str, str | None] = DEFAULT_RULES
) -> dict:
    """The parameter tree of NamedShardings on `mesh`."""
    specs = param_specs(cfg, mesh, rules)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def fp8_scale_spec(name: str, spec: PartitionSpec, shape: Sequence[int],
                   scale_shape: Sequence[int], block: tuple[int, int],
                   mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of an FP8 weight's scale [..., Kb, Nb] given its weight's
    [..., K, N] (named `name` in errors): the stacked dims as the weight's; a split K or
    N splits Kb or Nb with it, which needs each shard to hold whole blocks (a block
    across two devices would need its scale on both, and the blocked product's partial
    sums of one block on one device); a scale with one block along the dim (per-channel
    K, per-tensor) stays whole on every device."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    out = list(spec[:-2])
    for axis, size, blocks, b, dim in zip(spec[-2:], shape[-2:], scale_shape[-2:], block,
                                          ("K", "N"), strict=True):
        n = 1 if axis is None else mesh.shape[axis]
        if n == 1 or blocks == 1:
            out.append(None)
            continue
        if size % n or (size // n) % b:
            raise ValueError(
                f"{name}: FP8 weight of shape {tuple(shape)} with {block[0]} x {block[1]} "
                f"scale blocks cannot be split {n} ways over {axis!r} along {dim} = {size}: "
                f"a shard's {size / n:g} of {dim} is not a whole number of blocks of {b} "
                f"(use a smaller --{axis} or a checkpoint dequantized to bf16)")
        out.append(axis)
    return PartitionSpec(*out)


def fp8_shardings(params: Any, shardings: Any, mesh: Mesh) -> Any:
    """`shardings` (param_shardings' tree) with each FP8 weight's entry an Fp8Weight of
    the weight's sharding and its scale's (fp8_scale_spec), for jax.device_put."""
    def one(path: tuple, sh: NamedSharding, p: Any) -> Any:
        if not isinstance(p, Fp8Weight):
            return sh
        name = jax.tree_util.keystr(path)
        scale = fp8_scale_spec(name, sh.spec, p.shape, p.scale.shape, p.block, mesh)
        return Fp8Weight(sh, NamedSharding(mesh, scale), p.block)

    return jax.tree_util.tree_map_with_path(one, shardings, params)


# Logical axes of the KV pool [L, Hkv, P, S, Dh]: each tp rank holds its KV heads' pages,
# each dp rank its own pages (data-parallel attention, runtime/dp_attention.py).
KV_AXES: tuple[str | None, ...] = ("layers", "kv_heads", "pages", None, None)


def kv_sharding(cfg: ModelConfig, shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(KV_AXES, shape, mesh, cfg))


def serving_mesh(cfg: ModelConfig, dp: int = 1, tp: int = 1, ep: int = 1) -> Mesh | None:
    """The runner's mesh for --dp/--tp/--ep (None: one device). Every split must be even:
    tp divides the query and KV heads (each rank owns whole heads and its KV pages), ep
    the experts; anything else is a start-up error that names the numbers. dp splits the
    KV pool's pages (the runner sizes it a multiple of dp) and each step's rows."""
    if tp > 1 and cfg.mla is not None:
        raise ValueError("tp > 1 with multi-head latent attention is not supported (its one "
                         "latent KV head cannot be split over tp); use dp or ep")
    bad = [f"{name}={n}" for name, n in (("num_heads", cfg.num_heads),
                                         ("num_kv_heads", cfg.num_kv_heads)) if n % tp]
    if bad:
        raise ValueError(f"tp={tp} does not divide the model's {' and '.join(bad)}")
    if ep > 1 and (not cfg.is_moe or cfg.num_experts % ep):
        raise ValueError(f"ep={ep} needs a MoE model whose experts it divides "
                         f"(num_experts={cfg.num_experts})")
    if dp * tp * ep == 1:
        return None
    return make_mesh(dp=dp, tp=tp, ep=ep)


@dataclasses.dataclass(frozen=True)
class MeshPlacement:
    """Where a runner's executables put what they take and return: nothing pinned on one
    device; on a mesh, host inputs and hidden states replicated, the KV pool on its
    sharding (an output pinned to an input's placement keeps a donated pool in place, and
    every call sees the shardings it was compiled for)."""

    mesh: Mesh | None = None
    kv: Any = None  # KVPool of NamedShardings on a mesh

    @property
    def replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

    def abstract(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

    def i32(self, *shape: int) -> jax.ShapeDtypeStruct:
        return self.abstract(shape, jnp.int32)

    def out(self, *shardings: Any) -> dict:
        """jax.jit's out_shardings for these outputs (none off a mesh)."""
        if self.mesh is None:
            return {}
        return {"out_shardings": shardings if len(shardings) > 1 else shardings[0]}
