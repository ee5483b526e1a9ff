"""Bytes an optimized XLA GPU program moves through device memory, read from its HLO text.

XLA's own HloCostAnalysis counts a while loop's body once and custom calls (cuBLAS,
Pallas) not at all, so the engine's layer loop and attention kernels would vanish from
it. This walks the scheduled module instead: every instruction outside fusions is one
kernel (or none: bitcasts, tuples, parameters), costed at the bytes it reads plus the bytes
it writes, times the trip counts of the loops around it (`known_trip_count`, else the
caller's `unknown_trips`: a data-dependent loop's expected trips; the largest branch of a
conditional).
- A fusion reads an operand whole unless the fused code only slices it (dynamic-slice,
  slice, gather): then it reads the slices. A fusion whose root updates an operand in
  place (dynamic-update-slice, scatter) writes the update, not the buffer.
- A Pallas kernel (Mosaic GPU, Triton) reads its KV-pool operands through a page table
  the HLO cannot see: each such operand counts as `kv_read_per_call` bytes, the caller's
  model of one layer's reads of K or V; an operand shaped like a layer's stacked experts
  (`expert_stacks`) counts as `expert_read` of it, the caller's model of the share the
  grouped expert kernel loads (the routed experts' tiles); its other operands and outputs
  count whole.
- A weight copy is any data-movement kernel (copy, dynamic-slice, or a fusion with no dot
  and no in-place root) whose output holds an array shaped like one layer's weight
  (`weight_shapes`, compared without unit dimensions and in any dimension order): a
  layer's slice copied before its gemm, or a weight-sized product written to memory.
Pure text, no jax: tests can run it on any HLO.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
               "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
               "s4": 0.5, "u4": 0.5, "token": 0}
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> operand holding the update
_PALLAS = ("mosaic_gpu", "__gpu$xla.gpu.triton")
_COMPUTE = ("dot", "convolution", "custom-call")


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays of an HLO shape string ("bf16[2,3]{1,0}" or a tuple of them)."""
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(shape)]


def nbytes(shape: str) -> int:
    return int(sum(DTYPE_BYTES[d] * math.prod(s) for d, s in arrays(shape)))


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    root: bool
    args: str  # the text between the opcode's parentheses (parameter(N): "N")


@dataclasses.dataclass
class Computation:
    name: str
    instrs: dict[str, Instr]
    root: Instr | None = None

    def users(self, name: str) -> Iterator[tuple[Instr, int]]:
        for ins in self.instrs.values():
            for i, o in enumerate(ins.operands):
                if o == name:
                    yield ins, i


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += s[j] == "(" or s[j] == "{"
        depth -= s[j] == ")" or s[j] == "}"
        if depth == 0:
            return j + 1
    raise ValueError(f"unbalanced: {s[i:i + 80]}")


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in s:
        depth += ch in "({["
        depth -= ch in ")}]"
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


def _parse_instr(line: str) -> Instr | None:
    m = re.match(r"\s+(ROOT )?%(\S+) = ", line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end + 1:]
    else:
        shape, rest = rest.split(" ", 1)
    op = rest[:rest.index("(")]
    end = _balanced(rest, len(op))
    args = rest[len(op) + 1:end - 1]
    operands = [t.split()[-1].lstrip("%") for t in _split_top(args)
                if t.strip() and t.split()[-1].startswith("%")]
    return Instr(m.group(2), shape, op, operands, rest[end:], bool(m.group(1)), args)


def parse(text: str) -> tuple[dict[str, Computation], str]:
    """Computations by name, and the entry computation's name."""
    comps: dict[str, Computation] = {}
    entry, cur = "", None
    for line in text.splitlines():
        h = re.match(r"(ENTRY )?%(\S+) \(.*\{\s*$", line)
        if h and not line.startswith(" "):
            cur = Computation(h.group(2), {})
            comps[cur.name] = cur
            entry = cur.name if h.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None and (ins := _parse_instr(line)):
            cur.instrs[ins.name] = ins
            if ins.root:
                cur.root = ins
    return comps, entry


def _norm(dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(d for d in dims if d != 1))


def _called(attrs: str, key: str) -> list[str]:
    m = re.search(key + r"=(\{[^}]*\}|%[\w.\-]+)", attrs)
    return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []


@dataclasses.dataclass
class Copy:
    name: str
    shape: str
    bytes: int
    count: float  # executions per program run (trip counts multiplied)


@dataclasses.dataclass
class Traffic:
    bytes: float = 0.0
    copies: list[Copy] = dataclasses.field(default_factory=list)
    unknown_trip_loops: int = 0
    kernels: dict[str, float] = dataclasses.field(default_factory=dict)  # op kind -> bytes
    runs: dict[str, float] = dataclasses.field(default_factory=dict)  # op kind -> launches
    by_name: dict[str, float] = dataclasses.field(default_factory=dict)  # instruction -> bytes

    @property
    def copy_bytes(self) -> float:
        return sum(c.bytes * c.count for c in self.copies)


class TrafficModel:
    """Walks a parsed module from its entry; see the module docstring for the costs."""

    def __init__(self, text: str, kv_pool_bytes: int = 0, kv_read_per_call: float = 0.0,
                 weight_shapes: Iterable[tuple[int, ...]] = (),
                 unknown_trips: float = 1.0,
                 expert_stacks: Iterable[tuple[int, ...]] = (), expert_read: float = 1.0) -> None:
        self.comps, self.entry = parse(text)
        self.expert_stacks, self.expert_read = set(expert_stacks), expert_read
        self.unknown_trips = unknown_trips
        self.kv_pool_bytes, self.kv_read = kv_pool_bytes, kv_read_per_call
        self.weight_shapes = {_norm(s) for s in weight_shapes}

    def run(self) -> Traffic:
        t = Traffic()
        self._walk(self.comps[self.entry], 1.0, t)
        return t

    def _shape(self, comp: Computation, name: str) -> str:
        return comp.instrs[name].shape if name in comp.instrs else ""

    def _add(self, t: Traffic, kind: str, b: float, name: str = "", runs: float = 1.0) -> None:
        t.bytes += b
        t.kernels[kind] = t.kernels.get(kind, 0.0) + b
        t.runs[kind] = t.runs.get(kind, 0.0) + runs
        t.by_name[name] = t.by_name.get(name, 0.0) + b

    def _walk(self, comp: Computation, mult: float, t: Traffic) -> None:
        for ins in comp.instrs.values():
            if ins.op in _FREE:
                continue
            if ins.op == "while":
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
                t.unknown_trip_loops += n is None
                self._walk(self.comps[_called(ins.attrs, "body")[0]],
                           mult * (int(n.group(1)) if n else self.unknown_trips), t)
            elif ins.op == "conditional":
                branches = (_called(ins.attrs, "branch_computations")
                            or _called(ins.attrs, "true_computation")
                            + _called(ins.attrs, "false_computation"))
                runs = []
                for b in branches:
                    sub = Traffic()
                    self._walk(self.comps[b], mult, sub)
                    runs.append(sub)
                worst = max(runs, key=lambda r: r.bytes)
                t.bytes += worst.bytes
                t.copies += worst.copies
                t.unknown_trip_loops += worst.unknown_trip_loops
                for k, v in worst.kernels.items():
                    t.kernels[k] = t.kernels.get(k, 0.0) + v
                for k, v in worst.runs.items():
                    t.runs[k] = t.runs.get(k, 0.0) + v
                for k, v in worst.by_name.items():
                    t.by_name[k] = t.by_name.get(k, 0.0) + v
            elif ins.op in ("call", "async-start") and _called(ins.attrs, "to_apply|calls"):
                self._walk(self.comps[_called(ins.attrs, "to_apply|calls")[0]], mult, t)
            else:
                self._kernel(comp, ins, mult, t)

    def _kernel(self, comp: Computation, ins: Instr, mult: float, t: Traffic) -> None:
        out = nbytes(ins.shape)
        ins_bytes = [nbytes(self._shape(comp, o)) for o in ins.operands]
        kind = ins.op
        if ins.op == "fusion":
            fused = self.comps[_called(ins.attrs, "calls")[0]]
            reads = sum(self._param_reads(fused, i, b) for i, b in enumerate(ins_bytes))
            writes = self._root_writes(fused, out)
            compute = self._has_compute(fused)
            kind = "gemm fusion" if compute else "fusion"
            if not compute and writes == out:
                self._maybe_copy(ins, mult, t)
            self._add(t, kind, mult * (reads + writes), ins.name, mult)
        elif ins.op == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
            target = target.group(1) if target else ""
            if target.startswith(_PALLAS):
                kind = "pallas"
                reads = sum(self.kv_read if self.kv_pool_bytes and b == self.kv_pool_bytes
                            else b * self.expert_read if self._is_expert_stack(comp, o)
                            else b for o, b in zip(ins.operands, ins_bytes, strict=True))
            else:
                kind = "custom-call " + target
                reads = sum(ins_bytes)
            if "cublas" in target:  # its s8 output is the workspace, not data
                out = sum(nbytes(f"{d}[{','.join(map(str, s))}]")
                          for d, s in arrays(ins.shape) if d != "s8")
            self._add(t, kind, mult * (reads + out), ins.name, mult)
        elif ins.op in _SLICING:
            self._maybe_copy(ins, mult, t)
            self._add(t, ins.op, mult * 2 * out, ins.name, mult)
        elif ins.op in _IN_PLACE:
            self._add(t, ins.op, mult * 2 * ins_bytes[_IN_PLACE[ins.op]], ins.name, mult)
        else:
            if ins.op == "copy":
                self._maybe_copy(ins, mult, t)
            self._add(t, ins.op, mult * (sum(ins_bytes) + out), ins.name, mult)

    def _is_expert_stack(self, comp: Computation, name: str) -> bool:
        return any(dims in self.expert_stacks for _, dims in arrays(self._shape(comp, name)))

    def _maybe_copy(self, ins: Instr, mult: float, t: Traffic) -> None:
        if any(_norm(dims) in self.weight_shapes for _, dims in arrays(ins.shape)):
            t.copies.append(Copy(ins.name, ins.shape, nbytes(ins.shape), mult))

    def _has_compute(self, comp: Computation) -> bool:
        for ins in comp.instrs.values():
            if ins.op in _COMPUTE:
                return True
            if ins.op == "fusion" and self._has_compute(
                    self.comps[_called(ins.attrs, "calls")[0]]):
                return True
        return False

    def _param_reads(self, comp: Computation, index: int, full: int) -> float:
        """Bytes a fused computation reads of its parameter `index` (`full` bytes)."""
        params = [i for i in comp.instrs.values() if i.op == "parameter"
                  and i.args.strip() == str(index)]
        return self._value_reads(comp, params[0].name, full) if params else full

    def _value_reads(self, comp: Computation, name: str, full: int) -> float:
        total = 0.0
        for user, pos in comp.users(name):
            if user.op in _SLICING and pos == 0:
                total += nbytes(user.shape)
            elif user.op in _IN_PLACE and pos == 0:
                continue  # updated in place: only the update moves (counted as a write)
            elif user.op == "bitcast":
                total += self._value_reads(comp, user.name, full)
            elif user.op == "fusion":
                total += self._param_reads(self.comps[_called(user.attrs, "calls")[0]], pos,
                                           full)
            else:
                return full
            if total >= full:
                return full
        return total

    def _root_writes(self, comp: Computation, out: int) -> float:
        """Bytes a fusion writes: the updates of in-place roots, else its whole output."""
        root = comp.root
        if root is None:
            return out
        roots = [comp.instrs[o] for o in root.operands] if root.op == "tuple" else [root]
        total = 0.0
        for r in roots:
            if r.op in _IN_PLACE:
                total += nbytes(self._shape(comp, r.operands[_IN_PLACE[r.op]]))
            else:
                total += nbytes(r.shape)
        return total
