"""Bytes a compiled step moves, attributed instruction by instruction over its optimized HLO.

XLA's cost analysis counts a fusion's operands whole: a fusion that gathers 128 rows of the
embedding counts the whole table, and a layer's GEMM fusion that dynamic-slices the stacked
[layers, ...] weights counts the whole stack. `attribute_bytes` reads the optimized module's text
(`compiled.as_text()`) and counts, per executed instruction:

- reads: each operand whole, except an operand (a fusion parameter, followed through bitcasts,
  reshapes and nested fusions) used only as the sliced operand of slice / dynamic-slice /
  gather, which counts at the bytes those slices produce, and the buffer operand of an in-place
  dynamic-update-slice / scatter, which counts nothing;
- writes: the output, except an in-place dynamic-update-slice / scatter root, which writes its
  update's bytes;
- a Mosaic call (`tpu_custom_call`) at its `pl.CostEstimate` bytes (in its backend config); a
  Triton call at the bytes its traced kernel estimated (`triton_call_bytes`, one figure for
  every call or one per pallas_call name, found in the call's op_name: XLA:GPU keeps no
  estimate in the module); a cuBLAS call at its operands and its result (not its workspace);
- nothing for views and bookkeeping (parameter, constant, tuple, get-tuple-element, bitcast);
- a while body once per iteration (the trip count XLA records, else the constant bound of its
  condition `i < N` from a constant start), a conditional's costliest branch, a call's body.

Bytes are logical (elements x dtype size): TPU tile padding is not counted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from seer_jax.errors import InputError

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
               "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
               "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
               "f8e4m3b11fnuz": 1, "f8e4m3": 1, "f8e3m4": 1, "f4e2m1fn": 0.5, "f8e8m0fnu": 1}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True))
                    + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "add-dependency", "while", "conditional",
         "call", "domain"}
_SLICES = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> operand holding the update
_VIEWS = {"bitcast", "reshape"}
TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "tpu_custom_call"


def shape_bytes(shape: str) -> float:
    """Bytes of every array in a shape string (a tuple's elements summed)."""
    return float(sum(math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[t]
                     for t, dims in _ARRAY.findall(shape)))


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group opening at s[i]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack, quote = [], False
    for j in range(i, len(s)):
        c = s[j]
        if quote:
            if c == "\\":
                continue
            if c == '"' and s[j - 1] != "\\":
                quote = False
            continue
        if c == '"':
            quote = True
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    raise InputError(f"unbalanced HLO text: {s[i:i + 80]!r}")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False
    args: str = ""  # the text between the opcode's parentheses (a constant's value)

    def attr(self, key: str) -> str | None:
        m = re.search(r"\b" + re.escape(key) + r"=(%[\w.\-]+|\"(?:[^\"\\]|\\.)*\"|\{)",
                      self.attrs)
        if not m:
            return None
        if m.group(1) == "{":
            return self.attrs[m.start(1):_balanced(self.attrs, m.start(1))]
        return m.group(1).strip('"').lstrip("%")


@dataclasses.dataclass
class Computation:
    name: str
    instrs: dict[str, Instr]
    root: str
    params: dict[int, str]  # parameter number -> instruction name
    entry: bool = False

    def users(self) -> dict[str, list[tuple[Instr, int]]]:
        out: dict[str, list[tuple[Instr, int]]] = {n: [] for n in self.instrs}
        for ins in self.instrs.values():
            for k, op in enumerate(ins.operands):
                if op in out:
                    out[op].append((ins, k))
        return out


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        sp = rest.find(" ")
        end = len(rest) if sp < 0 else sp
    shape, rest = rest[:end], rest[end:].lstrip()
    p = rest.find("(")
    opcode = rest[:p].strip()
    close = _balanced(rest, p)
    operands = re.findall(r"%([\w.\-]+)", rest[p:close])
    return Instr(m.group(2), shape, opcode, operands, rest[close:], bool(m.group(1)),
                 rest[p + 1:close - 1])


def parse_module(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name."""
    comps: dict[str, Computation] = {}
    cur = None
    for line in text.splitlines():
        if cur is None:
            m = _HEADER.match(line)
            if m and line.rstrip().endswith("{"):
                cur = Computation(m.group(2), {}, "", {}, entry=bool(m.group(1)))
            continue
        if line.startswith("}"):
            comps[cur.name] = cur
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is None:
            continue
        cur.instrs[ins.name] = ins
        if ins.root:
            cur.root = ins.name
        if ins.opcode == "parameter":
            cur.params[int(re.search(r"parameter\((\d+)\)", line).group(1))] = ins.name
    if not any(c.entry for c in comps.values()):
        raise InputError("no ENTRY computation in the HLO text")
    return comps


@dataclasses.dataclass(frozen=True)
class Attributed:
    """One executed instruction's bytes (`count` = how many times it runs)."""

    computation: str
    name: str
    opcode: str
    bytes: float
    count: int
    op_name: str  # the JAX op it came from (metadata), when recorded

    @property
    def total(self) -> float:
        return self.bytes * self.count


class ByteAttribution:
    """Per-instruction bytes of an optimized HLO module (see the module docstring)."""

    def __init__(self, text: str, triton_call_bytes: float | dict[str, float] | None = None):
        self.comps = parse_module(text)
        self.triton_call_bytes = triton_call_bytes
        self._users = {n: c.users() for n, c in self.comps.items()}
        self.rows: list[Attributed] = []
        self.unknown_trip_counts: list[str] = []
        entry = next(c for c in self.comps.values() if c.entry)
        self._walk(entry, 1)

    @property
    def total(self) -> float:
        return sum(r.total for r in self.rows)

    def by_opcode(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.rows:
            out[r.opcode] = out.get(r.opcode, 0.0) + r.total
        return out

    def top(self, n: int = 10) -> list[Attributed]:
        return sorted(self.rows, key=lambda r: -r.total)[:n]

    # ---- reads and writes
    def read_bytes(self, comp: Computation, name: str) -> float:
        """Bytes read of value `name` in `comp` by its users there (see the module docstring)."""
        full = shape_bytes(comp.instrs[name].shape)
        total = 0.0
        for user, k in self._users[comp.name][name]:
            op = user.opcode
            if op in _SLICES and k == 0:
                total += shape_bytes(user.shape)
            elif op in _IN_PLACE and k == 0:
                pass  # the buffer updated in place: the update's bytes count at the write
            elif op in _VIEWS:
                total += self.read_bytes(comp, user.name)
            elif op in ("fusion", "call") and user.attr("calls" if op == "fusion" else "to_apply"):
                callee = self.comps[user.attr("calls" if op == "fusion" else "to_apply")]
                total += self.read_bytes(callee, callee.params[k])
            else:
                return full
        return min(total, full)

    def write_bytes(self, comp: Computation, name: str) -> float:
        ins = comp.instrs[name]
        if ins.opcode == "tuple":
            return sum(self.write_bytes(comp, o) for o in ins.operands)
        if ins.opcode in _VIEWS:
            return self.write_bytes(comp, ins.operands[0])
        if ins.opcode in _IN_PLACE:
            return shape_bytes(comp.instrs[ins.operands[_IN_PLACE[ins.opcode]]].shape)
        if ins.opcode == "fusion":
            callee = self.comps[ins.attr("calls")]
            return self.write_bytes(callee, callee.root)
        return shape_bytes(ins.shape)

    def instr_bytes(self, comp: Computation, ins: Instr) -> float:
        op = ins.opcode
        if op in _FREE:
            return 0.0
        operand = lambda o: shape_bytes(comp.instrs[o].shape) if o in comp.instrs else 0.0
        if op == "custom-call":
            target = ins.attr("custom_call_target") or ""
            if target == MOSAIC:
                est = _mosaic_bytes(ins.attr("backend_config") or "")
                if est is not None:
                    return est
            elif target == TRITON:
                if self.triton_call_bytes is None:
                    raise InputError("a Triton call's bytes are not in the module: pass "
                                     "triton_call_bytes (its traced pl.CostEstimate)")
                if not isinstance(self.triton_call_bytes, dict):
                    return self.triton_call_bytes
                name = _op_name(ins.attrs)
                hits = [k for k in self.triton_call_bytes if f"/{k}/" in f"/{name}/"]
                if len(hits) != 1:
                    raise InputError(f"Triton call {ins.name} ({name!r}) matches {hits} of the "
                                     f"kernels {sorted(self.triton_call_bytes)}")
                return self.triton_call_bytes[hits[0]]
            elif target == "AllocateBuffer":
                return 0.0
            elif target.startswith("__cublas"):
                first = _ARRAY.search(ins.shape)  # the result, not the workspace
                return sum(operand(o) for o in ins.operands) + (
                    shape_bytes(first.group(0)) if first else 0.0)
        if op.endswith("-start"):
            return sum(operand(o) for o in ins.operands)
        if op.endswith("-done"):
            return shape_bytes(ins.shape)
        if op == "fusion":
            callee = self.comps[ins.attr("calls")]
            reads = sum(self.read_bytes(callee, callee.params[k])
                        for k in range(len(ins.operands)))
            return reads + self.write_bytes(callee, callee.root)
        if op in _SLICES:
            return 2 * shape_bytes(ins.shape) + sum(operand(o) for o in ins.operands[1:])
        if op in _IN_PLACE:
            update = operand(ins.operands[_IN_PLACE[op]])
            return 2 * update + sum(operand(o) for k, o in enumerate(ins.operands)
                                    if k not in (0, _IN_PLACE[op]))
        return sum(operand(o) for o in ins.operands) + shape_bytes(ins.shape)

    # ---- control flow
    def _walk(self, comp: Computation, count: int) -> None:
        for ins in comp.instrs.values():
            if ins.opcode == "while":
                n = self._trip_count(comp, ins)
                self._walk(self.comps[ins.attr("body")], count * n)
                self._walk(self.comps[ins.attr("condition")], count * (n + 1))
                continue
            if ins.opcode == "call":
                self._walk(self.comps[ins.attr("to_apply")], count)
                continue
            if ins.opcode == "conditional":
                names = re.findall(r"%([\w.\-]+)", ins.attr("branch_computations") or "") or [
                    ins.attr("true_computation"), ins.attr("false_computation")]
                best = max((self._sub(self.comps[b]) for b in names),
                           key=lambda rows: sum(r.total for r in rows))
                self.rows.extend(dataclasses.replace(r, count=r.count * count) for r in best)
                continue
            b = self.instr_bytes(comp, ins)
            if b:
                self.rows.append(Attributed(comp.name, ins.name, ins.opcode, b, count,
                                            _op_name(ins.attrs)))

    def _sub(self, comp: Computation) -> list[Attributed]:
        saved, self.rows = self.rows, []
        try:
            self._walk(comp, 1)
            return self.rows
        finally:
            self.rows = saved

    def _trip_count(self, comp: Computation, ins: Instr) -> int:
        cfg = ins.attr("backend_config") or ""
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"', cfg)
        if m:
            return int(m.group(1))
        # condition `get-tuple-element(param, i) < constant(N)`, the counter starting at a constant
        cond = self.comps[ins.attr("condition")]
        root = cond.instrs[cond.root]
        if root.opcode == "compare" and "direction=LT" in root.attrs:
            a, b = (cond.instrs[o] for o in root.operands)
            bound = _constant(b)
            if a.opcode == "get-tuple-element" and bound is not None:
                k = int(re.search(r"index=(\d+)", a.attrs).group(1))
                start = self._tuple_element_constant(comp, ins.operands[0], k)
                if start is not None:
                    return max(0, bound - start)
        self.unknown_trip_counts.append(ins.name)
        return 1

    def _tuple_element_constant(self, comp: Computation, name: str, k: int) -> int | None:
        ins = comp.instrs.get(name)
        if ins is None or ins.opcode != "tuple" or k >= len(ins.operands):
            return None
        el = comp.instrs.get(ins.operands[k])
        while el is not None and el.opcode in ("copy", "bitcast"):
            el = comp.instrs.get(el.operands[0])
        return _constant(el) if el is not None else None


def _constant(ins: Instr) -> int | None:
    if ins.opcode != "constant" or not re.fullmatch(r"-?\d+", ins.args.strip()):
        return None
    return int(ins.args.strip())


def _mosaic_bytes(backend_config: str) -> float | None:
    m = re.search(r'"cost_estimate":\s*(\{[^}]*\})', backend_config.replace('\\"', '"'))
    if not m:
        return None
    return float(json.loads(m.group(1))["bytes_accessed"])


def _op_name(attrs: str) -> str:
    m = re.search(r'op_name="([^"]*)"', attrs)
    return m.group(1) if m else ""


def attribute_bytes(text: str, triton_call_bytes: float | dict[str, float] | None = None
                    ) -> ByteAttribution:
    """Per-instruction bytes of an optimized HLO module's text (`compiled.as_text()`)."""
    return ByteAttribution(text, triton_call_bytes)
