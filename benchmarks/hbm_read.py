"""HBM read bandwidth of one kernel by the size of what it reads (GPU).

    python benchmarks/hbm_read.py --sizes-mb 25,50,100,134,400,1600

A decode step reads each layer's live K/V in one attention kernel: about 100 MB per layer for
SmolLM2-135M and 134 MB for Qwen2.5-1.5B at 256 slots and 512 cached keys. This script asks
what fraction of the HBM peak (`benchmarks.common.PEAKS`) one kernel reading that much can
reach at all on the card, with nothing but the read:

  * "xla sum to rows": XLA's reduction of a `[rows, 128]` bfloat16 array over its last axis;
  * "pallas read": a Pallas (Triton) kernel whose programs each sum `rows_per_prog` contiguous
    rows in blocks of `blk` rows (the decode kernel's access pattern, one run of rows a
    program), for a few launch settings;
  * "tma read": a persistent Mosaic GPU kernel (Hopper or later): each of `ctas` CTAs sums its
    share of the rows through one pipeline of TMA copies of `blk` rows, `st` copies in flight,
    so the pipeline never drains between runs of rows.

Each size is read from several distinct arrays in turn (at least 600 MB in all) so that no read
finds the previous one in the L2 cache, each read's result feeding the next (so no two reads
overlap), 10 rounds in one `fori_loop`; the time is the best of 5 calls divided by the reads.
That wall-clock time also counts the gaps between the kernels; `--timer trace` adds each read
kernel's own device time from a profiler trace (`kernel_us`, `kernel_hbm_fraction`).
"""
import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.common import emit, peaks
from benchmarks.trace_summary import kernel_fields, traced_kernel_us

# (rows per program, warps, stages, rows per block) of the Pallas read.
PALLAS_SETTINGS = ((512, 1, 2, 32), (512, 4, 3, 64), (1024, 4, 4, 128), (4096, 8, 4, 256),
                   (1024, 2, 3, 64))
# (CTAs, copies in flight, rows per block) of the TMA read.
TMA_SETTINGS = ((128, 4, 32), (128, 4, 64), (256, 6, 32))


def _time(f, args, reads: int) -> float:
  g = jax.jit(f)
  jax.block_until_ready(g(*args))
  best = float("inf")
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(g(*args))
    best = min(best, time.perf_counter() - t0)
  return best / reads


def xla_sum(reps: int):
  def f(*xs):
    def body(i, dep):
      for x in xs:
        dep = jnp.sum(x.astype(jnp.float32) * (1 + dep[0] * 1e-30), axis=-1)[:1]
      return dep
    return jax.lax.fori_loop(0, reps, body, jnp.zeros((1,), jnp.float32))
  return f


def pallas_read_once(x, dep, *, rows_per_prog: int, warps: int, stages: int, block: int,
                     interpret: bool = False):
  """Program p sums rows `[p * rows_per_prog, (p + 1) * rows_per_prog)` of x `[n, d]` in
  blocks of `block` rows, plus dep `[1, d]`: returns `[n / rows_per_prog, d]` float32."""
  def kern(dep_ref, x_ref, o_ref):
    def body(b, acc):
      return acc + x_ref[pl.ds(pl.multiple_of(b * block, block), block), :].astype(jnp.float32)
    acc = jax.lax.fori_loop(0, rows_per_prog // block, body,
                            jnp.zeros((block, x_ref.shape[-1]), jnp.float32))
    o_ref[...] = acc.sum(0) + dep_ref[0]

  n, d = x.shape
  p = n // rows_per_prog
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = {"compiler_params": plt.CompilerParams(num_warps=warps, num_stages=stages)}
  return pl.pallas_call(
      kern, grid=(p,),
      in_specs=[pl.BlockSpec((1, d), lambda i: (0, 0)),
                pl.BlockSpec((rows_per_prog, d), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((None, d), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((p, d), jnp.float32), interpret=interpret,
      **params)(dep, x)


def chained_reads(one, reps: int):
  """A function of the arrays xs that reads each in turn with `one(x, dep)` (whose first row,
  `[1, d]`, is the next read's dep, so no two reads overlap), `reps` rounds in one loop."""
  def f(*xs):
    def body(i, dep):
      for x in xs:
        dep = one(x, dep)[:1] * 1e-30
      return dep
    return jax.lax.fori_loop(0, reps, body, jnp.zeros((1, xs[0].shape[-1]), jnp.float32))
  return f


def pallas_read(reps: int, rows_per_prog: int, warps: int, stages: int, block: int,
                interpret: bool = False):
  return chained_reads(functools.partial(pallas_read_once, rows_per_prog=rows_per_prog,
                                         warps=warps, stages=stages, block=block,
                                         interpret=interpret), reps)


def gpu_interpret_params():
  """Mosaic GPU's interpret mode (runs a kernel on the CPU: barriers, TMA copies): public in
  `jax.experimental.pallas.mosaic_gpu` from jax 0.11, in a private module in 0.10; None where
  this jax has neither."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  params = getattr(plgpu, "InterpretGPUParams", None)
  if params is None:
    try:
      from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
          InterpretGPUParams as params)
    except ImportError:
      return None
  return params()


def tma_read_once(x, dep, *, ctas: int, stages: int, block: int, interpret: bool = False):
  """CTA c sums rows `[c * n / ctas, (c + 1) * n / ctas)` of x `[n, d]` in blocks of `block`
  rows, copied by TMA in one pipeline with `stages` copies in flight: returns the sums
  `[ctas, block, d]` float32 (each CTA's blocks added up). dep, not read, orders this read
  after the kernel that made it."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  n, d = x.shape
  per = n // (ctas * block)

  def tma_read_kernel(x_g, dep_g, o_g, o_s):
    del dep_g
    cta = jax.lax.axis_index("c")

    def step(_, x_s, acc):
      return acc + x_s[...].astype(jnp.float32)
    spec = pl.BlockSpec((block, d), lambda b: (cta * per + b, 0))
    acc = plgpu.emit_pipeline(step, grid=(per,), in_specs=[spec], max_concurrent_steps=stages,
                              init_carry=jnp.zeros((block, d), jnp.float32))(x_g)
    o_s[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g.at[cta])
    plgpu.wait_smem_to_gmem(0)

  kw = {}
  if interpret:
    kw["interpret"] = gpu_interpret_params()
    if kw["interpret"] is None:
      raise NotImplementedError("this jax has no Mosaic GPU interpret mode")
  return plgpu.kernel(tma_read_kernel, out_type=jax.ShapeDtypeStruct((ctas, block, d),
                                                                     jnp.float32),
                      grid=(ctas,), grid_names=("c",),
                      scratch_types=[plgpu.SMEM((block, d), jnp.float32)], **kw)(x, dep)


def tma_read(reps: int, ctas: int, stages: int, block: int, interpret: bool = False):
  one = functools.partial(tma_read_once, ctas=ctas, stages=stages, block=block,
                          interpret=interpret)
  return chained_reads(lambda x, dep: one(x, dep)[0], reps)  # CTA 0's sums


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sizes-mb", default="25,50,100,134,400,1600")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--min-total-mb", type=int, default=600,
                  help="distinct arrays of each size are read in turn, this many MB in all")
  ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU check "
                  "that the script runs, not a measurement)")
  ap.add_argument("--timer", default="wall", choices=("wall", "trace"),
                  help="trace: also each read kernel's device time from a profiler trace")
  ap.add_argument("--record", action="store_true")
  args = ap.parse_args()
  peak = peaks()["hbm_bytes_s"]
  key = jax.random.key(0)
  for mb in map(int, args.sizes_mb.split(",")):
    n = mb * 2**20 // (128 * 2)
    arrays = max(2, args.min_total_mb // mb)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (n, 128), jnp.bfloat16)
          for i in range(arrays)]
    nbytes = mb * 2**20
    # (label, function, the name pattern of its read kernels in a profiler trace)
    runs = [("xla sum to rows", xla_sum(args.reps), r"reduce")]
    runs += [(f"pallas read rows/prog={r} w={w} st={st} blk={b}",
              pallas_read(args.reps, r, w, st, b, args.interpret), r"^kern")
             for r, w, st, b in PALLAS_SETTINGS
             if n % r == 0]
    runs += [(f"tma read ctas={c} st={st} blk={b}",
              tma_read(args.reps, c, st, b, args.interpret), r"tma_read")
             for c, st, b in TMA_SETTINGS
             if n % (c * b) == 0]
    for label, f, pattern in runs:
      try:
        t = _time(f, xs, args.reps * arrays)
        kernel = {}
        if args.timer == "trace":
          g = jax.jit(f)
          kernel = kernel_fields(traced_kernel_us(lambda xs=xs: jax.block_until_ready(g(*xs)),
                                                  pattern, iters=2), nbytes, peak)
      except Exception as e:  # one failing launch setting must not lose the others
        print(f"FAILED {mb} MB {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      by_trace = (f"  kernel {kernel['kernel_us']:7.1f} us {kernel['kernel_hbm_fraction']:6.1%}"
                  if kernel.get("kernel_us") else "")
      print(f"{label:48s} {mb:5d} MB {t * 1e6:9.1f} us {nbytes / t / 1e12:5.2f} TB/s "
            f"{nbytes / t / peak:6.1%}{by_trace}", flush=True)
      emit("hbm_read", args.record, kernel=label, size_mb=mb, us=t * 1e6,
           tb_s=nbytes / t / 1e12, hbm_fraction=nbytes / t / peak, **kernel)
    del xs


if __name__ == "__main__":
  main()
