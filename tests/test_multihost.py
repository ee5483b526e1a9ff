"""A device mesh over two processes through jax.distributed (runtime/multihost.py), on
localhost: each process has 2 fake CPU devices, the expert-parallel mesh (ep=4) spans
both, collectives are gloo's.

- the offline engine across two processes gives the single-process tokens and logprobs;
- `scripts/serve.py --nnodes=2` (rank 0 serves HTTP, rank 1 replays) answers as one
  process does;
- killing rank 1 mid-request makes rank 0 exit non-zero with a message naming it.

The model is a micro MoE checkpoint (Qwen2-MoE layout, 2 layers, 4 experts top-2,
vocabulary 256, 6 executables); the tiny-moe preset runs the engine check too. Two
processes compiling side by side on the 2-core box take over a minute, so the process
tests are `slow` (`make test-slow`, ~4 min together); the replay protocol itself
(StepMirror -> follow) runs in one process in the default suite. Every wait has a
deadline, and every process started here is killed at the end, so nothing can hang.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import registry
from runtime import checkpoint, multihost
from runtime.config import ServerArgs
from tests.multihost_worker import engine_outputs
from tests.test_server import free_port

ROOT = Path(__file__).resolve().parent.parent
MICRO_MOE = dataclasses.replace(registry.PRESETS["tiny-moe"], vocab_size=256, num_layers=2,
                                num_experts=4, max_position_embeddings=256)
# One small bucket per kind: the runner compiles 6 executables.
RUNNER = dict(ep=4, page_size=16, max_running_requests=2, decode_buckets=(2,),
              extend_token_buckets=(64,), kv_len_buckets=(256,), max_prefill_tokens=64,
              chunked_prefill_size=64, max_extend_seqs=1, max_top_logprobs=2,
              max_total_tokens=2048, strict_compile=True)
NEW_TOKENS = 6
START_S = 300  # two processes compiling on a shared 2-core box
DEVICES_PER_PROCESS = 2


class _Loopback:
    """A Leader whose broadcasts are kept, pickled as the channel sends them."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []

    def broadcast(self, message: tuple) -> None:
        self.messages.append(pickle.dumps(message))

    def close(self) -> None:
        self.broadcast(("stop",))


class _Replay:
    """A FollowerChannel that hands back a _Loopback's messages."""

    rank = 1

    def __init__(self, messages: list[bytes]) -> None:
        self._messages = iter(messages)

    def recv(self) -> tuple:
        return pickle.loads(next(self._messages))


class _TinyRunner:
    """What the mirror needs of a runner: roots, executables by name, install."""

    def __init__(self) -> None:
        f32 = jax.ShapeDtypeStruct((4,), jnp.float32)
        self.compiled = {
            "step": jax.jit(lambda s, x: (s + x, (s * x).sum()), donate_argnums=0)
            .lower(f32, f32).compile(),
            "read": jax.jit(lambda s, t: s * t).lower(f32, jax.ShapeDtypeStruct(
                (), jnp.float32)).compile()}
        self.state = jnp.zeros(4, jnp.float32)
        self.exes = dict(self.compiled)

    def device_state(self) -> tuple:
        return (self.state,)

    def install_executables(self, wrap) -> None:
        self.exes = {n: wrap(n, e) for n, e in self.compiled.items()}


def test_step_mirror_replays_rank0_calls():
    """The replay protocol in one process: a follower runner that runs rank 0's messages
    ends with rank 0's arrays, and holds only what rank 0 still holds."""
    leader, r0 = _Loopback(), _TinyRunner()
    mirror = multihost.StepMirror(leader)
    mirror.attach(r0)
    for i in range(6):  # each step donates the old state and drops its scalar output
        r0.state, total = r0.exes["step"](r0.state, np.full(4, i + 1, np.float32))
    scaled = r0.exes["read"](r0.state, total)
    with pytest.raises(RuntimeError, match="no mirrored call made"):
        r0.exes["read"](jnp.ones(4), total)
    mirror.close()
    held = multihost.follow(_TinyRunner(), _Replay(leader.messages))
    got = {k: np.asarray(v) for k, v in held.items()}
    assert any(np.array_equal(v, np.asarray(r0.state)) for v in got.values())
    assert any(np.array_equal(v, np.asarray(scaled)) for v in got.values())
    # The follower holds what rank 0 holds: the state, the last total and `scaled`; the
    # donated states and the dropped totals were freed.
    assert len(held) == 3, sorted(held)


def test_multihost_args_are_checked():
    with pytest.raises(ValueError, match="needs --dist_init_addr=HOST:PORT"):
        ServerArgs(nnodes=2)
    with pytest.raises(ValueError, match=r"node_rank=2 must be in \[0, nnodes=2\)"):
        ServerArgs(nnodes=2, node_rank=2, dist_init_addr="h:1")
    multihost.initialize(ServerArgs())  # one process: nothing to start


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in (5, 23, 40)]


class Procs:
    """Processes started by a test, each logging to a file; all killed at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "RANK": name,
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"}
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT)
        self.procs[name] = (proc, log)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"---- {n} (tail)\n{self.log(n)[-4000:]}" for n in self.procs)

    def wait(self, name: str, timeout: float) -> int:
        proc = self.procs[name][0]
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still running after {timeout} s\n{self.logs()}")

    def kill_all(self) -> None:
        for proc, log in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.kill_all()


@pytest.fixture(scope="module")
def micro_ckpt(tmp_path_factory) -> str:
    params = registry.model_module(MICRO_MOE).init_params(MICRO_MOE, jax.random.key(5))
    return checkpoint.save_checkpoint(str(tmp_path_factory.mktemp("micro_moe")), MICRO_MOE,
                                      jax.device_get(params))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """A compilation cache the two-process runs share (same programs each time)."""
    return str(tmp_path_factory.mktemp("jax_cache"))


def _args(model: str, **kw) -> dict:
    return {**RUNNER, "model": model, "compilation_cache_dir": None, **kw}


def _dist(rank: int, port: int, cache: str) -> dict:
    return dict(nnodes=2, node_rank=rank, dist_init_addr=f"127.0.0.1:{port}",
                dist_timeout=START_S, dist_heartbeat_timeout=100, compilation_cache_dir=cache)


def _two_process_engine(procs: Procs, tmp: Path, model: str, cache: str) -> dict:
    port = free_port()
    out = tmp / "out.json"
    for rank in (1, 0):
        spec = tmp / f"spec{rank}.json"
        spec.write_text(json.dumps({"args": _args(model, **_dist(rank, port, cache)),
                                    "prompts": _prompts(MICRO_MOE.vocab_size),
                                    "max_new_tokens": NEW_TOKENS, "out": str(out)}))
        procs.start(f"rank{rank}", ["tests/multihost_worker.py", str(spec)])
    for rank in (0, 1):
        assert procs.wait(f"rank{rank}", START_S) == 0, procs.logs()
    assert "rank 0 stopped the mesh" in procs.log("rank1")  # a clean stop, not a loss
    return json.loads(out.read_text())


def _check_same(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    for g, w in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
        for (g_ids, g_lp), (w_ids, w_lp) in zip(g, w, strict=True):
            assert g_ids == w_ids
            np.testing.assert_allclose(g_lp, w_lp, atol=1e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def reference(micro_ckpt) -> dict:
    """One process, the same ep=4 mesh over its 4 fake devices."""
    args = ServerArgs(**_args(micro_ckpt))
    return engine_outputs(args, _prompts(MICRO_MOE.vocab_size), NEW_TOKENS)


@pytest.mark.slow  # ~80 s (two processes compile, then the one-process reference)
def test_two_process_engine_matches_one_process(procs, tmp_path, micro_ckpt, cache_dir,
                                                reference):
    got = _two_process_engine(procs, tmp_path, micro_ckpt, cache_dir)
    assert got["processes"] == 2 and reference["processes"] == 1
    _check_same(got, reference)


@pytest.mark.slow  # ~3 min: the tiny-moe preset (49152-token vocabulary) compiles 3 times
def test_two_process_tiny_moe_matches_one_process(procs, tmp_path, cache_dir):
    want = engine_outputs(ServerArgs(**_args("tiny-moe")), _prompts(MICRO_MOE.vocab_size),
                          NEW_TOKENS)
    _check_same(_two_process_engine(procs, tmp_path, "tiny-moe", cache_dir), want)


def _serve_argv(model: str, rank: int, dist_port: int, http_port: int, cache: str) -> list:
    flags = {**_args(model, **_dist(rank, dist_port, cache)), "port": http_port}
    flags = {k: ",".join(map(str, v)) if isinstance(v, tuple) else v for k, v in flags.items()}
    flags["strict_compile"] = "true"
    return ["scripts/serve.py", *(f"--{k}={v}" for k, v in flags.items())]


def _start_server(procs: Procs, model: str, cache: str) -> str:
    """Rank 1 and rank 0 of `serve.py --nnodes=2`; returns rank 0's URL once healthy."""
    dist, http = free_port(), free_port()
    for rank in (1, 0):
        procs.start(f"serve{rank}", _serve_argv(model, rank, dist, http, cache))
    url = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + START_S
    while True:
        for name, (proc, _) in procs.procs.items():
            assert proc.poll() is None, f"{name} exited {proc.returncode}\n{procs.logs()}"
        assert time.monotonic() < deadline, f"not healthy in {START_S} s\n{procs.logs()}"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.5)


@pytest.fixture(scope="module")
def server(tmp_path_factory, micro_ckpt, cache_dir):
    """One `serve.py --nnodes=2` pair for the tests below (the last one kills it)."""
    p = Procs(tmp_path_factory.mktemp("serve"))
    try:
        yield p, _start_server(p, micro_ckpt, cache_dir)
    finally:
        p.kill_all()


@pytest.mark.slow  # ~30 s after the test above (shared compilation cache), else ~90 s
def test_two_process_server_matches_one_process(server, reference):
    procs, url = server
    got = []
    for ids in _prompts(MICRO_MOE.vocab_size):
        body = {"input_ids": ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got.append(r.json()["output_ids"])
    assert got == reference["tokens"]
    assert "ready: listening on" in procs.log("serve0")
    assert "ready: listening on" not in procs.log("serve1")  # rank 1 serves no HTTP


@pytest.mark.slow  # < 1 s on the server above; ~60 s alone (the pair starts)
def test_killing_rank1_fails_rank0_loudly(server):
    procs, url = server
    body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {
        "max_new_tokens": 200, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        assert next(r.iter_lines()).startswith("data: ")  # a request is in flight
        procs.procs["serve1"][0].kill()
        t0 = time.monotonic()
        code = procs.wait("serve0", 30)
    assert code == multihost.EXIT_PEER_LOST, procs.logs()
    assert time.monotonic() - t0 < 30
    assert "node_rank 1 left the mesh" in procs.log("serve0")


@pytest.mark.slow  # a server pair of its own (~1 min)
def test_sigterm_on_rank0_stops_both_cleanly(procs, micro_ckpt, cache_dir):
    _start_server(procs, micro_ckpt, cache_dir)
    procs.procs["serve0"][0].send_signal(signal.SIGTERM)
    assert procs.wait("serve0", 60) == 0, procs.logs()
    assert procs.wait("serve1", 60) == 0, procs.logs()
    assert "rank 0 stopped the mesh" in procs.log("serve1")
