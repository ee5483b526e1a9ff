"""Multi-process meshes: one device mesh over several processes (and hosts) through
jax.distributed (--nnodes, --node_rank, --dist_init_addr, SGLang's names).

How the processes agree on each batch: **rank 0 decides, the others replay.** Rank 0 is
the whole server of one process: HTTP, the scheduler, the engine loop and a ModelRunner
on the global mesh. Every other rank (a *follower*) holds the same runner (the same
weights, built from the same --model, the same KV pool and executables, from rank 0's
RunnerSetup) and runs no scheduler: it executes exactly the executable calls rank 0
makes, in the order rank 0 makes them, on the inputs rank 0 sends it. Under SPMD every
process must launch the same programs in the same order with the same host inputs, and
a replay of rank 0's calls gives that by construction: nothing rank 0 decides from a
clock (the multiplexing interval policy, the overlap schedule, aborts arriving between
steps) can diverge, because only rank 0 decides.

What a call carries (StepMirror -> follow): the executable's name; its host inputs as
values (the packed batch, sampling columns: a few KB); device arrays as references. Each
process keeps its own device arrays: the roots (weights, pool, slot state, registered in
the same order on every rank after warm-up) and each call's outputs, numbered in the
same order on every rank. Rank 0 holds a weak reference per array and tells the
followers to drop a number when its array is gone (a donated pool, a read-back step), so
a follower holds what rank 0 holds. Rank 0 reads results back (its outputs are
replicated over the mesh); followers never read anything back.

The channel: a TCP connection from each follower to rank 0, separate from jax's own
coordinator and collectives (gloo on CPU). Rank 0 listens on an ephemeral port of the
dist_init_addr host and publishes "host:port:token" in the jax.distributed key-value
store; a follower connects, proves it read the token and gets the RunnerSetup, then the
calls. Messages are pickles from rank 0 to the followers only (rank 0 unpickles
nothing); the channel is as trusted as the jax coordinator, which is unauthenticated too.

Failure: a process that dies closes its connection. Rank 0 watches every follower's
connection and, when one closes (or reports an error), logs which rank left and exits
the process with EXIT_PEER_LOST at once: its mesh cannot run a step without that rank,
and a collective would otherwise wait on it. A follower whose rank 0 goes away does the
same. jax.distributed's heartbeat (--dist_heartbeat_timeout) is the backstop for a
process that is alive but silent (stopped, partitioned): then jax itself terminates
every process with "the JAX distributed service detected fatal errors".
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import secrets
import socket
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from runtime.config import ServerArgs

logger = logging.getLogger(__name__)

EXIT_PEER_LOST = 3  # a process of the mesh went away: this one cannot run alone
_KEY = "xlaserve/step_channel"
_LEN = struct.Struct("!Q")
_HELLO = struct.Struct("!I32s")  # node_rank, token


def initialize(args: ServerArgs) -> None:
    """Start jax.distributed for a multi-process mesh (nothing for nnodes=1). Must run
    before anything touches a JAX backend; idempotent (a second call checks it agrees).
    On CPU the cross-process collectives are gloo's. `args` are valid (ServerArgs
    validates --nnodes / --node_rank / --dist_init_addr when it is built)."""
    if args.nnodes == 1:
        return
    from jax._src import distributed
    if distributed.global_state.client is not None:
        if (jax.process_count(), jax.process_index()) != (args.nnodes, args.node_rank):
            raise ValueError(f"jax.distributed already runs as process {jax.process_index()} "
                             f"of {jax.process_count()}, not node_rank={args.node_rank} of "
                             f"nnodes={args.nnodes}")
        return
    # Only the CPU client reads it: harmless for a GPU backend.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info("jax.distributed: node_rank %d of %d, coordinator %s", args.node_rank,
                args.nnodes, args.dist_init_addr)
    jax.distributed.initialize(
        coordinator_address=args.dist_init_addr, num_processes=args.nnodes,
        process_id=args.node_rank, initialization_timeout=args.dist_timeout,
        heartbeat_timeout_seconds=args.dist_heartbeat_timeout)
    logger.info("jax.distributed: %d processes, %d devices (%d here)", jax.process_count(),
                jax.device_count(), jax.local_device_count())


def _kv_store() -> Any:
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized (multihost.initialize)")
    return client


def _exit_lost(message: str) -> None:
    """Log why and end the process now: a mesh missing a process cannot run a step, and
    jax.distributed's shutdown at exit would wait for it."""
    logger.critical("%s; exiting (code %d)", message, EXIT_PEER_LOST)
    logging.shutdown()
    os._exit(EXIT_PEER_LOST)


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> bytes | None:
    """One framed message; None when the peer closed the connection."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    return _recv_exact(sock, _LEN.unpack(head)[0])


# ---------------------------------------------------------------- rank 0


class Leader:
    """Rank 0's end of the step channel: a connection per follower, watched."""

    def __init__(self, args: ServerArgs) -> None:
        self.nnodes = args.nnodes
        host = args.dist_init_addr.rpartition(":")[0].strip("[]")
        token = secrets.token_hex(16).encode()
        server = socket.create_server((host, 0))
        server.settimeout(args.dist_timeout)
        port = server.getsockname()[1]
        _kv_store().key_value_set(_KEY, f"{host}:{port}:{token.decode()}")
        logger.info("step channel on %s:%d: waiting for %d follower(s)", host, port,
                    self.nnodes - 1)
        self._peers: dict[int, socket.socket] = {}
        try:
            while len(self._peers) < self.nnodes - 1:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, self.nnodes)) - set(self._peers))
                    raise TimeoutError(f"node_rank(s) {missing} did not connect to the step "
                                       f"channel within {args.dist_timeout} s") from None
                conn.settimeout(args.dist_timeout)
                hello = _recv_exact(conn, _HELLO.size)
                rank, given = _HELLO.unpack(hello) if hello else (-1, b"")
                if given != token or not 0 < rank < self.nnodes or rank in self._peers:
                    logger.warning("step channel: refused a connection (rank %d)", rank)
                    conn.close()
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._peers[rank] = conn
        finally:
            server.close()
        self._closing = False
        self._lock = threading.Lock()
        for rank, conn in self._peers.items():
            threading.Thread(target=self._watch, args=(rank, conn), daemon=True,
                             name=f"watch-rank{rank}").start()
        atexit.register(self.close)

    def broadcast(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            for conn in self._peers.values():
                _send(conn, data)

    def close(self) -> None:
        """Tell the followers to stop (they exit 0) and close the connections."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            for conn in self._peers.values():
                try:
                    _send(conn, pickle.dumps(("stop",)))
                    conn.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

    def _watch(self, rank: int, conn: socket.socket) -> None:
        """Followers send nothing but an error report before they die: any message or
        the connection closing while we are not closing ends this process."""
        try:
            data = _recv(conn)
        except OSError as e:
            data = f"connection error: {e}".encode()
        if self._closing:
            return
        why = "its connection closed" if data is None else data.decode(errors="replace")
        _exit_lost(f"node_rank {rank} left the mesh ({why})")


class Ref(NamedTuple):
    """A device array in a mirrored call: its number in every process's table."""

    n: int


class StepMirror:
    """Rank 0: sends every executable call to the followers before running it."""

    def __init__(self, leader: Leader) -> None:
        self._leader = leader
        self._ids: dict[int, int] = {}  # id(array) -> its number
        self._next = 0
        self._freed: list[int] = []
        self._lock = threading.Lock()  # _release runs wherever the last reference dies

    def attach(self, runner: Any) -> None:
        """Number the runner's roots (as `follow` does) and mirror its executables."""
        for leaf in jax.tree.leaves(runner.device_state()):
            self._register(leaf, self._take(1))
        runner.install_executables(self._wrap)

    def close(self) -> None:
        self._leader.close()

    def _take(self, n: int) -> int:
        first, self._next = self._next, self._next + n
        return first

    def _register(self, leaf: Any, n: int) -> None:
        if not isinstance(leaf, jax.Array):
            return
        with self._lock:
            self._ids[id(leaf)] = n
        weakref.finalize(leaf, self._release, id(leaf), n).atexit = False

    def _release(self, key: int, n: int) -> None:
        with self._lock:
            if self._ids.get(key) == n:
                del self._ids[key]
            self._freed.append(n)

    def _encode(self, name: str, leaf: Any) -> Any:
        if isinstance(leaf, jax.Array):
            with self._lock:
                n = self._ids.get(id(leaf))
            if n is None:
                raise RuntimeError(f"{name}: a device argument that no mirrored call made; "
                                   "the other processes could not reproduce it")
            return Ref(n)
        if isinstance(leaf, (np.ndarray, np.generic, int, float, bool)):
            return leaf
        raise TypeError(f"{name}: cannot send an argument of type {type(leaf).__name__}")

    def _wrap(self, name: str, exe: Any) -> Callable:
        return _Mirrored(self, name, exe)

    def call(self, name: str, exe: Any, args: tuple, kwargs: dict) -> Any:
        leaves = [self._encode(name, x) for x in jax.tree.leaves((args, kwargs))]
        first = self._take(exe.out_tree.num_leaves)
        with self._lock:
            freed, self._freed = self._freed, []
        self._leader.broadcast(("call", name, leaves, first, freed))
        out = exe(*args, **kwargs)
        for i, leaf in enumerate(jax.tree.leaves(out)):
            self._register(leaf, first + i)
        return out


class _Mirrored:
    """An executable whose calls go to the followers first; otherwise the executable."""

    def __init__(self, mirror: StepMirror, name: str, exe: Any) -> None:
        self._mirror, self._name, self._exe = mirror, name, exe

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._mirror.call(self._name, self._exe, args, kwargs)

    def __getattr__(self, attr: str) -> Any:  # as_text, cost_analysis, ...
        return getattr(self._exe, attr)


# ---------------------------------------------------------------- followers


class FollowerChannel:
    """A follower's connection to rank 0."""

    def __init__(self, args: ServerArgs) -> None:
        self.rank = args.node_rank
        addr = _kv_store().blocking_key_value_get(_KEY, args.dist_timeout * 1000)
        rest, _, token = addr.rpartition(":")
        host, _, port = rest.rpartition(":")
        self._sock = socket.create_connection((host, int(port)), timeout=args.dist_timeout)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(_HELLO.pack(self.rank, token.encode()))
        logger.info("node_rank %d: connected to rank 0's step channel %s:%s", self.rank,
                    host, port)

    def recv(self) -> tuple:
        try:
            data = _recv(self._sock)
        except OSError as e:
            _exit_lost(f"node_rank {self.rank}: lost rank 0 ({e})")
        if data is None:
            _exit_lost(f"node_rank {self.rank}: rank 0 left the mesh (its connection closed)")
        return pickle.loads(data)

    def report(self, message: str) -> None:
        """Tell rank 0 why this process is about to fail."""
        try:
            _send(self._sock, message.encode())
        except OSError:
            pass


def follow(runner: Any, channel: FollowerChannel) -> dict[int, Any]:
    """Run rank 0's calls on this process's runner until rank 0 says stop; returns the
    arrays still held, by number (what rank 0 still holds)."""
    table: dict[int, Any] = dict(enumerate(jax.tree.leaves(runner.device_state())))
    exes = runner.compiled
    calls = 0
    while True:
        message = channel.recv()
        if message[0] == "stop":
            logger.info("node_rank %d: rank 0 stopped the mesh after %d calls", channel.rank,
                        calls)
            return table
        _, name, leaves, first, freed = message
        for n in freed:
            table.pop(n, None)
        exe = exes[name]
        args, kwargs = jax.tree.unflatten(
            exe.in_tree, [table[x.n] if isinstance(x, Ref) else x for x in leaves])
        out = exe(*args, **kwargs)
        for i, leaf in enumerate(jax.tree.leaves(out)):
            table[first + i] = leaf
        calls += 1


def run_follower(args: ServerArgs) -> int:
    """A follower process (node_rank > 0): join the mesh, build rank 0's runner, replay
    its calls; returns the exit code (0 when rank 0 stopped the mesh)."""
    from runtime.engine_setup import load_model

    initialize(args)
    channel = FollowerChannel(args)
    try:
        model_cfg, params, _ = load_model(args)
        message = channel.recv()
        if message[0] != "setup":  # rank 0 failed before its runner existed
            logger.error("node_rank %d: rank 0 stopped before it sent its runner setup",
                         args.node_rank)
            return 1
        setup = message[1]
        if setup.model_cfg != model_cfg:
            raise ValueError(f"node_rank {args.node_rank} loaded a different model than rank 0 "
                             f"from --model={args.model}:\n{model_cfg}\nrank 0: "
                             f"{setup.model_cfg}")
        runner = setup.build(params)
        follow(runner, channel)
    except Exception as e:
        logger.exception("node_rank %d failed", args.node_rank)
        channel.report(f"node_rank {args.node_rank} failed: {type(e).__name__}: {e}")
        return 1
    return 0
