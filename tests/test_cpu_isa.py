"""The instruction-set levels of the CPU kernels (cpu_kernels.isa): a CPU's level from its
flags, the $XLASERVE_CPU_ISA cap, the compiler switches that hold a build to the cap, and
the refusals that name the missing feature."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jax
import pytest

import cpu_kernels
from cpu_kernels import isa

SPR = frozenset("sse4_2 avx avx2 fma avx512f avx512bw avx512dq avx512vl avx512cd avx512_bf16 "
                "avx512_vnni amx_tile amx_bf16 amx_int8".split())  # a Sapphire Rapids Xeon
ZEN4 = frozenset(f for f in SPR if not f.startswith("amx"))
ZEN3 = frozenset("sse4_2 avx avx2 fma bmi2".split())
SKYLAKE_X = frozenset(f for f in ZEN4 if f not in ("avx512_bf16",))


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch):
    """Pretend to be a CPU with the given flags, under the given cap."""
    def pretend(flags: frozenset[str], cap: str | None = None) -> None:
        monkeypatch.setattr(isa, "machine_flags", lambda: flags)
        if cap is None:
            monkeypatch.delenv(isa.ENV, raising=False)
        else:
            monkeypatch.setenv(isa.ENV, cap)
        isa.cap.cache_clear()
    yield pretend
    isa.cap.cache_clear()


@pytest.mark.parametrize("flags, level", [(SPR, "amx"), (ZEN4, "avx512_bf16"),
                                          (SKYLAKE_X, "avx512"), (ZEN3, "avx2"),
                                          (frozenset({"sse4_2", "avx"}), None),
                                          (frozenset({"avx512f", "avx2", "fma"}), "avx2")])
def test_level_of_a_cpu(flags: frozenset[str], level: str | None) -> None:
    """Each level needs its own flags and every level's below it (AVX-512F alone, as on
    Knights Landing, is not the avx512 level: the 12-bit decoder needs BW)."""
    assert isa.level_of(flags) == level


def test_cap_lowers_the_level_and_the_build(cpu) -> None:
    cpu(SPR)
    assert isa.level() == "amx" and isa.compiler_flags() == []
    assert isa.levels_below() == ["avx2", "avx512", "avx512_bf16"]
    cpu(SPR, "avx2")
    assert isa.level() == "avx2"
    assert set(isa.compiler_flags()) == {"-mno-avx512f", "-mno-avx512bf16", "-mno-amx-tile"}
    assert not {f for f in isa.flags() if f.startswith(("avx512", "amx"))}
    assert "avx2" in isa.flags() and "fma" in isa.flags()
    cpu(SPR, "avx512")
    assert set(isa.compiler_flags()) == {"-mno-avx512bf16", "-mno-amx-tile"}
    assert "avx512bw" in isa.flags() and "avx512_bf16" not in isa.flags()
    assert isa.missing("avx512") is None
    assert isa.missing("avx512_bf16") == "needs AVX512_BF16, which XLASERVE_CPU_ISA=avx512 " \
        "leaves out"
    cpu(ZEN4, "amx")  # a cap above the machine is the machine
    assert isa.level() == "avx512_bf16" and isa.compiler_flags() == []
    assert isa.missing("amx") == "needs AMX-BF16, which this CPU lacks"


def test_bad_cap_names_the_levels(cpu) -> None:
    cpu(ZEN4, "avx1024")
    with pytest.raises(ValueError, match="XLASERVE_CPU_ISA='avx1024': want one of avx2, "
                                         "avx512, avx512_bf16, amx or native"):
        isa.level()
    cpu(ZEN4, "native")
    assert isa.level() == "avx512_bf16"


def test_x12_refusal_names_the_feature_and_the_nearest_format(cpu) -> None:
    cpu(ZEN3)
    why = cpu_kernels.x12_unavailable_reason()
    assert "AVX-512BW" in why and "this CPU lacks" in why
    assert "--dtype=bfloat16 without --compress_weights" in why
    cpu(ZEN4, "avx2")
    assert "XLASERVE_CPU_ISA=avx2 leaves out" in cpu_kernels.x12_unavailable_reason()
    cpu(ZEN4)
    assert cpu_kernels.x12_unavailable_reason() is None


_OBJDUMP = shutil.which("objdump")


@pytest.mark.skipif(_OBJDUMP is None, reason="needs objdump (binutils) to read the build")
@pytest.mark.parametrize("cap, zmm, vdpbf16ps, amx", [("avx2", False, False, False),
                                                      ("avx512", True, False, False),
                                                      (None, True, True, True)])
def test_capped_build_holds_no_instruction_above_the_cap(cpu, tmp_path: Path, cap, zmm,
                                                         vdpbf16ps, amx) -> None:
    """The matmul kernels built for a Sapphire Rapids (-march=sapphirerapids stands in for
    -march=native there) under each cap: no zmm register, vdpbf16ps or AMX tile above it,
    and the AVX-512 kernels compile on any machine."""
    cpu(SPR, cap)
    src = Path(cpu_kernels.__file__).with_name("packed_matmul.cc")
    so = tmp_path / "lib.so"
    cmd = [shutil.which("g++") or "g++", "-O1", "-march=sapphirerapids", *isa.compiler_flags(),
           "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", str(src),
           "-o", str(so)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    asm = subprocess.run([_OBJDUMP, "-d", str(so)], check=True, capture_output=True,
                         text=True).stdout
    assert ("%zmm" in asm) == zmm
    assert ("vdpbf16ps" in asm) == vdpbf16ps
    assert ("tdpbf16ps" in asm) == amx
