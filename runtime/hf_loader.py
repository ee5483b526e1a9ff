"""Hugging Face folders straight onto the device or mesh, one tensor at a time.

`restore_hf` reads each source tensor (one layer's, one expert's) from its safetensors
shard into a buffer of its stored dtype, puts it on the device(s) that hold its part of
the parameter (runtime/sharding.py), and there casts / transposes / dequantizes it into
its slot of the stacked [L, ...] array, which is updated in place (donated). So host
memory holds one source tensor at a time: no float32 copy of the model, no full copy of
a stacked parameter. FP8 checkpoints (runtime/fp8_checkpoint.py) load as
models/fp8.Fp8Weight (the GPU path, one device or a mesh, the scales split with their
weights) or dequantized to the serving dtype (CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from models.config import ModelConfig
from models.fp8 import FP8, Fp8Weight, dequantize
from runtime import checkpoint, checkpoint_deepseek, fp8_checkpoint, mxfp4, sharding
from runtime.checkpoint import CheckpointError, Params

# Layout keys whose FP8 weights stay FP8 on the GPU path: they reach layers.linear, a
# plain `x @ w` (Fp8Weight.__rmatmul__) or the experts' ragged product (models/moe.py,
# models/fp8.fp8_ragged_dot). Others (MLA's projections, read by einsum) are dequantized
# at load.
FP8_KEEP_KEYS = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "ws_gate", "ws_up",
                 "ws_down", "we_gate", "we_up", "we_down"}


@dataclasses.dataclass(frozen=True)
class LoadStats:
    """What a load took: wall seconds, the largest shard file, the loaded params, and the
    process's resident memory before and at its peak during the load (None off Linux)."""

    seconds: float
    largest_shard_bytes: int
    params_bytes: int
    num_shards: int
    rss_before_bytes: int | None = None
    peak_rss_bytes: int | None = None

    def host_overhead_bytes(self, params_on_host: bool) -> int | None:
        """Host memory the load held beyond what was resident before it and, where the
        device is host memory (the CPU backend), beyond the params themselves."""
        if self.peak_rss_bytes is None or self.rss_before_bytes is None:
            return None
        held = self.params_bytes if params_on_host else 0
        return self.peak_rss_bytes - self.rss_before_bytes - held


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int | None:
    """The current RSS, after restarting the kernel's high-water mark (VmHWM) from it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _proc_status("VmRSS")


def _leaves_bytes(params: Params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


@functools.cache
def _zeros(shape: tuple[int, ...], dtype: Any, out: Sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=out)


def _convert(piece: jax.Array, scale: jax.Array | None, block: tuple[int, int] | None,
             transpose: bool, dtype: Any) -> jax.Array:
    """One source tensor [out, in] (or a vector) -> our layout [in, out] in `dtype`;
    an FP8 piece with its scale [Kb_out, Kb_in] is dequantized (in f32) first."""
    if scale is not None:
        piece = dequantize(Fp8Weight(piece, scale, block), jnp.float32)
    piece = piece.T if transpose else piece
    return piece.astype(dtype)


@functools.cache
def _placer(depth: int, out: Sharding):
    """jit: (stacked [*grid, ...] as ints, index [depth], piece) -> stacked with the piece
    at `index`, the stacked buffer donated (updated in place)."""

    def place(stacked, index, piece):
        new = jax.lax.bitcast_convert_type(piece, stacked.dtype)
        starts = (*[index[i] for i in range(depth)], *[0] * new.ndim)
        return jax.lax.dynamic_update_slice(stacked, new.reshape((1,) * depth + new.shape),
                                            starts)

    return jax.jit(place, donate_argnums=0, out_shardings=out)


def _bits(dtype: Any) -> jnp.dtype:
    """The unsigned int type a stack is built in: XLA CPU updates a bf16 array in f32,
    converting all of it, so each layer's placement would rewrite every layer; as ints
    the update is in place. One bitcast at the end (_from_bits) gives the dtype back."""
    return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


@functools.cache
def _from_bits(dtype: Any, out: Sharding):
    return jax.jit(lambda x: jax.lax.bitcast_convert_type(x, dtype), donate_argnums=0,
                   out_shardings=out)


def _stack(shape: tuple[int, ...], dtype: Any, sh: Sharding, depth: int, transpose: bool,
           pieces: list[tuple[tuple[int, ...], jax.Array, jax.Array | None,
                              tuple[int, int] | None]]) -> jax.Array:
    """A stacked [*grid, ...] array in `dtype` on `sh` from (index, piece, scale, block)."""
    if _on_host(sh):
        return _stack_on_host(shape, dtype, sh, transpose, pieces)
    out = _zeros(shape, _bits(dtype), sh)()
    # Converted in its own call: fused into the in-place update, XLA CPU's transposing
    # reads take 3x as long.
    piece_sh = _piece_sharding(sh, len(shape), depth, False)
    for index, piece, scale, block in pieces:
        new = _whole(transpose, block, dtype, piece_sh)(piece, scale)
        out = _placer(depth, sh)(out, np.asarray(index, np.int32), new)
        # Before the next read: dispatch is asynchronous, and reads that run ahead of the
        # device queue their tensors in host memory (4.7 GB of an 8B model's on the CPU).
        out.block_until_ready()
    return _from_bits(dtype, sh)(out)


def _on_host(sh: Sharding) -> bool:
    return (isinstance(sh, jax.sharding.SingleDeviceSharding)
            and next(iter(sh.device_set)).platform == "cpu")


def _stack_on_host(shape: tuple[int, ...], dtype: Any, sh: Sharding, transpose: bool,
                   pieces: Iterable) -> jax.Array:
    """_stack for the CPU backend, whose device memory is host memory: the stack is a
    64-byte aligned NumPy array filled piece by piece and handed to jax without a copy.
    (Built on the device, the final bitcast from ints copied the whole stack: 3.6 GB for
    an 8B model's w_gate.)"""
    out = checkpoint.aligned_empty(shape, dtype)
    for index, piece, scale, block in pieces:
        out[tuple(index)] = np.asarray(_whole(transpose, block, dtype, sh)(piece, scale))
    return jax.device_put(out, sh)


@functools.cache
def _whole(transpose: bool, block: tuple[int, int] | None, dtype: Any, out: Sharding):
    return jax.jit(lambda piece, scale: _convert(piece, scale, block, transpose, dtype),
                   out_shardings=out)


def _piece_sharding(sh: Sharding, ndim: int, depth: int, transpose: bool) -> Sharding:
    """Where one source tensor goes: the parameter's sharding less its stacked dims, in
    the source's [out, in] order, so each device receives only its own part."""
    if not isinstance(sh, NamedSharding):
        return sh
    spec = tuple(sh.spec) + (None,) * (ndim - len(sh.spec))
    rest = spec[depth:]
    return NamedSharding(sh.mesh, PartitionSpec(*(reversed(rest) if transpose else rest)))


def _replicated(sh: Sharding) -> Sharding:
    return NamedSharding(sh.mesh, PartitionSpec()) if isinstance(sh, NamedSharding) else sh


class _Reader:
    """Source tensors (and their FP8 scales) as device arrays, one at a time."""

    def __init__(self, owners: dict[str, checkpoint._SafetensorsFile],
                 scheme: fp8_checkpoint.Fp8Scheme | None,
                 decoded: Callable[[str], np.ndarray]):
        # decoded: the tensors no file holds as such (MXFP4 pairs, runtime/mxfp4.py)
        self.owners, self.scheme, self.decoded = owners, scheme, decoded

    def is_fp8(self, name: str) -> bool:
        return name in self.owners and self.owners[name].dtype(name) == "F8_E4M3"

    def host(self, name: str) -> np.ndarray:
        return self.owners[name].read_copy(name) if name in self.owners else self.decoded(name)

    def host_f32(self, name: str) -> np.ndarray:
        """A tensor in f32 on the host, an FP8 one dequantized with its scale."""
        w = self.host(name).astype(np.float32)
        if not self.is_fp8(name):
            return w
        scale, (bo, bi) = fp8_checkpoint.read_scale(self.scheme, self.owners, name)
        full = np.repeat(np.repeat(scale, bo, 0), bi, 1)[:w.shape[0], :w.shape[1]]
        return w * full

    def get(self, name: str, sh: Sharding) -> jax.Array:
        return jax.device_put(self.host(name), sh)

    def scale(self, name: str, sh: Sharding) -> tuple[jax.Array, tuple[int, int]]:
        """The [out-blocks, in-blocks] f32 scale and the (out, in) block of an FP8 tensor."""
        scale, block = fp8_checkpoint.read_scale(self.scheme, self.owners, name)
        return jax.device_put(scale, _replicated(sh)), block


def _load_key(reader: _Reader, cfg: ModelConfig, key: str, shape: tuple[int, ...],
              jobs: list[checkpoint._Job], dtype: Any, sh: Sharding, keep_fp8: bool) -> Any:
    """One layout key's parameter from its source tensors, placed on `sh`."""
    if key in checkpoint_deepseek.KV_B_KEYS:  # MLA: each head's key or value rows, split here
        out = checkpoint.aligned_empty(shape, dtype)
        for _, index, name, _ in jobs:
            out[index] = checkpoint_deepseek.split_kv_b(cfg, key, reader.host_f32(name))
        return jax.device_put(out, sh)
    transpose = checkpoint._transposed(cfg, key)
    depth = len(jobs[0][1])
    fp8 = [reader.is_fp8(j[2]) for j in jobs]
    if any(fp8) and not all(fp8):
        mixed = [j[2] for j, f in zip(jobs, fp8, strict=True) if not f][:3]
        raise CheckpointError(f"{key}: some source tensors are FP8 and others are not "
                              f"(e.g. {mixed}); a stacked parameter needs one dtype")
    if all(fp8) and keep_fp8 and key in FP8_KEEP_KEYS and transpose:
        return _load_fp8(reader, key, shape, jobs, sh, depth)
    piece_sh = _piece_sharding(sh, len(shape), depth, transpose)
    if depth == 0:
        (_, _, name, _), = jobs
        scale, block = reader.scale(name, sh) if fp8[0] else (None, None)
        return _whole(transpose, block, dtype, sh)(reader.get(name, piece_sh), scale)

    def pieces():  # one source tensor read at a time, as the stack takes it
        for _, index, name, _ in jobs:
            scale, block = reader.scale(name, sh) if fp8[0] else (None, None)
            yield index, reader.get(name, piece_sh), scale, block

    return _stack(shape, dtype, sh, depth, transpose, pieces())


def _load_fp8(reader: _Reader, key: str, shape: tuple[int, ...],
              jobs: list[checkpoint._Job], sh: Sharding, depth: int) -> Fp8Weight:
    """A stacked FP8 weight [*grid, K, N] with its stacked scales [*grid, Kb, Nb], the
    scales on a mesh split with the weight (sharding.fp8_scale_spec)."""
    scales = [(index, *reader.scale(name, sh)) for _, index, name, _ in jobs]  # small
    (bo, bi), s0 = scales[0][2], scales[0][1]
    if any(b != (bo, bi) or s.shape != s0.shape for _, s, b in scales):
        raise CheckpointError(f"{jobs[0][2]} ...: the stacked tensors' FP8 scales differ in "
                              "block or shape")
    scale_shape = (*shape[:depth], s0.shape[1], s0.shape[0])
    scale_sh = sh
    if isinstance(sh, NamedSharding):
        try:
            spec = sharding.fp8_scale_spec(f"{jobs[0][2]} ({key})", sh.spec, shape,
                                           scale_shape, (bi, bo), sh.mesh)
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        scale_sh = NamedSharding(sh.mesh, spec)
    rep = _replicated(sh)
    w = _stack(shape, FP8, sh, depth, True,
               ((index, reader.get(name, rep), None, None) for _, index, name, _ in jobs))
    scale = _stack(scale_shape, jnp.float32, scale_sh, depth, True,
                   ((index, s, None, None) for index, s, _ in scales))
    return Fp8Weight(w, scale, (bi, bo))  # ours is [in, out]


def _target_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh | None) -> dict[str, Sharding]:
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return dict.fromkeys(checkpoint._flat_shapes(cfg), one)
    return checkpoint._flatten(sharding.param_shardings(cfg, mesh))


def _read_raw_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read config: {e}") from e


def restore_hf(folder: str, dtype: str = "bfloat16", mesh: jax.sharding.Mesh | None = None,
               keep_fp8: bool = False) -> tuple[ModelConfig, Params, LoadStats]:
    """A Hugging Face folder's weights on the device (or `mesh`, with the tensor-parallel
    rules of runtime/sharding.py), cast to `dtype`. FP8 weights stay FP8 where
    `keep_fp8` (the GPU path; on a mesh their scales split with them) and are
    dequantized to `dtype` otherwise."""
    t0 = time.perf_counter()
    rss_before = _reset_peak_rss()
    folder = os.path.abspath(folder)
    cfg = checkpoint.load_hf_config(folder)
    scheme = fp8_checkpoint.scheme(_read_raw_config(folder), os.path.join(folder, "config.json"))
    owners = checkpoint._open_safetensors(folder)
    shapes = {n: st.shapes[n] for n, st in owners.items()}
    try:  # MXFP4 experts (gpt-oss) read as the tensors they encode, one at a time
        shapes, decoded = mxfp4.dequantizing(shapes, lambda n: owners[n].read(n),
                                             lambda n: owners[n].path)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    jobs = checkpoint._plan(cfg, 1)
    ignore = {n for n in shapes if n.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        ignore.add("lm_head.weight")
    if cfg.mla is not None:
        ignore |= checkpoint_deepseek.beyond_layers(cfg, set(shapes))
    ignore |= fp8_checkpoint.auxiliary_names(scheme, owners, [j[2] for j in jobs], folder)
    checkpoint._validate(cfg, jobs, shapes, folder, ignore)
    by_key: dict[str, list[checkpoint._Job]] = defaultdict(list)
    for job in jobs:
        by_key[job[0]].append(job)
    target = _target_shardings(cfg, mesh)
    reader = _Reader(owners, scheme, decoded)
    np_dtype = checkpoint.DTYPES[dtype]
    flat = {key: _load_key(reader, cfg, key, shape, by_key[key], np_dtype, target[key],
                           keep_fp8)
            for key, (shape, _) in checkpoint._flat_shapes(cfg).items()}
    params = checkpoint._unflatten(cfg, flat)
    jax.block_until_ready(params)
    files = {st.path: st.size for st in owners.values()}
    stats = LoadStats(seconds=time.perf_counter() - t0, largest_shard_bytes=max(files.values()),
                      params_bytes=_leaves_bytes(params), num_shards=len(files),
                      rss_before_bytes=rss_before,
                      peak_rss_bytes=_proc_status("VmHWM") if rss_before is not None else None)
    return cfg, params, stats
