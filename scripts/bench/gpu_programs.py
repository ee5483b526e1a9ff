"""The engine's own GPU programs, compiled for an H100 / H200 on a machine without one.

XLA's GPU compiler runs here when it is given the target's description (a
GpuTargetConfigProto: scripts/bench/gpu_targets/): `compile_only_mesh` is a mesh of such
compile-only devices. `abstract_runner` builds a real ModelRunner whose weights, KV pool
and slot state are shapes only (jax.eval_shape: an 8B model costs no memory), so the
programs compiled are the runner's own (`ModelRunner._lowerings`), placed on that mesh.
No absl flags here: scripts/bench/gpu_aot.py is the command line, tests/test_gpu_aot.py the check.

Needs jax's CUDA plugin (`pip install -e '.[cuda12]'`, see `gpu_plugin_missing`) and
JAX_PLATFORMS=cpu set before jax is imported: the plugin then registers its compiler
without initialising CUDA (with no GPU, its start-up check fails with error 303).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
# GpuTargetConfigProto text per target, trimmed from openxla/xla's
# xla/backends/gpu/target_config/specs/ to the fields jaxlib 0.10's proto has.
TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}


def gpu_plugin_missing() -> str | None:
    """Why GPU programs cannot be compiled in this process (None: they can)."""
    if "jax" not in sys.modules and os.environ.get("JAX_PLATFORMS") is None:
        os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return ("jax's CUDA plugin is not installed (jax_plugins.xla_cuda12); install it "
                "with `pip install -e '.[cuda12]'` (see `make gpu-aot`)")
    return None


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    spec: str  # GpuTargetConfigProto text
    bandwidth: float  # bytes / s (the spec's memory_bandwidth)
    memory: int  # bytes of device memory


def target(name: str) -> Target:
    with open(os.path.join(TARGET_DIR, TARGETS[name])) as f:
        spec = f.read()
    field = dict(line.strip().split(": ", 1) for line in spec.splitlines() if ": " in line)
    return Target(name, spec, float(field["memory_bandwidth"]),
                  int(field["device_memory_size"]))


def compile_only_mesh(tgt: Target, shape: tuple[int, ...] = (1,),
                      axes: tuple[str, ...] = ("x",)) -> Any:
    """A mesh of compile-only GPUs of `tgt` ("1x1x8": eight on one host)."""
    from jax.experimental import topologies

    n = 1
    for s in shape:
        n *= s
    topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n}",
                                        target_config=tgt.spec)
    return topologies.make_mesh(topo, shape, axes)


@contextlib.contextmanager
def compiled_pallas() -> Iterator[None]:
    """The "pallas" attention backend as on a GPU: compiled kernels, not the interpreter
    that a CPU default backend picks (pallas_kernels._interpret); and models/moe.py's GPU
    expert product, its kernel compiled (its `_on_gpu` and `_interpret_kernels` ask the
    default backend, here the CPU)."""
    import pallas_kernels
    from models import layers, moe
    from pallas_kernels.ragged_paged_attention import paged_attention

    def get(backend: str) -> Callable:
        if backend == "pallas":
            return functools.partial(paged_attention, interpret=False)
        return pallas_kernels.get_paged_attention_fn(backend)

    saved = layers.get_paged_attention_fn, moe._on_gpu, moe._interpret_kernels
    layers.get_paged_attention_fn, moe._on_gpu, moe._interpret_kernels = (
        get, lambda: True, lambda: False)
    try:
        yield
    finally:
        layers.get_paged_attention_fn, moe._on_gpu, moe._interpret_kernels = saved


def abstract_runner(model_cfg: Any, cache_cfg: Any, runner_cfg: Any, max_running: int,
                    mesh: Any = None) -> Any:
    """A ModelRunner over random weights that are never materialised: the constructor runs
    under jax.eval_shape, then its weights, pool and slot state are set to their shapes."""
    import jax
    import jax.numpy as jnp

    from models.registry import model_module
    from runtime.model_runner import ModelRunner

    box: dict[str, Any] = {}

    def build() -> tuple:
        params = model_module(model_cfg).init_params(model_cfg, jax.random.key(0),
                                                     jnp.dtype(runner_cfg.dtype))
        box["runner"] = r = ModelRunner(model_cfg, params, cache_cfg, runner_cfg,
                                        max_running, mesh=mesh)
        return r.params, r.kv, r.state

    shapes = jax.eval_shape(build)
    runner = box["runner"]
    runner.params, runner.kv, runner.state = shapes
    if mesh is not None:  # eval_shape drops the placements the constructor asked for
        runner.params, runner.kv, runner.state = mesh_placed(runner)
    return runner


def runner_mesh(tgt: Target, dp: int = 1, tp: int = 1, ep: int = 1) -> Any:
    """The runner's (dp, tp, ep) mesh (runtime/sharding.make_mesh) over compile-only GPUs
    of `tgt`; None for one GPU, as sharding.serving_mesh gives."""
    from runtime import sharding

    if dp * tp * ep == 1:
        return None
    devices = list(compile_only_mesh(tgt, (dp * tp * ep,)).devices.flat)
    return sharding.make_mesh(dp=dp, tp=tp, ep=ep, devices=devices)


def param_sharding(path: tuple, leaf: Any, mesh: Any, cfg: Any) -> Any:
    """runtime/sharding.py's placement of one parameter, stacked [L, ...] or one layer's
    slice of it (per_layer_weights); a name the rules do not know (fused wq|wk|wv, which
    validate() refuses under tp) is replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from runtime import sharding

    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    logical = sharding.PARAM_AXES.get(keys[-1]) if keys else None
    if logical is not None and len(logical) == leaf.ndim + 1 and logical[0] == "layers":
        logical = logical[1:]
    if logical is None or len(logical) != leaf.ndim:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, sharding.logical_to_spec(logical, leaf.shape, mesh, cfg))


def mesh_placed(runner: Any) -> tuple[Any, Any, Any]:
    """The abstract runner's params, KV pool and slot state as ShapeDtypeStructs with the
    placements its constructor gives them on its mesh (runtime/sharding.py's rules)."""
    import jax

    def sds(a: Any, sh: Any) -> Any:
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)

    params = jax.tree_util.tree_map_with_path(
        lambda p, a: sds(a, param_sharding(p, a, runner.mesh, runner.model_cfg)),
        runner.params)
    kv = jax.tree.map(sds, runner.kv, runner.placement.kv)
    state = jax.tree.map(lambda a: sds(a, runner.placement.replicated), runner.state)
    return params, kv, state


def shard_bytes(a: Any) -> int:
    """Bytes of one device's shard of `a` (a ShapeDtypeStruct, placed or not)."""
    import math

    sh = getattr(a, "sharding", None)
    shape = sh.shard_shape(a.shape) if sh is not None else a.shape
    return math.prod(shape) * a.dtype.itemsize


def placed(args: Any, mesh: Any) -> Any:
    """`args` (arrays' shapes, or arrays) as ShapeDtypeStructs on `mesh`: where they carry
    a placement on `mesh` (a mesh runner's), that one; otherwise replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    rep = NamedSharding(mesh, PartitionSpec())

    def place(a: Any) -> Any:
        sh = getattr(a, "sharding", None)
        on_mesh = isinstance(sh, NamedSharding) and sh.mesh == mesh
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh if on_mesh else rep)

    return jax.tree.map(place, args)


def compile_lowering(lower: functools.partial, mesh: Any,
                     options: dict[str, Any] | None = None) -> Any:
    """A runner lowering (partial(jitted.lower, *args)) compiled for the mesh's GPUs (a
    mesh runner's lowerings carry their own placements on its mesh)."""
    jitted = lower.func.__self__
    return jitted.trace(*placed(lower.args, mesh)).lower().compile(compiler_options=options)


def compile_placed(lower: Callable[[], Any], options: dict[str, Any] | None = None) -> Any:
    """A mesh runner's lowering compiled as its arguments are placed (on compile-only GPUs:
    for them). Its TBO programs carry the options of this process's backend (a CPU's:
    none), so `options` replaces them."""
    from runtime.tbo_step import _WithOptions

    lowered = lower()
    if isinstance(lowered, _WithOptions):
        lowered = lowered.lowered
    return lowered.compile(compiler_options=options)
