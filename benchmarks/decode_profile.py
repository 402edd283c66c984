"""Where a decode step's time goes: times its pieces separately (a profiling aid).

    python benchmarks/decode_profile.py --model qwen2.5-1.5b --batch 256 --cached 512

Pieces: the whole engine step (the engine's decode program with its XLA options, `--steps`
steps a call, every slot put back at `--cached` keys before each call); the layer stack with
the cached attention (`extend`); the same with a tiny live-KV window (so attention costs
~nothing); the K/V write; sampling from `[batch, vocab]` logits; and, on GPU, the Pallas
flash-decoding kernel on the same cache.

Ablations (`--ablate attention,norms`): the engine's step again, compiled with a piece taken
out, so the difference to the whole step is that piece's share of the wall time, with no
profiler in the way. "attention": the decode kernel calls return the query as the attention
output and leave the caches as they are (the kernel's reads and writes are gone, the rest of
the step is unchanged); "norms": every RMS norm is the identity (the step with XLA's norms,
`--fold-norms off`: folded into the decode weights, they have no kernel of their own). The
outputs are meaningless; only the times are of use. Needs the Pallas decode step
(`--attention pallas`, the GPU's default).

    python benchmarks/decode_profile.py --model smollm2-135m --batch 256 --cached 512 \
        --ablate attention,norms --fold-norms off --trace /tmp/trace --trace-only

Split batch (`--split 2`): `decoder.decode_in_place` over the whole batch, then over two
halves with caches of their own in one program, with XLA's command buffer scheduling as
configured and with `xla_gpu_command_buffer_scheduling_mode=CONCURRENT`, which lets the CUDA
graph run the halves' independent kernels at the same time (one half's attention beside the
other's GEMMs). Merged weights, 8 steps a call, every slot at `--cached` keys.
"""
import argparse
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (add_decode_switches, decode_roofline_bytes, decode_switch_run,
                               emit, mean_live_kv, peaks, timeit)
from jaxagent import models
from jaxagent.generate import Engine, EngineConfig, SamplingConfig, sample, token_keys
from jaxagent.generate.engine import DECODE_GPU_OPTIONS
from jaxagent.models import decoder

ABLATIONS = ("attention", "norms")


def ablation(name: str):
  """(stand-ins for `decoder` functions by name, list that each stand-in call appends to)."""
  calls = []
  if name == "attention":
    def write(q, k_new, v_new, cache_k, cache_v, lens, interpret, share=None):
      calls.append(name)
      return q, cache_k, cache_v

    def write_qkv(qkv, rope, cache_k, cache_v, lens, bias, norms, eps, interpret, share=None,
                  resid=None, resid_eps=0.0, resid_rows=0, layer=None):
      calls.append(name)
      s, rows, hd = qkv.shape
      kv = cache_k.shape[1]
      if resid_rows:  # chained weights: the stream's rows, then the heads
        return qkv[:, :rows - 2 * kv], cache_k, cache_v
      return qkv[:, :rows - 2 * kv].reshape(s, kv, -1, hd), cache_k, cache_v
    return {"_flash_decode_write": write, "_flash_decode_write_qkv": write_qkv}, calls
  if name == "norms":
    def identity(x, w, eps):
      calls.append(name)
      return x
    return {"rms_norm": identity}, calls
  raise SystemExit(f"--ablate: unknown piece {name!r}; one of {', '.join(ABLATIONS)}")


def roofline_ms(cfg, slots: int, cached: int, steps: int) -> float:
  """`decode_roofline_bytes` over the HBM bandwidth, in ms, for a step of a `held_step` call:
  its `steps` steps start from `cached` keys and advance by one each (`mean_live_kv`)."""
  return decode_roofline_bytes(cfg, slots, mean_live_kv(cached, steps)) / peaks()[
      "hbm_bytes_s"] * 1e3


def held_step(eng: Engine, params, slots: int, cached: int, kv_len: int, steps: int):
  """A function running the engine's own decode program (its XLA options included), `steps`
  steps a call, every slot put back at `cached` keys first: a step advances each slot by one,
  and without the reset the timed and traced steps would drift past `cached`. The params are
  prepared once (`Engine.prepare`), as rollouts and `generate.py` do, so no call starts by
  making the merged decode weights."""
  params = eng.prepare(params)
  state = eng.init_decode_state()
  holder = [state.replace(lengths=jnp.full((slots,), cached, jnp.int32),
                          active=jnp.ones((slots,), bool),
                          remaining=jnp.full((slots,), 10**6, jnp.int32))]

  def run_step():
    st = holder[0].replace(lengths=np.full((slots,), cached, np.int32))
    holder[0], o = eng.generate(params, st, steps=steps, kv_len=kv_len)
    jax.block_until_ready(o)
  return run_step, holder


def ablated_step_ms(name, cfg, ecfg, params, slots, cached, kv_len, steps) -> float:
  """The engine's step time compiled with `ablation(name)`'s stand-ins in `decoder`."""
  patches, calls = ablation(name)
  with mock.patch.multiple(decoder, **patches):
    eng = Engine(cfg, ecfg)
    run_step, _ = held_step(eng, params, slots, cached, kv_len, steps)
    run_step()  # compiles with the stand-ins
    if not calls:
      raise SystemExit(f"--ablate {name}: the engine's decode step does not call what this "
                       "ablation replaces (it needs the Pallas decode step: --attention "
                       "pallas, per-layer cache)")
    return timeit(run_step, iters=10)["median_s"] * 1e3 / steps


def split_step_ms(cfg, params, slots: int, cached: int, parts: int, options: dict,
                  steps: int = 8) -> float:
  """Per-step time of `decoder.decode_in_place` over `parts` equal parts of `slots`, each with
  its own caches, in one program (`steps` steps a call, every slot at `cached` keys)."""
  if slots % parts:
    raise SystemExit(f"--split {parts} does not divide --batch {slots}")
  s = slots // parts
  merged = jax.jit(lambda p: decoder.merge_decode_weights(p, cfg))(params)
  cap = -(-(cached + 16) // 64) * 64
  shape = (s, cfg.n_kv_heads, cap, cfg.head_dim)

  def caches(seed):
    return tuple(jax.random.normal(jax.random.key(seed + i), shape, cfg.jnp_dtype) * 0.5
                 for i in range(cfg.n_layers))

  def run(state, mp):
    lens = jnp.full((s,), cached, jnp.int32)

    def body(_, st):
      out = []
      for ck, cv, tok in st:
        logits, ck, cv = decoder.decode_in_place(mp, ck, cv, tok, lens, cfg=cfg)
        out.append((ck, cv, jnp.argmax(logits, -1).astype(jnp.int32)))
      return tuple(out)
    return jax.lax.fori_loop(0, steps, body, state)

  fn = jax.jit(run, donate_argnums=0, compiler_options=options or None)
  holder = [tuple((caches(1000 * i), caches(1000 * i + 500), jnp.zeros((s,), jnp.int32))
                  for i in range(parts))]

  def call():
    holder[0] = fn(holder[0], merged)
    jax.block_until_ready(holder[0])
  return timeit(call, iters=6)["median_s"] * 1e3 / steps


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="qwen2.5-1.5b")
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--cached", type=int, default=512)
  ap.add_argument("--max-len", type=int, default=784)
  ap.add_argument("--trace", default="", help="also write a profiler trace of 5 engine calls "
                  "(with a Perfetto JSON) to this directory")
  ap.add_argument("--trace-only", action="store_true", help="skip the piecewise timings")
  ap.add_argument("--layout", default="auto", help="KV cache layout: auto, stacked or per_layer")
  ap.add_argument("--merge", action="store_true", help="the extend + write_kv decode step "
                  "instead of the write-first one (EngineConfig.decode_write_first=False)")
  ap.add_argument("--steps", type=int, default=8, help="decode steps per engine call (the "
                  "scheduler's default; from 8 the engine merges the q|k|v and gate|up weights)")
  ap.add_argument("--attention", default="auto", help="decode attention: auto, xla, pallas")
  ap.add_argument("--ablate", default="", help="comma-separated pieces to time the step "
                  f"without, one at a time: {', '.join(ABLATIONS)}")
  add_decode_switches(ap)  # one value each here (--ablate norms needs --fold-norms off)
  ap.add_argument("--split", type=int, default=0, help="also time the batch as this many "
                  "parts in one program, serial and concurrent command buffer scheduling")
  args = ap.parse_args()
  ablate = [a for a in args.ablate.split(",") if a]
  switches = decode_switch_run(args)
  for a in ablate:
    ablation(a)  # a clear error for an unknown piece before anything compiles
  cfg = models.get_config(args.model, param_dtype="bfloat16", dtype="bfloat16")
  params = jax.jit(lambda k: models.init_params(cfg, k))(jax.random.key(0))
  S, C = args.batch, args.cached
  ecfg = EngineConfig(slots=S, max_len=args.max_len, sampling=SamplingConfig(1.0),
                      cache_layout=args.layout, decode_write_first=not args.merge,
                      decode_attention=args.attention, **switches)
  eng = Engine(cfg, ecfg)
  if "norms" in ablate and eng.fold_norms:
    raise SystemExit("--ablate norms replaces XLA's RMS norms; with the norms folded into the "
                     "decode weights the step has none but the final one: add --fold-norms off")
  kv_len = eng.kv_len_for(C + args.steps)
  out = {}
  run_step, holder = held_step(eng, params, S, C, kv_len, args.steps)
  out["full_step_ms"] = timeit(run_step, iters=10)["median_s"] * 1e3 / args.steps
  for a in ablate:
    out[f"no_{a}_step_ms"] = ablated_step_ms(a, cfg, ecfg, params, S, C, kv_len, args.steps)
    out[f"{a}_ms"] = out["full_step_ms"] - out[f"no_{a}_step_ms"]
  if args.split:
    gpu = jax.default_backend() == "gpu"
    base = dict(DECODE_GPU_OPTIONS) if gpu else {}
    conc = {**base, "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"} if gpu else {}
    out["split1_step_ms"] = split_step_ms(cfg, params, S, C, 1, base)
    out[f"split{args.split}_step_ms"] = split_step_ms(cfg, params, S, C, args.split, base)
    out[f"split{args.split}_concurrent_step_ms"] = split_step_ms(cfg, params, S, C, args.split,
                                                                 conc)
  if args.trace:
    with jax.profiler.trace(args.trace, create_perfetto_trace=True):
      for _ in range(5):
        run_step()
    print(f"trace written to {args.trace}", flush=True)
    from benchmarks import trace_summary
    trace_summary.print_summary(trace_summary.summarize(args.trace, steps=5 * args.steps,
                                                        top=25))
    if args.trace_only:
      emit("decode_profile", model=args.model, batch=S, cached=C, steps=args.steps,
           roofline_step_ms=roofline_ms(cfg, S, C, args.steps), **out)
      return

  st = holder[0]
  ext = jax.jit(lambda p, s, n: decoder.extend(p, s.k, s.v, s.tokens[:, None], s.lengths,
                                               cfg=cfg, kv_len=n), static_argnums=(2,))
  out["extend_ms"] = timeit(lambda: jax.block_until_ready(ext(params, st, kv_len)),
                            iters=10)["median_s"] * 1e3
  small = jax.jit(lambda p, s: decoder.extend(p, s.k, s.v, s.tokens[:, None],
                                              jnp.minimum(s.lengths, 64), cfg=cfg, kv_len=64))
  out["extend_kv64_ms"] = timeit(lambda: jax.block_until_ready(small(params, st)),
                                 iters=10)["median_s"] * 1e3
  unr = jax.jit(lambda p, s, n: decoder.extend(p, s.k, s.v, s.tokens[:, None], s.lengths,
                                               cfg=cfg, kv_len=n, unroll=True),
                static_argnums=(2,))
  out["extend_unrolled_ms"] = timeit(lambda: jax.block_until_ready(unr(params, st, kv_len)),
                                     iters=10)["median_s"] * 1e3
  unr64 = jax.jit(lambda p, s: decoder.extend(p, s.k, s.v, s.tokens[:, None],
                                              jnp.minimum(s.lengths, 64), cfg=cfg, kv_len=64,
                                              unroll=True))
  out["extend_unrolled_kv64_ms"] = timeit(lambda: jax.block_until_ready(unr64(params, st)),
                                          iters=10)["median_s"] * 1e3
  newk = jnp.zeros((cfg.n_layers, S, 1, cfg.n_kv_heads, cfg.head_dim), cfg.jnp_dtype)
  wr = jax.jit(lambda c, n, l: decoder.write_kv(c, n, jnp.arange(S), l), donate_argnums=(0,))
  cache = [jax.tree.map(jnp.zeros_like, st.k)]

  def run_write():
    cache[0] = wr(cache[0], newk, st.lengths)
    jax.block_until_ready(cache[0])
  out["write_kv_ms"] = timeit(run_write, iters=10)["median_s"] * 1e3
  cache.clear()
  print("partial", out, flush=True)
  logits = jax.random.normal(jax.random.key(1), (S, cfg.vocab_size), jnp.float32)
  smp = jax.jit(lambda l, s: sample(l, token_keys(s.seeds, s.request_ids, s.lengths),
                                    SamplingConfig(1.0)))
  out["sample_ms"] = timeit(lambda: jax.block_until_ready(smp(logits, st)),
                            iters=10)["median_s"] * 1e3
  greedy = jax.jit(lambda l, s: sample(l, None, SamplingConfig(0.0)))
  out["sample_greedy_ms"] = timeit(lambda: jax.block_until_ready(greedy(logits, st)),
                                   iters=10)["median_s"] * 1e3
  if jax.default_backend() == "gpu":
    from jax.experimental.pallas.ops.gpu import decode_attention as da
    q = jax.random.normal(jax.random.key(2), (S, cfg.n_heads, cfg.head_dim), cfg.jnp_dtype)
    k = st.k[0]  # [S, KV, Lmax, hd]
    lens = st.lengths
    knew = k[:, :, :1].swapaxes(1, 2)

    def attn_xla():
      return decoder.cached_attention(q[:, None], knew, knew, k[:, :, :kv_len],
                                      k[:, :, :kv_len], lens, cfg)
    out["attn_xla_1layer_ms"] = timeit(lambda: jax.block_until_ready(jax.jit(attn_xla)()),
                                       iters=10)["median_s"] * 1e3
    from jaxagent.models.decode_attention import flash_decode
    qk = q.reshape(S, cfg.n_kv_heads, cfg.q_per_kv, cfg.head_dim)
    ours = jax.jit(lambda q, k, v, n: flash_decode(q, k, v, n))
    out["attn_flash_decode_1layer_ms"] = timeit(
        lambda: jax.block_until_ready(ours(qk, k[:, :, :kv_len], k[:, :, :kv_len], lens)),
        iters=10)["median_s"] * 1e3
    pext = jax.jit(lambda p, s, n: decoder.extend(p, s.k, s.v, s.tokens[:, None], s.lengths,
                                                  cfg=cfg, kv_len=n, attn_impl="pallas"),
                   static_argnums=(2,))
    out["extend_pallas_ms"] = timeit(lambda: jax.block_until_ready(pext(params, st, kv_len)),
                                     iters=10)["median_s"] * 1e3
    pal = jax.jit(lambda q, k, v, n: da.gqa(q, k, v, kv_seq_len=n))
    try:
      kt = k.swapaxes(1, 2)
      out["attn_pallas_1layer_ms"] = timeit(lambda: jax.block_until_ready(pal(q, kt, kt, lens)),
                                            iters=10)["median_s"] * 1e3
    except Exception as e:  # report and continue
      out["attn_pallas_error"] = str(e)[:300]
  emit("decode_profile", model=args.model, batch=S, cached=C, steps=args.steps,
       roofline_step_ms=roofline_ms(cfg, S, C, args.steps), **out)


if __name__ == "__main__":
  main()
