"""Where a decode step's time goes: times its pieces separately (a profiling aid).

    python benchmarks/decode_profile.py --model qwen2.5-1.5b --batch 256 --cached 512

Pieces: the whole engine step (the engine's decode program with its XLA options, one step
per call, every slot at `--cached` keys); the layer stack with the cached attention
(`extend`); the same with a tiny live-KV window (so attention costs ~nothing); the K/V write;
sampling from `[batch, vocab]` logits; and, on GPU, the Pallas flash-decoding kernel on the
same cache.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import emit, peaks, timeit
from jaxagent import models
from jaxagent.generate import Engine, EngineConfig, SamplingConfig, sample, token_keys
from jaxagent.models import decoder


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="qwen2.5-1.5b")
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--cached", type=int, default=512)
  ap.add_argument("--max-len", type=int, default=784)
  ap.add_argument("--trace", default="", help="also write a profiler trace of 5 engine steps "
                  "(with a Perfetto JSON) to this directory")
  ap.add_argument("--trace-only", action="store_true", help="skip the piecewise timings")
  ap.add_argument("--layout", default="auto", help="KV cache layout: auto, stacked or per_layer")
  ap.add_argument("--merge", action="store_true", help="the extend + write_kv decode step "
                  "instead of the write-first one (EngineConfig.decode_write_first=False)")
  args = ap.parse_args()
  cfg = models.get_config(args.model, param_dtype="bfloat16", dtype="bfloat16")
  params = jax.jit(lambda k: models.init_params(cfg, k))(jax.random.key(0))
  S, C = args.batch, args.cached
  eng = Engine(cfg, EngineConfig(slots=S, max_len=args.max_len, sampling=SamplingConfig(1.0),
                                 cache_layout=args.layout, decode_write_first=not args.merge))
  state = eng.init_decode_state()
  state = state.replace(lengths=jnp.full((S,), C, jnp.int32), active=jnp.ones((S,), bool),
                        remaining=jnp.full((S,), 10**6, jnp.int32))
  kv_len = eng.kv_len_for(C + 1)
  out = {}

  holder = [state]

  def run_step():
    # The engine's own decode program (its XLA options included), one step per call, every
    # slot put back at C cached keys first: a step advances each slot by one, and without
    # the reset the timed and traced steps would drift past --cached.
    st = holder[0].replace(lengths=np.full((S,), C, np.int32))
    holder[0], o = eng.generate(params, st, steps=1, kv_len=kv_len)
    jax.block_until_ready(o)
  out["full_step_ms"] = timeit(run_step, iters=10)["median_s"] * 1e3
  if args.trace:
    with jax.profiler.trace(args.trace, create_perfetto_trace=True):
      for _ in range(5):
        run_step()
    print(f"trace written to {args.trace}", flush=True)
    from benchmarks import trace_summary
    trace_summary.print_summary(trace_summary.summarize(args.trace, steps=5, top=25))
    if args.trace_only:
      emit("decode_profile", model=args.model, batch=S, cached=C, **out)
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
  kv_tok = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2
  roof = (cfg.num_params() * 2 + S * C * kv_tok) / peaks()["hbm_bytes_s"] * 1e3
  emit("decode_profile", model=args.model, batch=S, cached=C, roofline_step_ms=roof, **out)


if __name__ == "__main__":
  main()
