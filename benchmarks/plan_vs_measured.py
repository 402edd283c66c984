"""How far the planner's time estimates can be trusted: estimate vs measured, same programs.

    python benchmarks/plan_vs_measured.py --config=configs/math_tool.py:gpu [--config.key=value]

Runs `jaxagent.plan.plan_run` on this machine's devices (the programs a run of `--config` uses,
compiled with the run's shardings), then executes each compiled program on zero-filled inputs
of its exact shapes and prints, per program: the planner's roofline estimate (loop-aware HLO
flops and bytes over the chip's peaks, `est_s`), XLA's own `cost_analysis()` roofline (which
counts each loop body once), the measured median time, and measured / estimate. A ratio near 1
means the program runs at the roofline the planner assumes; the ratios on GPU say how much
slack to allow when reading a TPU plan's times.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (`path.py[:variant]`).")
_ITERS = flags.DEFINE_integer("iters", 5, "Timed calls per program.")
_PROGRAMS = flags.DEFINE_list("programs", [], "Only these program kinds.")
_RECORD = flags.DEFINE_bool("record", False, "Append the results to benchmarks/RESULTS.md.")


def _materialise(tree):
  """Device arrays of the abstract arguments' shapes, dtypes and shardings (zeros; ones for
  segment ids so that attention sees real tokens)."""
  import jax
  import jax.numpy as jnp

  def one(path, a):
    if not isinstance(a, jax.ShapeDtypeStruct):
      return a
    name = jax.tree_util.keystr(path)
    fill = 1 if "segment_ids" in name else 0
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      make = lambda: jax.random.key(0) if a.shape == () else jax.random.split(
          jax.random.key(0), a.shape[0])
    else:
      make = lambda: jnp.full(a.shape, fill, a.dtype)
    return jax.jit(make, out_shardings=a.sharding)()
  return jax.tree_util.tree_map_with_path(one, tree)


def main(argv):
  del argv
  import jax
  import numpy as np
  from benchmarks.common import emit
  from jaxagent import plan

  config = _CONFIG.value
  execs = {}
  options = plan.PlanOptions(programs=tuple(_PROGRAMS.value))
  report = plan.plan_run(config, "local", options=options, executables=execs)
  chip = report.chip
  print(f"{report.model} on {report.n_devices} x {jax.devices()[0].device_kind}, mesh "
        f"{report.mesh}")
  hdr = (f"{'program':<14} {'shapes':<34} {'est ms':>9} {'bound':>7} {'xla est ms':>10} "
         f"{'measured ms':>11} {'meas/est':>8}")
  print(hdr)
  rows = []
  for rep in report.programs:
    if rep.name not in execs:
      print(f"{rep.name:<14} not compiled: {rep.error}")
      continue
    compiled, args = execs[rep.name]
    times = []
    for i in range(_ITERS.value + 1):
      live = _materialise(args)  # fresh inputs: programs donate theirs
      jax.block_until_ready(live)
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(*live))
      if i:  # the first call is a warm-up
        times.append(time.perf_counter() - t0)
      del live
    measured = float(np.median(times))
    peak, bw = chip.peak_flops(config.model.dtype), chip.hbm_bandwidth
    xla_est = None
    if rep.xla_flops is not None and peak and bw:
      xla_est = max(rep.xla_flops / peak, (rep.xla_bytes or 0.0) / bw)
    ratio = measured / rep.est_s if rep.est_s else float("nan")
    print(f"{rep.name:<14} {rep.shapes:<34} {1e3 * (rep.est_s or float('nan')):9.3f} "
          f"{rep.bound:>7} {1e3 * (xla_est or float('nan')):10.3f} {1e3 * measured:11.3f} "
          f"{ratio:8.2f}")
    rows.append(dict(program=rep.name, shapes=rep.shapes, est_s=rep.est_s, bound=rep.bound,
                     xla_est_s=xla_est, measured_s=measured, ratio=ratio,
                     flops=rep.flops, bytes=rep.bytes_accessed))
  emit("plan_vs_measured", record=_RECORD.value, model=report.model, mesh=report.mesh,
       programs=rows)


if __name__ == "__main__":
  app.run(main)
