"""A small reader of HLO text (`compiled.as_text()`): instructions per computation, their
operands, and the op_name scopes each one carries (a fusion: every op fused into it), so a
test can walk the dataflow graph of a computation and ask what an instruction depends on.
"""

from __future__ import annotations

import dataclasses
import re

_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_REF = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^}\s]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # the result type, e.g. f32[2,4]{1,0} or a tuple (...)
    opcode: str
    operands: list[str]
    calls: list[str]
    op_names: list[str]
    text: str  # the instruction without its metadata (attributes: custom_call_target=...)


def _type_end(body: str) -> int:
    """Where the result type at the start of an instruction ends (tuples nest)."""
    if not body.startswith("("):
        return body.find(" ")
    depth = 0
    for i, ch in enumerate(body):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i + 1
    return len(body)


def parse(text: str) -> dict[str, dict[str, Instr]]:
    """{computation: {instruction: Instr}} of an HLO module's text."""
    comps: dict[str, dict[str, Instr]] = {}
    cur: dict[str, Instr] | None = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            cur = comps.setdefault(m.group(1), {})
            continue
        m = _INSTR.match(line)
        if m is None or cur is None:
            continue
        name, rest = m.groups()
        body = rest.split(", metadata=")[0]
        end = _type_end(body)
        op = _OPCODE.match(body[end:])
        calls = [c.lstrip("%") for group in _CALLS.findall(body) for c in group.split(",")]
        cur[name] = Instr(name, body[:end], op.group(1) if op else "",
                          _REF.findall(body.split(", calls=")[0]), calls, _OP_NAME.findall(rest),
                          body)
    for instrs in comps.values():
        for ins in instrs.values():
            ins.operands = [o for o in ins.operands if o in instrs]
    return comps


def scopes(comps: dict[str, dict[str, Instr]], comp: str, name: str) -> set[str]:
    """The instruction's op_names: its own metadata (a fusion's names its root op), else
    every op_name of the computations it calls. Fused computations also hold constants
    that CSE shared between chains, under either chain's name, so only the fusion's own
    name says whose data it computes."""
    ins = comps[comp][name]
    if ins.op_names:
        return set(ins.op_names)
    out, seen, todo = set(), set(), list(ins.calls)
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for sub in comps[c].values():
            out.update(sub.op_names)
            todo.extend(sub.calls)
    return out


def ancestors(instrs: dict[str, Instr], name: str) -> set[str]:
    """The instructions `name` depends on through operands (itself excluded)."""
    out: set[str] = set()
    todo = list(instrs[name].operands)
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(instrs[n].operands)
    return out


def data_dependent(instrs: dict[str, Instr]) -> set[str]:
    """Instructions that read a parameter of their computation, directly or through
    operands. The rest are constant subgraphs (iotas, zero buffers) that XLA's CSE may
    share between independent chains without tying their data together."""
    memo: dict[str, bool] = {}

    def reads_param(n: str) -> bool:
        if n not in memo:
            memo[n] = False  # HLO is acyclic; this only guards the recursion
            ins = instrs[n]
            memo[n] = ins.opcode == "parameter" or any(reads_param(o) for o in ins.operands)
        return memo[n]

    return {n for n in instrs if reads_param(n)}
