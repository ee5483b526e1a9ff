"""Dependencies point one way: kernels <- models <- runtime <- server / scripts.

Read from the source (every import statement, top-level or inside a function), so a
lazy import cannot hide a backward edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Each package and the first-party packages it may not import.
FORBIDDEN = {
    "cpu_kernels": ("models", "runtime", "scripts"),
    "pallas_kernels": ("models", "runtime", "scripts"),
    "models": ("runtime", "scripts"),
    "runtime": ("scripts",),
}


def imported_packages(path: Path) -> set[str]:
    """The top-level package of every module `path` imports (relative imports: none)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    bad = {str(f.relative_to(REPO)): sorted(imported_packages(f) & set(FORBIDDEN[package]))
           for f in files}
    assert not {f: b for f, b in bad.items() if b}, f"{package}/ imports upward"


def test_scan_sees_imports(tmp_path: Path) -> None:
    """The scan reads lazy and aliased imports too."""
    src = tmp_path / "m.py"
    src.write_text("import os.path as p\n\ndef f():\n    from runtime.config import X\n")
    assert imported_packages(src) == {"os", "runtime"}


# What names an execution path: its modules (runtime/paths/*.py and their programs'
# modules) and its batch type.
PATH_NAMES = ("split_prefill", "runner_split", "fused_step", "tbo_step", "two_batch_overlap",
              "multi_step", "dp_attention", "DPBatch", "self.split", "self.fused", "self.tbo",
              "self.multi", "SPLIT_PREFILL", "paths.plain", "paths.split", "paths.fused",
              "paths.tbo", "paths.multi", "paths.dp")


@pytest.mark.parametrize("path", ["runtime/model_runner.py", "runtime/runner_sampling.py"])
def test_the_runner_names_no_execution_path(path: str) -> None:
    """ModelRunner (and the sampling mixin it inherits) plans, lowers, installs and
    launches by looping over runtime/paths' enabled paths."""
    text = (REPO / path).read_text()
    assert [n for n in PATH_NAMES if n in text] == []
