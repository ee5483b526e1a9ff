"""Test setup: 4 fake CPU devices for mesh / shard_map tests (must precede any jax import)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
