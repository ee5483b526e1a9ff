"""Every documented flag starts and serves, or is refused at start-up by name
(tests/startup_matrix.py holds the table).

Compiles are the cost: one persistent compilation cache (a fresh folder per session)
serves every row, so rows that differ only on the host (scheduling, the server) load
their programs instead of compiling them, and programs rows share (the sampler, slot
init) compile once.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

import cpu_kernels
from models import registry
from models.config import ModelConfig
from runtime.config import ServerArgs
from runtime.engine import Engine
from runtime.request import SamplingParams
from runtime.server import build_server
from tests.startup_matrix import BASE, DENSE, MAX_NEW, MOE, NOT_COVERED, PROMPT_LEN, ROWS, Row

GREEDY = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)
MODELS = {"dense": DENSE, "moe": MOE}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _model(name: str) -> tuple[ModelConfig, dict]:
    cfg = MODELS[name]
    params = registry.model_module(cfg).init_params(cfg, jax.random.key(0))
    # Logits ~ N(0, 20^2): greedy tokens are decisive, so every path (packed or XLA dot,
    # bf16 weights, a tp all-reduce's order) picks the same ones.
    params["final_norm"] = params["final_norm"] * 20
    return cfg, params


def _prompt() -> list[int]:
    rng = np.random.default_rng(0)
    return rng.integers(1, DENSE.vocab_size, PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Iterator[str]:
    """A compilation cache for this module, then the session's settings back. JAX decides
    once per process whether it uses a cache: reset_cache makes it look again."""
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {k: getattr(jax.config, k) for k in keys}
    path = str(tmp_path_factory.mktemp("jax_cache"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    yield path
    for k, v in before.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


def _args(row: Row, cache: str, **extra: Any) -> ServerArgs:
    return ServerArgs(**{**BASE, "compilation_cache_dir": cache, **row.overrides, **extra})


def _serve(row: Row, cache: str) -> list[int]:
    """Start the row's Engine (or server) and serve the prompt: its output tokens."""
    model = _model(row.model)
    if row.server:
        return _serve_http(row, cache, model)
    engine = Engine(_args(row, cache), model=model)
    out = engine.generate([_prompt()], GREEDY)[0].output_ids
    engine.runner.check_no_compiles()
    return out


def _serve_http(row: Row, cache: str, model: tuple[ModelConfig, dict]) -> list[int]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trace_dir = os.path.join(cache, "..", "trace")
    args = _args(row, cache, host="127.0.0.1", port=port, api_key="k", trace_dir=trace_dir,
                 served_model_name="tiny-smollm2-heads")
    server, ctx = build_server(args, functools.partial(Engine, args, model=model),
                               log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert ctx.engine_loop.ready.wait(300), "engine not ready"
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer k"},
                          timeout=60) as client:
            assert httpx.get(f"{url}/v1/models").status_code == 401  # api_key is enforced
            names = [m["id"] for m in client.get("/v1/models").json()["data"]]
            assert names == ["tiny-smollm2-heads"]
            r = client.post("/generate", json=dict(input_ids=_prompt(), sampling_params=dict(
                temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)))
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]
    finally:
        server.should_exit = True
        thread.join(60)
        assert os.listdir(trace_dir), "no trace written at shutdown"


def _refusal(row: Row) -> tuple[str | None, tuple[str, ...]]:
    """The start-up error this machine gives the row (a regex, None if it serves) and the
    flags it must name: where the machine lacks what the row `needs`, the flag that asks
    for it."""
    if row.needs == "cpu_kernels" and (why := cpu_kernels.unavailable_reason()):
        return "cpu_matmul='packed' needs the CPU kernels: " + re.escape(why), ("cpu_matmul",)
    if row.needs == "x12" and (why := cpu_kernels.x12_unavailable_reason()):
        return re.escape(f"--compress_weights: {why}"), ("compress_weights",)
    return row.refused, row.flags


@functools.cache
def _reference(model: str, cache: str) -> tuple[int, ...]:
    """The plain single-device path's greedy tokens (jnp attention, XLA's dot)."""
    return tuple(_serve(Row("reference", (), {}, model=model), cache))


def _params() -> list:
    return [pytest.param(r, id=r.name, marks=[pytest.mark.slow] if r.slow else [])
            for r in ROWS]


@pytest.mark.parametrize("row", _params())
def test_flags_start_and_serve(row: Row, cache_dir: str):
    refused, named = _refusal(row)
    if refused is None:
        want = _reference(row.model, cache_dir)
        t0 = time.perf_counter()
        got = _serve(row, cache_dir)
        assert tuple(got) == want, (row.name, got, want)
        print(f"{row.name}: served in {time.perf_counter() - t0:.1f} s")
        return
    with pytest.raises(ValueError, match=refused) as err:
        _serve(row, cache_dir)
    missing = [f for f in named if f not in str(err.value)]
    assert not missing, f"the error does not name {missing}: {err.value}"


def test_matrix_covers_every_server_arg():
    """A new ServerArgs field needs a row (or a reason in NOT_COVERED)."""
    covered = {f for r in ROWS for f in r.flags}
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    assert fields - covered - set(NOT_COVERED) == set()
    assert covered | set(NOT_COVERED) <= fields
    assert len({r.name for r in ROWS}) == len(ROWS)


def test_serve_help_lists_the_matrix_flags():
    out = subprocess.run([sys.executable, "scripts/serve.py", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert "Traceback" not in out.stderr, out.stderr[-2000:]  # absl's --help exits 1
    documented = set(re.findall(r"--(?:\[no\])?(\w+)", out.stdout))
    flags = {f for r in ROWS for f in r.flags} | set(NOT_COVERED)
    assert flags - documented == set()
