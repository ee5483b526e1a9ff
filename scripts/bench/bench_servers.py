"""Servers the serving benchmarks start, measure and stop: xlaserve's scripts/serve.py with
a flag set, or llama.cpp's llama-server (scripts/bench/llama_peer.py), or one already running.

A target is launched as a subprocess on a free 127.0.0.1 port with its log in the output
folder; the benchmark waits for GET /health = 200 (both servers answer 503 while they
load), runs its load and sends SIGTERM (both shut down cleanly on it), killing the
process if it has not exited 30 s later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from serving_client import ClientError, check_loopback, wait_healthy

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Target:
    """name: label in JSON and plots; kind: xlaserve / llama-server / url; argv: the
    command ({port} is replaced by the chosen port), empty for an already running url."""

    name: str
    kind: str
    argv: tuple[str, ...] = ()
    base_url: str = ""
    backend: str = "openai"
    flags: str = ""  # the configuration as given (for the record)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_config(spec: str) -> tuple[str, str]:
    """'name=--flag=1 --other' -> (name, flags); a spec without '=' before its first
    '--' is its own name."""
    head, sep, rest = spec.partition("=")
    if sep and not head.startswith("-") and " " not in head:
        return head.strip(), rest.strip()
    return spec.strip() or "default", spec.strip()


def xlaserve_target(spec: str, cmd: str, common_flags: str, backend: str) -> Target:
    """`cmd` is the launch command template ({python}: this interpreter); the config's own
    flags come last so they override the common ones."""
    name, flags = parse_config(spec)
    argv = (*shlex.split(cmd.format(python=sys.executable)), "--host=127.0.0.1",
            "--port={port}", *shlex.split(common_flags), *shlex.split(flags))
    return Target(name, "xlaserve", argv, backend=backend, flags=flags)


def url_target(base_url: str, backend: str, name: str = "server") -> Target:
    return Target(name, "url", base_url=check_loopback(base_url), backend=backend)


class Running:
    """A launched server process (or a url that was already up)."""

    def __init__(self, target: Target, log_dir: Path, health_timeout_s: float) -> None:
        self.target = target
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0
        if target.kind == "url":
            self.base_url = target.base_url
            return
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        argv = [a.replace("{port}", str(port)) for a in target.argv]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server_{_safe(target.name)}.log"
        self._log = open(self.log_path, "w")  # closed in stop()
        print(f"[bench] starting {target.name}: {shlex.join(argv)}", flush=True)
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.startup_s = wait_healthy(self.base_url, health_timeout_s,
                                          alive=lambda: self.proc.poll() is None)
        except ClientError as e:
            self.stop()
            raise ClientError(f"{e}; last lines of {self.log_path}:\n{self.tail()}") from e
        print(f"[bench] {target.name} healthy after {self.startup_s:.1f} s", flush=True)

    def tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.proc = None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


@contextlib.contextmanager
def running(target: Target, log_dir: Path, health_timeout_s: float) -> Iterator[Running]:
    srv = Running(target, log_dir, health_timeout_s)
    try:
        yield srv
    finally:
        srv.stop()


def names_unique(targets: Sequence[Target]) -> None:
    names = [t.name for t in targets]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ClientError(f"two targets share the name(s) {sorted(dup)}: name each config "
                          "('name=--flags')")
