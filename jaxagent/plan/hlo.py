"""Loop-aware cost and collective accounting of a compiled XLA program, from its HLO text.

Place in the data flow: `jaxagent.plan.planner` compiles each program of a run and hands the
optimized HLO (`compiled.as_text()`) here. XLA's own `cost_analysis()` counts the body of a
`while` loop once, and every layer stack in jaxagent runs under `lax.scan` (a `while`), so its
flops for a 28-layer model are about 1/28 of the truth. This module walks the module's call
graph, derives each loop's trip count, and weighs every instruction by how often it runs:

  * flops: matmul flops only (`dot`, `convolution` and GPU library GEMM calls, 2 per
    multiply-add), inside fusions too; elementwise work is left out (it is small next to the
    matmuls of a transformer).
  * bytes: HBM traffic of the instructions the device schedules (fusions and unfused ops):
    operands read plus results written. A fused parameter that is only sliced (one layer out of a
    stacked weight) counts the slice; an in-place `dynamic-update-slice` or `scatter` (a KV
    cache write) counts the update.
  * collectives: every all-reduce / all-gather / reduce-scatter / all-to-all /
    collective-permute (sync or async `-start`), counted once per appearance in the text
    (`static`) and per execution of the program (`executed`), with payload bytes and the mesh
    axes their device groups span (groups as listed, as an iota `[2,2]<=[4]`, or as the TPU
    compiler's mesh axes `mesh['axis_0'=2,'axis_1'=2] {'axis_0'}`).

Trip counts come from XLA's `known_trip_count` annotation when present (CPU, GPU), else from the
loop condition `i < N` with a constant N (TPU), counting from 0 as JAX's scan, map and fori loops
do. A loop whose count cannot be read is weighed once and counted in `unknown_loops`.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Sequence

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "token": 0,
}
_SHAPE_RE = re.compile(r"\b(pred|token|[suf]\d+|bf16|c64|c128|f8e\w+)\[([\d,]*)\]")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s*([\w\-]+)\(")
_NAME_RE = re.compile(r"%([\w.\-]+)")
# Instructions that move no data of their own.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call",
         "conditional", "after-all", "opt-barrier", "partition-id", "replica-id", "iota",
         "add-dependency", "domain"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_PASS_THROUGH = {"bitcast", "reshape", "copy", "convert"}


@dataclasses.dataclass
class _Instr:
  name: str
  shapes: list[tuple[str, tuple[int, ...]]]
  opcode: str
  operands: list[str]
  args: str           # the text inside the operand parentheses
  attrs: str          # everything after them

  @property
  def nbytes(self) -> float:
    return sum(_DTYPE_BYTES.get(dt, 4 if not dt.startswith("f8") else 1) * math.prod(dims)
               for dt, dims in self.shapes)


@dataclasses.dataclass
class _Computation:
  name: str
  entry: bool
  instrs: list[_Instr] = dataclasses.field(default_factory=list)
  root: str | None = None


@dataclasses.dataclass
class Collective:
  """One kind of collective in a program."""

  static: int = 0                  # appearances in the HLO text
  executed: float = 0.0            # executions per program run (loop bodies weighed)
  bytes: float = 0.0               # payload bytes per program run (per chip)
  axes: dict[str, float] = dataclasses.field(default_factory=dict)  # "data+fsdp" -> executed


@dataclasses.dataclass
class HloStats:
  """Loop-weighted costs of one compiled program (per chip)."""

  flops: float
  bytes_accessed: float
  collectives: dict[str, Collective]
  loops: int
  unknown_loops: int
  max_trip_count: int

  def summary(self) -> str:
    """`all-reduce 4x (data: 2, tensor: 2)`, ... for the kinds present."""
    parts = []
    for kind, c in self.collectives.items():
      if c.static:
        axes = ", ".join(f"{a}: {_num(n)}" for a, n in sorted(c.axes.items()))
        parts.append(f"{kind} {_num(c.executed)}x ({axes})")
    return "; ".join(parts) or "none"


def _num(x: float) -> str:
  return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def _split_balanced(s: str, start: int) -> int:
  """Index just past the parenthesis group that opens at `s[start]`."""
  depth = 0
  for i in range(start, len(s)):
    if s[i] == "(":
      depth += 1
    elif s[i] == ")":
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced parentheses in HLO: {s[start:start + 80]!r}")


def _parse_instr(line: str) -> tuple[bool, _Instr] | None:
  m = _INSTR_RE.match(line)
  if not m:
    return None
  root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
  if rest.startswith("("):
    end = _split_balanced(rest, 0)
  else:
    end = rest.find(" ")
    if end < 0:
      return None
  type_str, tail = rest[:end], rest[end:]
  om = _OPCODE_RE.match(tail)
  if not om:
    return None
  opcode = om.group(1)
  open_at = om.end() - 1
  close = _split_balanced(tail, open_at)
  args = tail[open_at + 1:close - 1]
  shapes = [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _SHAPE_RE.findall(type_str)]
  return root, _Instr(name, shapes, opcode, _NAME_RE.findall(args), args, tail[close:])


def parse_module(text: str) -> list[_Computation]:
  """The computations of an HLO module text, in textual order (callees before callers)."""
  comps: list[_Computation] = []
  cur = None
  for line in text.splitlines():
    if cur is None:
      m = _HEADER_RE.match(line)
      if m:
        cur = _Computation(m.group(2), entry=bool(m.group(1)))
      continue
    if line.strip() == "}":
      comps.append(cur)
      cur = None
      continue
    parsed = _parse_instr(line)
    if parsed is not None:
      is_root, ins = parsed
      cur.instrs.append(ins)
      if is_root:
        cur.root = ins.name
  if not any(c.entry for c in comps):
    raise ValueError("no ENTRY computation found: expected the text of a compiled HLO module")
  return comps


def _attr_comp(attrs: str, key: str) -> str | None:
  m = re.search(rf"\b{key}=%([\w.\-]+)", attrs)
  return m.group(1) if m else None


def _trip_count(ins: _Instr, by_name: dict[str, _Computation]) -> int | None:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
  if m:
    return int(m.group(1))
  cond = by_name.get(_attr_comp(ins.attrs, "condition") or "")
  if cond is None or cond.root is None:
    return None
  table = {i.name: i for i in cond.instrs}
  root = table[cond.root]
  if root.opcode != "compare" or len(root.operands) != 2:
    return None
  direction = re.search(r"direction=(\w+)", root.attrs)
  consts = [table.get(o) for o in root.operands]
  if direction and direction.group(1) == "LT" and consts[1] is not None \
      and consts[1].opcode == "constant":
    try:
      return int(consts[1].args.strip())
    except ValueError:
      return None
  return None


def _multiplicities(comps: list[_Computation]):
  """(times each computation runs per program run, which are scheduled sequences, loop stats)."""
  by_name = {c.name: c for c in comps}
  mult: dict[str, float] = collections.defaultdict(float)
  sequential = set()
  entry = next(c for c in comps if c.entry)
  mult[entry.name] = 1.0
  sequential.add(entry.name)
  loops = unknown = max_trip = 0
  for comp in reversed(comps):  # callers come after their callees in the text
    m = mult.get(comp.name, 0.0)
    if not m:
      continue
    for ins in comp.instrs:
      if ins.opcode == "while":
        loops += 1
        n = _trip_count(ins, by_name)
        if n is None:
          unknown += 1
          n = 1
        max_trip = max(max_trip, n)
        for key, factor in (("body", n), ("condition", n + 1)):
          callee = _attr_comp(ins.attrs, key)
          if callee:
            mult[callee] += m * factor
            sequential.add(callee)
        continue
      if ins.opcode in ("async-update", "async-done"):
        continue  # may name the computation its async-start runs (once, counted there)
      for key in ("calls", "to_apply", "true_computation", "false_computation"):
        callee = _attr_comp(ins.attrs, key)
        if callee:
          mult[callee] += m
          if ins.opcode in ("call", "conditional", "async-start"):
            sequential.add(callee)
      bm = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
      if bm:
        for callee in _NAME_RE.findall(bm.group(1)):
          mult[callee] += m
          sequential.add(callee)
  return mult, sequential, loops, unknown, max_trip


def _dot_flops(ins: _Instr, shapes: dict[str, _Instr]) -> float:
  """2 x multiply-adds of a `dot`, a `convolution`, or a library GEMM call (cuBLAS on GPU)."""
  out = math.prod(ins.shapes[0][1]) if ins.shapes else 0
  if ins.opcode == "convolution":
    return _conv_flops(ins, shapes)
  if ins.opcode == "dot":
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
  else:  # custom-call whose backend_config carries the dot's dimension numbers
    m = re.search(r'"lhs_contracting_dimensions":\[([\d",]*)\]', ins.attrs)
  lhs = shapes.get(ins.operands[0]) if ins.operands else None
  if lhs is None or not lhs.shapes or not m:
    return 0.0
  dims = lhs.shapes[0][1]
  k = math.prod(dims[int(d)] for d in m.group(1).replace('"', "").split(",") if d)
  return 2.0 * out * k


def _conv_flops(ins: _Instr, shapes: dict[str, _Instr]) -> float:
  """2 x multiply-adds of a convolution, counting only the (output, window) position pairs that
  land on real input (not padding, not a dilation hole): the TPU compiler writes batched
  matmuls as convolutions whose batch dims are dilated windows."""
  if len(ins.operands) < 2 or not ins.shapes:
    return 0.0
  lhs, kern = shapes.get(ins.operands[0]), shapes.get(ins.operands[1])
  m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
  if lhs is None or kern is None or not lhs.shapes or not kern.shapes or not m:
    return 0.0
  l_lab, k_lab, o_lab = m.groups()
  l_dims, k_dims, o_dims = lhs.shapes[0][1], kern.shapes[0][1], ins.shapes[0][1]
  if (len(l_lab), len(k_lab), len(o_lab)) != (len(l_dims), len(k_dims), len(o_dims)):
    return 0.0
  window = re.search(r"window=\{([^}]*)\}", ins.attrs)
  fields = dict(f.split("=", 1) for f in window.group(1).split()) if window else {}
  spatial = sorted(c for c in o_lab if c.isdigit())
  nd = len(spatial)

  def per_dim(key, default):
    if key not in fields:
      return [default] * nd
    return [tuple(int(x) for x in v.split("_")) if "_" in v else int(v)
            for v in fields[key].split("x")]

  stride, lhs_dil = per_dim("stride", 1), per_dim("lhs_dilate", 1)
  rhs_dil, pad = per_dim("rhs_dilate", 1), per_dim("pad", (0, 0))
  pairs = 1.0
  for j, c in enumerate(spatial):
    n, k, o = l_dims[l_lab.index(c)], k_dims[k_lab.index(c)], o_dims[o_lab.index(c)]
    span = (n - 1) * lhs_dil[j] + 1
    outs = np.arange(o) * stride[j] - pad[j][0]
    count = 0
    for kk in range(k):  # valid output positions for each window offset
      idx = outs + kk * rhs_dil[j]
      count += int(np.count_nonzero((idx >= 0) & (idx < span) & (idx % lhs_dil[j] == 0)))
    pairs *= count
  return 2.0 * o_dims[o_lab.index("b")] * k_dims[k_lab.index("o")] * k_dims[k_lab.index("i")] \
      * pairs


def _scatter_updates(ins: _Instr, table: dict[str, _Instr]) -> float | None:
  """Bytes of a single-operand scatter's updates (it writes those in place into operand 0)."""
  if len(ins.operands) != 3 or ins.operands[2] not in table:
    return None
  return table[ins.operands[2]].nbytes


class _Traffic:
  """HBM bytes of fusions: what each fused parameter really reads, what the root writes."""

  def __init__(self, by_name: dict[str, _Computation], shapes: dict[str, _Instr]):
    self.by_name, self.shapes = by_name, shapes
    self._read: dict[tuple[str, int], float] = {}

  def param_read(self, comp_name: str, index: int) -> float | None:
    """Bytes parameter `index` of fused computation `comp_name` reads (None: all of it)."""
    key = (comp_name, index)
    if key in self._read:
      return self._read[key]
    self._read[key] = None  # guards recursion
    comp = self.by_name.get(comp_name)
    result = None
    if comp is not None:
      param = next((i for i in comp.instrs if i.opcode == "parameter"
                    and i.args.strip() == str(index)), None)
      if param is not None:
        result = self._uses_read(comp, param.name)
    self._read[key] = result
    return result

  def _uses_read(self, comp: _Computation, name: str, depth: int = 0) -> float | None:
    total = 0.0
    for ins in comp.instrs:
      if name not in ins.operands:
        continue
      if ins.opcode in _SLICING and ins.operands[0] == name:
        total += ins.nbytes
      elif ins.opcode in ("dynamic-update-slice", "scatter") and ins.operands[0] == name:
        continue  # updated in place: not read
      elif ins.opcode == "fusion":
        callee = _attr_comp(ins.attrs, "calls")
        idx = ins.operands.index(name)
        sub = self.param_read(callee, idx) if callee else None
        if sub is None:
          return None
        total += sub
      elif ins.opcode in _PASS_THROUGH and depth < 8:
        sub = self._uses_read(comp, ins.name, depth + 1)
        if sub is None:
          return None
        total += sub
      else:
        return None
    return total

  def written(self, comp: _Computation) -> float:
    table = {i.name: i for i in comp.instrs}
    root = table.get(comp.root or "")
    if root is None:
      return 0.0
    outs = [table.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    total = 0.0
    for ins in outs:
      if ins is None:
        continue
      if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1 \
          and ins.operands[1] in table:
        total += table[ins.operands[1]].nbytes
      elif ins.opcode == "scatter" and (upd := _scatter_updates(ins, table)) is not None:
        total += upd
      else:
        total += ins.nbytes
    return total


_MESH_GROUPS_RE = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}")
_AXIS_REF_RE = re.compile(r"\s*'?([^':]+)'?(?::\((\d+)\)(\d+))?\s*")


def _iota(text: str, n: int) -> np.ndarray:
  """Device ids written as an iota (`[4,2]T(1,0)`: arange reshaped, transposed, flattened) or as
  an explicit list of all `n` ids."""
  m = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
  ints = [int(x) for x in re.findall(r"\d+", text)]
  if m and not (m.group(2) is None and len(ints) == n and sorted(ints) == list(range(n))):
    dims = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
      ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(-1)
  return np.asarray(ints)


def _mesh_axes_groups(mesh: str, device_ids: str | None, axes: str) -> list[list[int]]:
  """The device groups of `replica_groups=mesh['a'=4,'b'=2][, device_ids=(...)] {'a',...}` (the
  TPU compiler's form): devices laid out over the named axes (row-major, or as `device_ids`
  says); a group is every device that differs only along the listed axes, a listed axis
  `'a':(p)k` being the part of size k of axis a that has p above it."""
  names, sizes = [], []
  for item in mesh.split(","):
    name, _, size = item.rpartition("=")
    names.append(name.strip().strip("'\""))
    sizes.append(int(size))
  n = math.prod(sizes)
  ids = np.arange(n) if device_ids is None else _iota(device_ids, n)
  parts: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # dim -> (pre, size)
  for item in axes.split(","):
    m = _AXIS_REF_RE.fullmatch(item)
    dim = names.index(m.group(1))
    parts[dim].append((int(m.group(2)), int(m.group(3))) if m.group(2) else (1, sizes[dim]))
  shape, grouped = [], []
  for dim, full in enumerate(sizes):
    prefix = 1
    for pre, size in sorted(parts.get(dim, [])):
      if pre != prefix:  # the part of the axis above this sub-axis
        shape.append(pre // prefix)
        prefix = pre
      grouped.append(len(shape))
      shape.append(size)
      prefix *= size
    if prefix != full:
      shape.append(full // prefix)
  per_group = math.prod(shape[g] for g in grouped)
  order = [d for d in range(len(shape)) if d not in grouped] + grouped
  return ids.reshape(shape).transpose(order).reshape(-1, per_group).tolist()


def _parse_groups(attrs: str) -> list[list[int]] | None:
  m = _MESH_GROUPS_RE.search(attrs)
  if m:
    try:
      return _mesh_axes_groups(m.group(1), m.group(2), m.group(3))
    except (ValueError, AttributeError):  # a form this reader does not know: every device
      return None
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape[0], -1).tolist()
  m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
  if m:
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return groups or None
  m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
  if m:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
  return None


def _axes(groups: list[list[int]] | None, mesh_shape: Sequence[int] | None,
          axis_names: Sequence[str] | None) -> str:
  if not mesh_shape or not axis_names:
    return "?"
  n = math.prod(mesh_shape)
  if groups is None:  # one group of every device
    groups = [list(range(n))]
  spanned = set()
  for g in groups:
    if len(g) < 2 or max(g) >= n:
      continue
    coords = np.stack(np.unravel_index(np.asarray(g), tuple(mesh_shape)), axis=1)
    for a, name in enumerate(axis_names):
      if len(set(coords[:, a].tolist())) > 1:
        spanned.add(name)
  return "+".join(a for a in axis_names if a in spanned) or "none"


def analyze(text: str, mesh_shape: Sequence[int] | None = None,
            axis_names: Sequence[str] | None = None) -> HloStats:
  """Loop-weighted flops, HBM bytes and collectives of a compiled module's HLO text.

  `mesh_shape`/`axis_names` (the mesh the program was compiled over, devices in row-major
  order) name the axes each collective's device groups span.
  """
  comps = parse_module(text)
  by_name = {c.name: c for c in comps}
  shapes = {i.name: i for c in comps for i in c.instrs}
  mult, sequential, loops, unknown, max_trip = _multiplicities(comps)
  traffic = _Traffic(by_name, shapes)
  flops = nbytes = 0.0
  colls = {k: Collective() for k in COLLECTIVES}
  for comp in comps:
    m = mult.get(comp.name, 0.0)
    if not m:
      continue
    seq = comp.name in sequential
    for ins in comp.instrs:
      if ins.opcode in ("dot", "convolution") or (
          ins.opcode == "custom-call" and '"dot_dimension_numbers"' in ins.attrs):
        flops += m * _dot_flops(ins, shapes)
      base = ins.opcode[:-len("-start")] if ins.opcode.endswith("-start") else ins.opcode
      if base in colls:
        c = colls[base]
        operand_bytes = sum(shapes[o].nbytes for o in ins.operands if o in shapes)
        c.static += 1
        c.executed += m
        largest_out = max((_DTYPE_BYTES.get(dt, 4) * math.prod(d) for dt, d in ins.shapes),
                          default=0)
        c.bytes += m * max(operand_bytes, largest_out)
        ax = _axes(_parse_groups(ins.attrs), mesh_shape, axis_names)
        c.axes[ax] = c.axes.get(ax, 0.0) + m
      if not seq or ins.opcode in _FREE or ins.opcode.endswith("-done"):
        continue
      if ins.opcode == "custom-call" and "AllocateBuffer" in ins.attrs:
        continue
      if ins.opcode == "async-start" and _attr_comp(ins.attrs, "calls"):
        continue  # its traffic is that of the computation it runs, counted there
      if ins.opcode == "fusion":
        callee = by_name.get(_attr_comp(ins.attrs, "calls") or "")
        read = 0.0
        for idx, o in enumerate(ins.operands):
          r = traffic.param_read(callee.name, idx) if callee else None
          read += shapes[o].nbytes if r is None and o in shapes else (r or 0.0)
        nbytes += m * (read + (traffic.written(callee) if callee else ins.nbytes))
      elif ins.opcode in _SLICING:
        nbytes += m * 2 * ins.nbytes
      elif ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
        upd = shapes.get(ins.operands[1])
        nbytes += m * 2 * (upd.nbytes if upd else 0.0)
      elif ins.opcode == "scatter" and (upd_bytes := _scatter_updates(ins, shapes)) is not None:
        nbytes += m * 2 * upd_bytes
      elif ins.opcode.endswith("-start") and base not in colls:
        nbytes += m * 2 * sum(shapes[o].nbytes for o in ins.operands if o in shapes)
      else:
        nbytes += m * (ins.nbytes + sum(shapes[o].nbytes for o in ins.operands if o in shapes))
  return HloStats(flops=flops, bytes_accessed=nbytes,
                  collectives={k: v for k, v in colls.items()}, loops=loops,
                  unknown_loops=unknown, max_trip_count=max_trip)
