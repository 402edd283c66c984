"""Per-chip memory and peak numbers, and TPU topologies described without a TPU.

Place in the data flow: `jaxagent.plan.planner` asks `devices_for` for the devices to build a
mesh over (a TPU topology through libtpu's compile-only client, or this machine's devices) and
`chip_for` for the capacity and roofline numbers of one device.

Peak numbers are the vendors' published per-chip figures (dense, no sparsity):

| chip | HBM | bf16 matmul peak | HBM bandwidth | interconnect per chip |
|---|---|---|---|---|
| TPU v4  | 32 GiB | 275 TFLOP/s | 1200 GB/s | ICI 2400 Gb/s = 300 GB/s |
| TPU v5e | 16 GiB | 197 TFLOP/s | 819 GB/s | ICI 400 GB/s both ways (200 each way) |
| TPU v5p | 95 GiB | 459 TFLOP/s | 2765 GB/s | ICI 1200 GB/s both ways (600 each way) |
| TPU v6e | 32 GiB | 918 TFLOP/s | 1640 GB/s | ICI 800 GB/s both ways (400 each way) |
| TPU7x | 192 GiB | 2307 TFLOP/s | 7380 GB/s | ICI 1200 GB/s both ways (600 each way) |
| H100 SXM | 80 GB | 989 TFLOP/s (TF32 494) | 3350 GB/s | NVLink 900 GB/s (450 each way) |
| H100 PCIe | 80 GB | 756 TFLOP/s (TF32 378) | 2000 GB/s | NVLink bridge 600 GB/s (300 each way) |
| H100 NVL | 94 GB | 835 TFLOP/s (TF32 418) | 3900 GB/s | NVLink bridge 600 GB/s (300 each way) |
| H200 | 141 GB | 989 TFLOP/s (TF32 494) | 4800 GB/s | NVLink 900 GB/s (450 each way) |
| H200 NVL | 141 GB | 835 TFLOP/s (TF32 418) | 4800 GB/s | NVLink bridge 900 GB/s (450 each way) |
| GH200 (HBM3) | 96 GB | 989 TFLOP/s (TF32 494) | 4000 GB/s | NVLink 900 GB/s (450 each way) |
| GH200 144G HBM3e | 144 GB | 989 TFLOP/s (TF32 494) | 4900 GB/s | NVLink 900 GB/s (450 each way) |
| A100 80GB | 80 GB | 312 TFLOP/s (TF32 156) | 2039 GB/s | NVLink 600 GB/s (300 each way) |
| A100 80GB PCIe | 80 GB | 312 TFLOP/s (TF32 156) | 1935 GB/s | NVLink 600 GB/s (300 each way) |
| A100 40GB | 40 GB | 312 TFLOP/s (TF32 156) | 1555 GB/s | NVLink 600 GB/s (300 each way) |

The interconnect figure the planner uses is one direction of the whole chip's (the vendors
quote TPU ICI as the bidirectional sum); it divides collective payloads by it, a
coarse lower bound that ignores topology, latency and overlap with compute.

float32 matmuls run at the bf16 rate on TPU (JAX's default precision there is one bf16 pass)
and at the TF32 rate on GPU. Where the runtime reports the allocator's limit
(`device.memory_stats()["bytes_limit"]`, real GPUs and TPUs) that number is the capacity: it is
what this process can actually use. A compile-only TPU device reports nothing; there the
capacity is the HBM the TPU compiler lets one program use on it, which it names when it refuses
a program too large to fit (with this libtpu: v5e 15.75 GiB of its 16, v6e 31.25 of 32, v5p
95.74, v4 30.75, a TPU7x core 94.75 of its half of 192), and the table's figure only when
that cannot be read. CPU devices have no capacity and no peak: host memory is checked
leniently, if at all.
A v4 chip has two TensorCores that JAX on a v4 host runs as one device (megacore), so a v4
topology is described in that chip configuration: one device per chip, as on the real hosts
(libtpu's default lists each core as a device). Devices that are single cores of a chip (its
`core_on_chip` differs) each get half the chip. A TPU7x (Ironwood) chip is two chiplets of one
TensorCore each, which JAX runs as two devices (docs.cloud.google.com/tpu/docs/tpu7x: its
programming model gives access to two TPU devices per chip; docs.jax.dev's
jax.experimental.pallas.tpu.ChipVersion: 7x has no megacore), so a TPU7x topology keeps
libtpu's default listing: two devices per chip, each with half its HBM, peak and
bandwidth, and a mesh counts devices (tpu7x:2x2x1 is 4 chips, 8 devices); its hosts are libtpu's
default 2x2x1 (the 4-chip VMs Cloud provisions). Cloud's docs give no tpu7x-N accelerator type
with a fixed shape, so only 'tpu7x:AxBxC' is read. The v5e and v6e slices of 1, 4 and 8 chips
(1x1, 2x2, 2x4) are described as one host, as Cloud TPU provisions them; larger ones, like v4
and v5p, as hosts of 4 chips. Cloud TPU accelerator types (`v5litepod-16`, `v4-8`) are read as
the topologies they name (`resolve_topology`).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Sequence

import jax

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class ChipSpec:
  """What one device (one chip, or one core of a split chip) offers a program."""

  name: str
  hbm_bytes: float | None          # None: unknown (no fit verdict)
  bf16_flops: float | None         # peak matmul flop/s in bfloat16
  f32_flops: float | None          # peak matmul flop/s for float32 inputs at default precision
  hbm_bandwidth: float | None      # bytes/s
  ici_bandwidth: float | None = None  # bytes/s into one chip over its interconnect
  source: str = "table"            # "table", "runtime" (allocator limit), "compiler" (the TPU
                                   # compiler's budget for a compile-only device) or "unknown"

  def peak_flops(self, dtype: str) -> float | None:
    return self.f32_flops if dtype == "float32" else self.bf16_flops

  def scaled(self, fraction: float) -> "ChipSpec":
    """The share of a chip that one of its cores gets."""
    f = lambda x: None if x is None else x * fraction
    return dataclasses.replace(self, hbm_bytes=f(self.hbm_bytes), bf16_flops=f(self.bf16_flops),
                               f32_flops=f(self.f32_flops), hbm_bandwidth=f(self.hbm_bandwidth),
                               ici_bandwidth=f(self.ici_bandwidth))


# device_kind (as JAX reports it) -> spec. Matched by the longest key contained in the kind.
CHIPS: dict[str, ChipSpec] = {
    "TPU v4": ChipSpec("v4", 32 * GiB, 275e12, 275e12, 1200e9, 300e9),
    "TPU v5 lite": ChipSpec("v5e", 16 * GiB, 197e12, 197e12, 819e9, 200e9),
    "TPU v5e": ChipSpec("v5e", 16 * GiB, 197e12, 197e12, 819e9, 200e9),
    "TPU v5": ChipSpec("v5p", 95 * GiB, 459e12, 459e12, 2765e9, 600e9),
    "TPU v5p": ChipSpec("v5p", 95 * GiB, 459e12, 459e12, 2765e9, 600e9),
    "TPU v6 lite": ChipSpec("v6e", 32 * GiB, 918e12, 918e12, 1640e9, 400e9),
    "TPU v6e": ChipSpec("v6e", 32 * GiB, 918e12, 918e12, 1640e9, 400e9),
    # https://docs.cloud.google.com/tpu/docs/tpu7x (per chip: 2307 TFLOP/s bf16, 192 GiB HBM,
    # 7380 GB/s, ICI 1200 GB/s bidirectional, two TensorCores); chip_for halves it per device.
    "TPU7x": ChipSpec("tpu7x", 192 * GiB, 2307e12, 2307e12, 7380e9, 600e9),
    "H100": ChipSpec("H100", 80e9, 989e12, 494e12, 3350e9, 450e9),
    # The PCIe cards report "NVIDIA H100 PCIe" / "NVIDIA H100 NVL": slower clocks and memory
    # than the SXM part, whose figures they would otherwise take.
    "H100 PCIe": ChipSpec("H100 PCIe", 80e9, 756e12, 378e12, 2000e9, 300e9),
    "H100 NVL": ChipSpec("H100 NVL", 94e9, 835e12, 418e12, 3900e9, 300e9),
    "H200": ChipSpec("H200", 141e9, 989e12, 494e12, 4800e9, 450e9),
    # Kinds that contain another entry's key and would take its figures: "NVIDIA H200 NVL"
    # (slower clocks), "NVIDIA GH200 480GB" (an H100-class GPU with 96 GB of HBM3, not an
    # H200), "NVIDIA A100-SXM4-40GB" / "NVIDIA A100-PCIE-40GB" / "NVIDIA A100 80GB PCIe"
    # (slower HBM than the A100 80GB SXM part).
    "H200 NVL": ChipSpec("H200 NVL", 141e9, 835e12, 418e12, 4800e9, 450e9),
    "GH200": ChipSpec("GH200", 96e9, 989e12, 494e12, 4000e9, 450e9),
    "GH200 144G HBM3e": ChipSpec("GH200 144G", 144e9, 989e12, 494e12, 4900e9, 450e9),
    "A100": ChipSpec("A100", 80e9, 312e12, 156e12, 2039e9, 300e9),
    "A100 80GB PCIe": ChipSpec("A100 80GB PCIe", 80e9, 312e12, 156e12, 1935e9, 300e9),
    "A100-SXM4-40GB": ChipSpec("A100 40GB", 40e9, 312e12, 156e12, 1555e9, 300e9),
    "A100-PCIE-40GB": ChipSpec("A100 40GB", 40e9, 312e12, 156e12, 1555e9, 300e9),
}


def chip_for(devices: Sequence[jax.Device]) -> ChipSpec:
  """The spec of one device of `devices` (all of one kind)."""
  d = devices[0]
  kind = getattr(d, "device_kind", "") or ""
  keys = [k for k in CHIPS if k.lower() in kind.lower()]
  spec = CHIPS[max(keys, key=len)] if keys else ChipSpec(kind or d.platform, None, None, None,
                                                         None, None, source="unknown")
  cores = {getattr(x, "core_on_chip", 0) for x in devices}
  if d.platform == "tpu" and len(cores) > 1:
    spec = spec.scaled(1.0 / len(cores))
  # Ask a device of this process: on several hosts `devices[0]` is process 0's, whose
  # allocator the other processes cannot query (a GPU raises FailedPrecondition), so they fell
  # back to the table's capacity while process 0 read its allocator's limit, and the fit check
  # could stop one process and let the others start the run.
  me = jax.process_index()
  d = next((x for x in devices if x.process_index == me), d)
  try:
    limit = (d.memory_stats() or {}).get("bytes_limit")
  except Exception:  # compile-only and CPU devices have no allocator to ask
    limit = None
  if limit and d.platform != "cpu":
    spec = dataclasses.replace(spec, hbm_bytes=float(limit), source="runtime")
  elif d.platform == "tpu" and (budget := _compiler_hbm_budget(d)):
    spec = dataclasses.replace(spec, hbm_bytes=budget, source="compiler")
  if d.platform == "cpu":
    spec = dataclasses.replace(spec, name="cpu", hbm_bytes=None, source="unknown")
  return spec


_BUDGET_RE = re.compile(r"exceeds available HBM \(([\d.]+)([KMGT])\)")


def _compiler_hbm_budget(device: jax.Device) -> float | None:
  """The HBM (bytes) the TPU compiler lets one program use on `device`, read from its refusal
  of a program that needs 1 TiB (a compile that stops at its memory check, in milliseconds);
  None if it does not say. It is not the datasheet's HBM: the runtime keeps a part."""
  replicated = jax.sharding.NamedSharding(jax.sharding.Mesh([device], ("x",)),
                                          jax.sharding.PartitionSpec())
  too_big = jax.ShapeDtypeStruct((1 << 40,), "int8", sharding=replicated)
  try:
    jax.jit(lambda a: a[0]).lower(too_big).compile()
  except Exception as e:  # the refusal is the answer
    m = _BUDGET_RE.search(str(e))
    if m:
      return float(m.group(1)) * 1024 ** " KMGT".index(m.group(2))
  return None


def has_libtpu() -> bool:
  return importlib.util.find_spec("libtpu") is not None


# Cloud TPU accelerator types (`gcloud ... --accelerator-type=v5litepod-16`) and the planner's
# topologies they name. v4-N and v5p-N count TensorCores (two per chip: v4-8 is 4 chips),
# v5litepod-N (v5e) and v6e-N count chips. Only the sizes whose slice has one shape are
# translated; others (v4-384, v5p-1536, ...) are refused with this list, since the shape of
# their slice is not fixed by the size alone.
_TORUS_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16",
             "8x16x16")
_TORUS_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
# Cloud generation -> (the planner's chip name, TensorCores counted per chip, slice shapes).
_CLOUD_TYPES = {"v4": ("v4", 2, _TORUS_3D), "v5p": ("v5p", 2, _TORUS_3D),
                "v5litepod": ("v5e", 1, _TORUS_2D), "v6e": ("v6e", 1, _TORUS_2D)}
_CLOUD_RE = re.compile(r"((?:v|tpu)\d+[a-z]*)-(\d+)")


def _cloud_sizes(generation: str) -> dict[int, str]:
  """Cloud size N -> slice shape, for one generation of `_CLOUD_TYPES`."""
  _, per_chip, shapes = _CLOUD_TYPES[generation]
  return {per_chip * math.prod(int(d) for d in s.split("x")): s for s in shapes}


def resolve_topology(topology: str) -> str:
  """The planner's '<chip>:<shape>' topology for a Cloud TPU accelerator type ('v5litepod-16'
  -> 'v5e:4x4', 'v4-8' -> 'v4:2x2x1'); any other name is returned as it is."""
  m = _CLOUD_RE.fullmatch(topology.strip().lower())
  if not m:
    return topology
  generation, n = m.group(1), int(m.group(2))
  if generation == "tpu7x":
    raise ValueError(
        f"topology {topology!r}: the planner translates no tpu7x-N accelerator type (Cloud's "
        "TPU7x docs name none with a fixed slice shape); pass the slice's shape as an explicit "
        "'tpu7x:AxBxC' topology, such as 'tpu7x:2x2x1' (4 chips, one host, 8 devices)")
  if generation not in _CLOUD_TYPES:
    known = {chip: cloud for cloud, (chip, _, _) in _CLOUD_TYPES.items()}
    why = (f"Cloud names {generation} slices {known[generation]}-N" if generation in known
           else f"the planner has no chip figures for {generation}")
    raise ValueError(
        f"topology {topology!r}: {why}. The planner translates the Cloud TPU accelerator types "
        "v4-N, v5p-N (N TensorCores, 2 per chip), v5litepod-N (v5e) and v6e-N (N chips); for "
        "another pass a '<chip>:<shape>' topology such as 'v5e:4x4'")
  chip, per_chip, shapes = _CLOUD_TYPES[generation]
  sizes = _cloud_sizes(generation)
  if n not in sizes:
    counts = "TensorCores (2 per chip)" if per_chip == 2 else "chips"
    valid = ", ".join(f"{k} ({s})" for k, s in sizes.items())
    example = "AxBxC" if len(shapes[0].split("x")) == 3 else "AxB"
    raise ValueError(
        f"topology {topology!r}: in {generation}-N, N counts {counts}; the planner translates "
        f"N = {valid}. For another slice pass its shape as an explicit '{chip}:{example}' "
        "topology")
  return f"{chip}:{sizes[n]}"


def devices_for(topology: str | None) -> list[jax.Device]:
  """Devices of a TPU topology such as "v5p:4x4x4" or a Cloud TPU accelerator type such as
  "v5p-128" (compile-only, via libtpu), or this machine's devices for None / "local"."""
  if topology in (None, "", "local"):
    return list(jax.devices())
  topology = resolve_topology(topology)
  # A GPU name, with a count ('h100:8', 'h100-8') or without ('h200'). Checked before the
  # shape: 'h100' alone was told to write '<chip>:<shape>', as if 'h100:8' would then work.
  kind = topology.partition(":")[0].strip().lower()
  gpu = re.sub(r"[-_ ]\d+$", "", kind.replace("nvidia", "").strip(" -_"))
  gpus = {v.name.lower() for k, v in CHIPS.items() if not k.startswith("TPU")}
  if kind in gpus or gpu in gpus or gpu in ("gpu", "cuda"):
    # It read "libtpu does not know the topology 'h100:8' (Invalid TPU external name)".
    raise ValueError(
        f"topology {topology!r}: the planner describes TPU topologies only (libtpu compiles "
        "for TPUs without one); plan a GPU run on a machine with those GPUs, with "
        "--topology=local")
  if ":" not in topology:
    raise ValueError(f"topology {topology!r}: expected '<chip>:<shape>' such as 'v5e:4x4', "
                     "'v5p:4x4x4', 'v6e:4x4', 'v4:2x2x1', 'tpu7x:2x2x1', a Cloud TPU "
                     "accelerator type such as 'v5litepod-16', 'v5p-8', 'v6e-8', 'v4-8', or "
                     "'local' for this machine's devices")
  if not has_libtpu():
    raise RuntimeError(
        f"compiling for the TPU topology {topology!r} needs libtpu, which is not installed. "
        "Install the version that matches your jax: pip install 'jaxagent[tpu]' (or "
        "pip install \"jax[tpu]==$(python -c 'import jax; print(jax.__version__)')\").")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server off Cloud TPU VMs
  # Describing a topology opens no TPU, so another process that loaded libtpu (and holds its
  # lockfile) must not stop it.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  kind, _, shape = topology.partition(":")
  kind = kind.strip().lower()
  kw = {}
  if kind == "v4":
    # v4 hosts run each chip's two cores as one device (megacore); libtpu's default description
    # lists the cores apart, twice the devices a v4 run has, so a mesh of the run's chip count
    # would not divide them.
    kw["chip_config_name"] = "megacore"
  dims = [int(d) for d in shape.split("x")] if re.fullmatch(r"\d+(x\d+)*", shape) else []
  if len(dims) == 3 and dims[2] == 1:  # "2x4x1" is "2x4"
    dims = dims[:2]
  if kind in ("v5e", "v6e") and sorted(dims) in ([1, 1], [2, 2], [2, 4]):
    # The single-host slices (v5litepod-1/4/8, v6e-1/4/8): one host of 1, 4 or 8 chips.
    # libtpu's default describes hosts of 2x2 chips, which refuses 1x1 and splits 2x4 into two
    # hosts (the rollouts would be planned on half the chips).
    kw["chips_per_host_bounds"] = dims + [1]
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kw)
  except Exception as e:
    raise ValueError(f"libtpu does not know the topology {topology!r} ({e}); examples: "
                     "'v5e:2x2', 'v5e:4x4', 'v5p:2x2x1', 'v5p:4x4x4', 'v6e:4x4', 'v4:2x2x1'") from e
  return list(desc.devices)
