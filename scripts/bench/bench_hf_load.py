"""Peak host memory and time of restoring a Hugging Face folder onto one device.

Writes a random bf16 Llama folder (default: Llama-3-8B's shapes, ~5 GB shards like the
release), restores it with runtime/hf_loader.py in a fresh process, and records:
  largest_shard_bytes  the largest safetensors file
  params_bytes         the restored params (on the device)
  peak_rss_bytes       the loading process's high-water RSS during the restore
                       (/proc/self/status VmHWM, reset just before it)
  transient_bytes      peak_rss - RSS before the restore - params_bytes: what the loader
                       holds in host memory beyond the weights themselves. On a GPU the
                       params are not in host memory and this is the whole host cost; on
                       the CPU backend the "device" is host memory, so the params are
                       subtracted to leave the loader's own overhead.
  transient_vs_shard   transient_bytes / largest_shard_bytes (the bound: <= 1.3)
With --orbax it also saves the params as the native orbax checkpoint and restores that
in another fresh process, for the same figures. The folder is deleted unless --keep.

    python scripts/bench/bench_hf_load.py --out_dir=out            # 8B shapes, ~16 GB disk
    python scripts/bench/bench_hf_load.py --num_layers=4 --shard_gb=1 --orbax
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import hf_folder  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "out", "where bench_hf_load.json goes")
flags.DEFINE_string("work_dir", None, "where the folder is written (default: a temp dir)")
flags.DEFINE_integer("num_layers", 32, "layers (Llama-3-8B: 32)")
flags.DEFINE_integer("hidden", 4096, "hidden size")
flags.DEFINE_integer("ffn", 14336, "MLP size")
flags.DEFINE_integer("vocab", 128256, "vocabulary")
flags.DEFINE_float("shard_gb", 5.0, "shard size in GiB (releases use ~5 GB)")
flags.DEFINE_string("dtype", "bfloat16", "serving dtype the weights are restored in")
flags.DEFINE_bool("orbax", False, "also save + restore the native orbax checkpoint")
flags.DEFINE_bool("keep", False, "keep the written folder")
flags.DEFINE_bool("smoke", False, "tiny shapes (tests)")
flags.DEFINE_string("compilation_cache_dir", "", "unused (the bench harness passes it)")
flags.DEFINE_string("child", None, "internal: hf|orbax-save|orbax PATH")

_POOL = 1 << 22  # random values reused across tensors: the content does not matter here


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _child(kind: str, path: str) -> dict:
    """Runs in a fresh process: one restore, measured."""
    import jax

    from runtime import checkpoint, hf_loader

    jax.devices()  # the backend's own memory belongs to the baseline
    base = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    if kind == "orbax":
        _, params = checkpoint.restore_checkpoint(path, dtype=FLAGS.dtype)
        jax.block_until_ready(params)
    else:
        cfg, params, _ = hf_loader.restore_hf(path, FLAGS.dtype)
    seconds = time.perf_counter() - t0
    peak, params_bytes = _status("VmHWM"), sum(x.nbytes for x in jax.tree.leaves(params))
    if kind == "orbax-save":
        checkpoint.save_checkpoint(path + ".orbax", cfg, params, FLAGS.dtype)
    return {"seconds": seconds, "baseline_rss_bytes": base, "peak_rss_bytes": peak,
            "params_bytes": params_bytes, "transient_bytes": peak - base - params_bytes}


def _run_child(kind: str, path: str) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), f"--child={kind}", f"--dtype={FLAGS.dtype}",
            path]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _write(folder: str) -> list[str]:
    if FLAGS.smoke:
        FLAGS.num_layers, FLAGS.hidden, FLAGS.ffn, FLAGS.vocab = 4, 256, 512, 1024
        FLAGS.shard_gb = 1 / 1024
    cfg = hf_folder.llama_config(FLAGS.hidden, FLAGS.ffn, FLAGS.num_layers,
                                 max(FLAGS.hidden // 128, 2), max(FLAGS.hidden // 512, 1),
                                 FLAGS.vocab)
    pool = (np.random.default_rng(0).standard_normal(_POOL) * 0.02).astype(ml_dtypes.bfloat16)

    def fill(name: str) -> np.ndarray:
        spec = shapes[name]
        n = int(np.prod(spec))
        start = hash(name) % (_POOL // 2)
        reps = -(-n // (_POOL - start))
        return np.tile(pool[start:], reps)[:n].reshape(spec)

    specs = hf_folder.llama_specs(cfg, np.dtype(ml_dtypes.bfloat16))
    shapes = {s[0]: s[1] for s in specs}
    return hf_folder.write_folder(folder, cfg, specs, fill, int(FLAGS.shard_gb * 2**30))


def main(argv: list[str]) -> None:
    if FLAGS.child:
        print(json.dumps(_child(FLAGS.child, argv[1])))
        return
    work = tempfile.mkdtemp(prefix="hf_load_", dir=FLAGS.work_dir)
    folder = os.path.join(work, "model")
    try:
        t0 = time.perf_counter()
        shards = _write(folder)
        largest = max(os.path.getsize(p) for p in shards)
        result = {"machine": os.uname().nodename, "cpus": os.cpu_count(),
                  "shape": dict(layers=FLAGS.num_layers, hidden=FLAGS.hidden, ffn=FLAGS.ffn,
                                vocab=FLAGS.vocab),
                  "dtype": FLAGS.dtype, "num_shards": len(shards),
                  "largest_shard_bytes": largest, "write_seconds": time.perf_counter() - t0}
        print(f"wrote {len(shards)} shards (largest {largest / 2**30:.2f} GiB) in "
              f"{result['write_seconds']:.1f} s", flush=True)
        runs = {"hf": _run_child("orbax-save" if FLAGS.orbax else "hf", folder)}
        if FLAGS.orbax:
            runs["orbax"] = _run_child("orbax", folder + ".orbax")
        for name, r in runs.items():
            r["transient_vs_shard"] = r["transient_bytes"] / largest
            print(f"{name}: {r['seconds']:.1f} s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB"
                  f" (params {r['params_bytes'] / 2**30:.2f} GiB), loader's transient "
                  f"{r['transient_bytes'] / 2**30:.2f} GiB = {r['transient_vs_shard']:.2f}x "
                  "the largest shard", flush=True)
        result["runs"] = runs
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        with open(os.path.join(FLAGS.out_dir, "bench_hf_load.json"), "w") as f:
            json.dump(result, f, indent=1)
    finally:
        if FLAGS.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
