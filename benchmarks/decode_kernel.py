"""The decode attention kernel alone: time and achieved HBM bandwidth per launch setting.

    python benchmarks/decode_kernel.py --models qwen3-0.6b,qwen2.5-1.5b --batches 256 \
        --sweep "block_k=16,32,64;num_warps=2,4;num_stages=2,3,4;splits=1,2"
    python benchmarks/decode_kernel.py --kernels read,write   # flash_decode vs flash_decode_write
    python benchmarks/decode_kernel.py --models smollm2-135m,qwen2.5-1.5b --batches 256 \
        --kernels write,qkv --timer trace   # without and with the step's q / k preparation

Each measurement runs the kernel over `n_layers` distinct per-layer caches in one program (as a
decode step does, so no layer's cache is still in L2 when it is read) with every slot at
`--cached` keys, each call's query being the previous call's output (so that no two calls
overlap and no other kernel runs between them), and reports microseconds per call and the
bandwidth of the bytes it must read (live K and V, queries) and write, against the HBM peak
(`benchmarks.common.PEAKS`). Two ceilings come first: a Pallas kernel of the same grid and
blocks that only sums the live K/V (`decode_kernel_read_ceiling`: what this access pattern
allows a Triton kernel without the attention's arithmetic), and a reduction by XLA over the
same caches (`decode_kernel_ceiling`, `jnp.sum` in float32). `--kernels write` times
`flash_decode_write` (the kernel the write-first decode step runs: it also writes each slot's
new K/V row into the cache, which is donated from call to call so the write stays in place)
instead of `flash_decode`; `--kernels qkv` times `flash_decode_write_qkv` fed what the
engine's GPU decode step feeds it (`qkv_inputs`: the raw q|k|v projection, with the residual
stream's rows in front where the weights are chained), so that the kernel's preparation of q
and the new K/V (the folded norm's scale, bias, q / k norms, RoPE) is timed too.

`--timer trace` adds each kernel's own device time from a profiler trace (`kernel_us`,
`kernel_hbm_fraction`): the wall-clock time of the chain also counts the gaps between
launches, which for a 40-60 us kernel are a sizeable part (on an H100, 60-64% of the HBM peak
by the wall clock against 77-82% by the trace for the same kernels, benchmarks/RESULTS.md).
"""
import argparse
import functools
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.common import AUTO_ON_OFF, emit, peaks, timeit
from benchmarks.trace_summary import kernel_fields, traced_kernel_us
from jaxagent import models
from jaxagent.models import decode_attention
from jaxagent.models.decode_attention import (_cache_block, _compiler_params, _slot_inputs,
                                              flash_decode, flash_decode_write,
                                              flash_decode_write_qkv)

# (prompt tokens, max length) of each model's benchmark in generate.py / peer_tunix.py; the
# cached length defaults to the run's average (prompt + half the new tokens).
SHAPES = {"qwen3-0.6b": (128, 640), "smollm2-135m": (256, 768), "qwen2.5-1.5b": (256, 768)}


def _read_kernel(lens_ref, dep_ref, k_ref, v_ref, o_ref, *, block_k: int):
  n = (lens_ref[0] + block_k - 1) // block_k

  def body(b, acc):
    start = pl.multiple_of(b * block_k, block_k)
    k, v = k_ref[pl.ds(start, block_k), :], v_ref[pl.ds(start, block_k), :]
    return acc + k.astype(jnp.float32) + v.astype(jnp.float32)
  acc = jax.lax.fori_loop(0, n, body, jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32))
  o_ref[...] = acc.sum(0) + dep_ref[0, 0, :]


def read_ceiling(dep, cache_k, cache_v, lengths, *, block_k: int, num_warps: int,
                 num_stages: int, interpret: bool = False):
  """Sums the K and V blocks of `block_k` rows that hold each (slot, KV head)'s live rows,
  one program each (the decode kernel's grid and loads without its arithmetic). `dep`, the
  previous call's [S, KV, hd] float32 output (its first row is added to every output), chains
  calls without a kernel between them. Returns [S, KV, hd] float32."""
  s, kv, c, hd = cache_k.shape
  row = lambda i, j: (i, j, 0)
  specs, args = _slot_inputs(lengths, None, s, kv, row)
  spec = pl.BlockSpec((None, None, c, hd), lambda i, j: (i, j, 0, 0))
  return pl.pallas_call(
      functools.partial(_read_kernel, block_k=block_k), grid=(s, kv),
      in_specs=specs + [pl.BlockSpec((1, 1, hd), lambda i, j: (0, 0, 0)), spec, spec],
      out_specs=pl.BlockSpec((None, None, hd), row),
      out_shape=jax.ShapeDtypeStruct((s, kv, hd), jnp.float32), interpret=interpret,
      **_compiler_params(interpret, num_warps, num_stages))(*args, dep, cache_k, cache_v)


def qkv_inputs(cfg, s: int, lengths, chained: bool, key) -> dict:
  """Random inputs of `flash_decode_write_qkv` as the engine's GPU decode step hands them over
  for `cfg` with its prepared weights (`decoder.decode_in_place`): the raw q|k|v projection
  rows `x` (the residual stream's D / hd rows in front where the weights are chained, else the
  stream apart as `resid`, the folded attention norm), the RoPE table at `lengths`, and the
  bias and q / k norm weights where the model has them. `keep`: the rows after the kernel's
  output rows (the new keys and values), which a chain of calls appends to each output."""
  from jaxagent.models import decoder
  hd, kvh = cfg.head_dim, cfg.n_kv_heads
  lead = cfg.d_model // hd if chained else 0
  ks = jax.random.split(key, 4)
  x = jax.random.normal(ks[0], (s, lead + cfg.n_heads + 2 * kvh, hd), jnp.bfloat16)
  rope = decoder.decode_rope(lengths, jnp.asarray(decoder.rope_inv_freq(cfg)))
  out = dict(x=x, rope=rope, resid_rows=lead,
             keep=x[:, lead + cfg.n_heads:],
             bias=(jax.random.normal(ks[1], (cfg.n_heads + 2 * kvh, hd), jnp.bfloat16)
                   if cfg.qkv_bias else None),
             qk_norm=(1 + 0.1 * jax.random.normal(ks[2], (2, hd))).astype(jnp.bfloat16)
             if cfg.qk_norm else None,
             resid=None if chained else jax.random.normal(ks[3], (s, cfg.d_model),
                                                          jnp.bfloat16))
  return out


def parse_sweep(spec: str) -> list[dict]:
  axes = []
  for part in filter(None, (p.strip() for p in spec.split(";"))):
    key, _, vals = part.partition("=")
    axes.append([(key.strip(), int(v)) for v in vals.split(",")])
  return [dict(c) for c in itertools.product(*axes)] if axes else [{}]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--models", default="qwen3-0.6b,qwen2.5-1.5b,smollm2-135m")
  ap.add_argument("--batches", default="256")
  ap.add_argument("--cached", type=int, default=0, help="keys per slot (0: the run's average)")
  ap.add_argument("--layers", type=int, default=0, help="distinct caches per program "
                  "(0: the model's layer count)")
  ap.add_argument("--sweep", default="", help="'key=v1,v2;key=...' over the kernel's launch "
                  "settings (decode_attention.DEFAULT_TUNING keys); empty: the defaults")
  ap.add_argument("--kernels", default="read", help="read (flash_decode), write "
                  "(flash_decode_write), qkv (flash_decode_write_qkv fed the raw q|k|v "
                  "projection as the engine's GPU step feeds it: bias, norms, RoPE and the "
                  "folded norm's scale in the kernel), comma-separated")
  ap.add_argument("--chained", default="auto", choices=("auto", "on", "off"),
                  help="qkv kernel: the residual stream's rows in front of the projection, as "
                       "with chained decode weights (auto: where the engine chains them, "
                       "Engine.chain_weights on a GPU)")
  ap.add_argument("--rows", type=int, default=0, help="query rows per KV head (0: the "
                  "model's query heads per KV head, one decode token; an append of n tokens "
                  "has n times that)")
  ap.add_argument("--warps-as-given", action="store_true", help="launch with the sweep's "
                  "num_warps as given, without the warp per 2048 accumulator entries that "
                  "decode_attention adds (to measure what that rule avoids)")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--timer", default="wall", choices=("wall", "trace"),
                  help="wall: wall-clock time of the chain of calls (launch gaps included); "
                  "trace: also each kernel's own device time from a profiler trace "
                  "(kernel_us, kernel_hbm_fraction), without the gaps")
  ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU check "
                  "of the script, not a timing)")
  args = ap.parse_args()
  kernels = args.kernels.split(",")
  for kernel in kernels:
    if kernel not in ("read", "write", "qkv"):
      raise SystemExit(f"--kernels: unknown kernel {kernel!r} (expected read, write or qkv)")
  if "qkv" in kernels and args.rows:
    raise SystemExit("--rows: the qkv kernel takes one decode token (the model's query heads)")
  if args.warps_as_given:
    decode_attention._warps_for_tile = lambda num_warps, rows, hd: num_warps
  hbm = peaks()["hbm_bytes_s"]

  def traced_fields(fn, pattern: str, per_layer_bytes: float) -> dict:
    """With `--timer trace`: the mean device time of the kernels matching `pattern` while
    `fn()` runs, and the bandwidth of a layer's bytes at that time."""
    if args.timer != "trace":
      return {}
    return kernel_fields(traced_kernel_us(fn, pattern, iters=args.iters), per_layer_bytes, hbm)

  for name in args.models.split(","):
    cfg = models.get_config(name, param_dtype="bfloat16", dtype="bfloat16")
    prompt, cache_len = SHAPES.get(name, (256, 768))
    cached = args.cached or prompt + 256
    n_layers = args.layers or cfg.n_layers
    kv, g, hd = cfg.n_kv_heads, args.rows or cfg.q_per_kv, cfg.head_dim
    for s in map(int, args.batches.split(",")):
      keys = jax.random.split(jax.random.key(0), 2 * n_layers + 1)
      caches = [jax.random.normal(k, (s, kv, cache_len, hd), jnp.bfloat16)
                for k in keys[:2 * n_layers]]
      q = jax.random.normal(keys[-1], (s, kv, g, hd), jnp.bfloat16)
      lens = jnp.full((s,), cached, jnp.int32)
      moved = (2 * s * kv * cached * hd * 2 + 2 * q.size * 2) * n_layers
      # The read ceiling: the fastest of three launches that read fastest on an H100 (blocks
      # of 32 keys with 4 warps and 2 stages; 64 with 8 and 3 by the wall clock; 64 with 2
      # and 3 by the trace's kernel times). This kernel read slower with the decode kernel's
      # one warp (1.7-2.4 against 2.2-2.6 TB/s at 256 slots), probably because with no matmul
      # consuming the blocks Triton does not pipeline their loads.
      t, kfields = float("inf"), {}
      for bk, warps, stages in ((32, 4, 2), (64, 8, 3), (64, 2, 3)):
        read = jax.jit(lambda cs, bk=bk, warps=warps, stages=stages: functools.reduce(
            lambda dep, i: read_ceiling(dep, cs[2 * i], cs[2 * i + 1], lens,
                                        block_k=_cache_block(bk, cache_len), num_warps=warps,
                                        num_stages=stages, interpret=args.interpret),
            range(n_layers), jnp.zeros((s, kv, hd), jnp.float32)))
        t = min(t, timeit(lambda: jax.block_until_ready(read(caches)),
                          iters=args.iters)["median_s"])
        kf = traced_fields(lambda: jax.block_until_ready(read(caches)), r"^_read_kernel",
                           moved / n_layers)
        if kf.get("kernel_us") and kf["kernel_us"] < kfields.get("kernel_us", float("inf")):
          kfields = kf
      emit("decode_kernel_read_ceiling", model=name, batch=s, cached=cached,
           us_per_layer=t / n_layers * 1e6, bandwidth_tb_s=moved / t / 1e12,
           hbm_fraction=moved / t / hbm, **kfields)
      red = jax.jit(lambda cs: sum(jnp.sum(c[:, :, :cached], dtype=jnp.float32) for c in cs))
      t = timeit(lambda: jax.block_until_ready(red(caches)), iters=args.iters)["median_s"]
      # XLA may reduce each cache in more than one kernel: the trace's time is per kernel.
      emit("decode_kernel_ceiling", model=name, batch=s, cached=cached,
           us_per_layer=t / n_layers * 1e6, bandwidth_tb_s=moved / t / 1e12,
           hbm_fraction=moved / t / hbm)
      kn = jax.random.normal(keys[0], (s, kv, hd), jnp.bfloat16)
      chained = AUTO_ON_OFF[args.chained]
      if chained is None:
        from jaxagent.generate import Engine, EngineConfig
        chained = (jax.default_backend() == "gpu"
                   and Engine(cfg, EngineConfig(slots=s, max_len=cache_len)).chain_weights)
      qi = qkv_inputs(cfg, s, lens, chained, keys[-1]) if "qkv" in kernels else None
      for kernel, launch in itertools.product(kernels, parse_sweep(args.sweep)):

        def run(q, cs, lens, kernel=kernel, launch=launch):
          new = []
          if kernel == "qkv":
            q = qi["x"]
          for i in range(n_layers):
            # Each call's query is the last call's output (same shape): the calls run one
            # after the other with nothing in between (the qkv kernel: the output with the
            # new keys' and values' rows appended, one XLA concatenation between calls).
            if kernel == "qkv":
              out, ck, cv = flash_decode_write_qkv(
                  q, qi["rope"], cs[2 * i], cs[2 * i + 1], lens, qi["bias"], qi["qk_norm"],
                  qi["resid"], eps=cfg.norm_eps, resid_eps=cfg.norm_eps,
                  resid_rows=qi["resid_rows"], interpret=args.interpret, **launch)
              q = jnp.concatenate([out.reshape(s, -1, hd), qi["keep"]], axis=1)
              new += [ck, cv]
            elif kernel == "write":
              q, ck, cv = flash_decode_write(q, kn, kn, cs[2 * i], cs[2 * i + 1], lens,
                                             interpret=args.interpret, **launch)
              new += [ck, cv]
            else:
              q, _ = flash_decode(q, cs[2 * i], cs[2 * i + 1], lens, interpret=args.interpret,
                                  **launch)
          return q, new
        holder = [caches]

        def call(f):
          out, new = f(q, holder[0], lens)
          if new:
            holder[0] = new
          jax.block_until_ready(out)
        try:
          f = jax.jit(run, donate_argnums=(1,) if kernel != "read" else ())
          t = timeit(lambda: call(f), iters=args.iters)["median_s"]
          kf = traced_fields(lambda: call(f),
                             r"^_kernel" if kernel == "read" else r"^_write_kernel",
                             moved / n_layers)
        except Exception as e:  # report the setting that failed and go on
          emit("decode_kernel", model=name, batch=s, kernel=kernel, launch=launch,
               error=str(e)[:200])
          continue
        caches = holder[0]
        emit("decode_kernel", model=name, batch=s, cached=cached, rows=g, kernel=kernel,
             launch=launch, warps_as_given=args.warps_as_given,
             chained=chained if kernel == "qkv" else None,
             us_per_layer=t / n_layers * 1e6, bandwidth_tb_s=moved / t / 1e12,
             hbm_fraction=moved / t / hbm, **kf)
      caches = None  # free this batch size's caches before the next


if __name__ == "__main__":
  main()
