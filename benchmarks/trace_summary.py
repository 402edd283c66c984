"""GPU kernel time per step from a `jax.profiler` trace, by kernel and by kind.

    python benchmarks/trace_summary.py TRACE_DIR --steps 5

Reads the Perfetto JSON that `jax.profiler.trace(dir, create_perfetto_trace=True)` writes
(`dir/plugins/profile/*/perfetto_trace.json.gz`, the newest), sums the duration of every kernel
on the device's stream tracks and divides by `--steps`. Kinds are guessed from kernel names
(cuBLAS / Triton GEMMs, cuDNN or Pallas attention, XLA fusions, copies): a guide to where the
time goes, not an exact attribution.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

# First match wins; patterns are matched against the lower-cased kernel name.
KINDS = (
    ("attention", r"sdpa|fmha|flash|attention|cudnn|^_kernel|decode_kernel"),
    ("gemm", r"gemm|nvjet|xmma|cutlass|matmul|cublas|triton_dot|__dot|_dot_"),
    ("copy", r"memcpy|memset|^copy|_copy|transpose"),
    ("scatter", r"scatter|dynamic_update|dynamic-update"),
    ("reduce", r"reduce|reduction|argmax|sort|topk|top_k"),
    ("fusion", r"fusion|convert|broadcast|select|add|multiply"),
)


def kind_of(name: str) -> str:
  low = name.lower()
  for kind, pat in KINDS:
    if re.search(pat, low):
      return kind
  return "other"


def find_trace(path: str) -> str:
  """The Perfetto JSON under `path` (a file, or the newest under a trace directory)."""
  if os.path.isfile(path):
    return path
  hits = glob.glob(os.path.join(path, "**", "perfetto_trace.json*"), recursive=True)
  if not hits:
    raise FileNotFoundError(f"no perfetto_trace.json(.gz) under {path}")
  return max(hits, key=os.path.getmtime)


def load_events(path: str) -> list[dict]:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def kernel_times(events: list[dict]) -> dict[str, tuple[float, int, dict | None]]:
  """Total microseconds, count and the first event's args (XLA op names, ...) per kernel
  name on the device stream tracks."""
  pname, tname = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      pname[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      tname[(e["pid"], e["tid"])] = e.get("args", {}).get("name", "")
  dev_pids = {p for p, n in pname.items() if "gpu" in n.lower() or "/device:" in n.lower()}
  streams = {k for k, n in tname.items() if k[0] in dev_pids and n.lower().startswith("stream")}
  out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, None])
  for e in events:
    if e.get("ph") != "X" or e.get("pid") not in dev_pids:
      continue
    if streams and (e["pid"], e.get("tid")) not in streams:
      continue
    acc = out[e.get("name", "?")]
    acc[0] += float(e.get("dur", 0.0))
    acc[1] += 1
    if acc[2] is None and e.get("args"):
      acc[2] = e["args"]
  return {k: tuple(v) for k, v in out.items()}


def traced_kernel_us(fn, pattern: str, iters: int = 5) -> tuple[float, int] | None:
  """Device time of kernels by the profiler: the mean microseconds of the kernels whose
  lower-cased names match the regular expression `pattern`, over `iters` calls of `fn()` (each
  blocking until its work is done) under `jax.profiler.trace`, and how many such kernels ran.
  Unlike a wall-clock time of a chain of kernels, this leaves out the launch gaps between
  them. None where the trace holds no such kernel (e.g. on a CPU, which has no device
  stream)."""
  import tempfile

  import jax
  rx = re.compile(pattern)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(iters):
        fn()
    times = kernel_times(load_events(find_trace(d)))
  us = n = 0
  for name, (t, c, _) in times.items():
    if rx.search(name.lower()):
      us, n = us + t, n + c
  return (us / n, n) if n else None


def kernel_fields(got: tuple[float, int] | None, nbytes: float, peak_bytes_s: float) -> dict:
  """Result fields of a `traced_kernel_us` answer for a kernel that moves `nbytes`: its mean
  device time (`kernel_us`) and that bandwidth over the peak (`kernel_hbm_fraction`), both
  None where the trace held no such kernel."""
  if got is None:
    return {"kernel_us": None, "kernel_hbm_fraction": None}
  return {"kernel_us": got[0], "kernel_hbm_fraction": nbytes / (got[0] * 1e-6) / peak_bytes_s}


def summarize(path: str, steps: int = 1, top: int = 15) -> dict:
  """Per-step kernel time (ms) by kind and the `top` kernels; also returned as a dict."""
  times = kernel_times(load_events(find_trace(path)))
  by_kind: dict[str, float] = collections.defaultdict(float)
  for name, (us, _, _) in times.items():
    by_kind[kind_of(name)] += us
  total = sum(by_kind.values())
  kinds = {k: round(v / steps / 1e3, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
  tops = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
  ops = {}
  for n, (_, _, args) in tops[:8]:
    args = args or {}
    ops[n[:60]] = {k: str(v)[:160] for k, v in args.items()
                   if any(w in k.lower() for w in ("hlo", "op", "name", "module"))}
  return {
      "first_event_args": ops,
      "total_ms_per_step": round(total / steps / 1e3, 4),
      "by_kind_ms_per_step": kinds,
      "top_kernels": [{"name": n[:120], "kind": kind_of(n), "ms_per_step": round(us / steps / 1e3, 4),
                       "calls_per_step": round(c / steps, 2)} for n, (us, c, _) in tops],
  }


def print_summary(summary: dict) -> None:
  print(f"kernel time per step: {summary['total_ms_per_step']:.3f} ms")
  for kind, ms in summary["by_kind_ms_per_step"].items():
    print(f"  {kind:<10} {ms:8.3f} ms")
  print("top kernels (ms per step, calls per step):")
  for k in summary["top_kernels"]:
    print(f"  {k['ms_per_step']:8.3f} {k['calls_per_step']:7.1f}  [{k['kind']}] {k['name']}")
  for name, args in summary.get("first_event_args", {}).items():
    if args:
      print(f"  op of {name}: {args}")
  print("TRACE_SUMMARY " + json.dumps(summary), flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("trace")
  ap.add_argument("--steps", type=int, default=1, help="steps the trace covers")
  ap.add_argument("--top", type=int, default=15)
  args = ap.parse_args()
  print_summary(summarize(args.trace, args.steps, args.top))


if __name__ == "__main__":
  main()
