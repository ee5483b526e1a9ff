"""Test setup (must precede any jax import).

- 4 fake CPU devices for the mesh / shard_map tests.
- The suite's time is mostly XLA compiling its tiny models' programs, not running them, so:
  - LLVM's optimisation level 0 for XLA's CPU code (about 30% faster compiles; no HLO
    pass changes, so the programs keep their fusions). Benchmarks and serving keep the
    default level.
  - JAX's persistent compilation cache in a directory of this run's own (pytest-xdist's
    workers and the tests' subprocesses inherit it), removed when the process that made it
    exits: fixtures that build the same program (the samplers, shared bucket shapes, one
    tiny model in many configurations) compile it once (about 20% of the suite). It is
    never reused across runs.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 "
                      "--xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="xlaserve-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
