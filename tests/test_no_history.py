"""The product speaks of itself; its history belongs in git log.

No tracked file outside tests/ may narrate the project's history by work session or issue
number ("session 12", "sessions 26-27", "issue #5", a result file named `_session28`).
Comments and docs say why the code is as it is and cite a benchmark by script and
command; tests/ is exempt because this file has to name the patterns it forbids.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = re.compile(r"session [0-9]+|session[0-9]+|sessions? [0-9]+|issue #?[0-9]+",
                       re.IGNORECASE)
# The same, wrapped: "(session\n    15)" in a comment or docstring.
WRAPPED = re.compile(r"\b(sessions?|issues?)[ \t]*#?\n[\s#/*]*[0-9]+", re.IGNORECASE)


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no tracked files to check")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                         check=True, timeout=60).stdout
    return [p for p in out.decode().split("\0") if p and not p.startswith("tests/")]


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte or not UTF-8) or one that
    the working tree lacks (deleted but not yet committed)."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_pattern_catches_what_it_must() -> None:
    """The pattern is the one that finds the narrative, and leaves ordinary words alone."""
    for bad in ("session 12", "Session 8's Xeon", "sessions 26-27", "session28", "issue 15",
                "issue #5", "bench_offline_session25_bf16.json"):
        assert FORBIDDEN.search(bad), bad
    assert WRAPPED.search("on a Xeon with AMX (session\n    15) the kernel")
    assert WRAPPED.search("// docs/benchmarks.md, issue\n// 17")
    for ok in ("per test session", "one tiny runner per session", "the issue's scenario",
               "sessions share a runner", "an issue with the schema"):
        assert not FORBIDDEN.search(ok), ok


def test_no_session_or_issue_history_in_tracked_files() -> None:
    found = []
    for rel in _tracked_files():
        if FORBIDDEN.search(rel):
            found.append(f"{rel}: its name")
        text = _text(REPO / rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if m := FORBIDDEN.search(line):
                found.append(f"{rel}:{n}: {m.group(0)!r} in {line.strip()[:120]!r}")
        for m in WRAPPED.finditer(text):
            found.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
    assert not found, ("history by session / issue number (say why the code is as it is; "
                       "git log keeps the history):\n" + "\n".join(found[:50]))
