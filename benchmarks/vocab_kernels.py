"""Token log-probs over the vocabulary, one chunk: the XLA path against the fused kernels.

    python benchmarks/vocab_kernels.py --models qwen3-0.6b --tokens 4096
    python benchmarks/vocab_kernels.py --sweep "block_n=128,256;num_warps=4,8" --parts kernels

Per model shape (bf16, hidden size and vocabulary of the preset, its tied or untied output
weight) and `--tokens` tokens, times:
  * `chunk`: what the learner runs per chunk (`logprobs._chunk_logprobs`, recomputing path):
    the forward pass alone and the forward and backward passes together, with the XLA path
    (a matmul to float32 logits, then passes over them) and the fused one
    (`jaxagent.models.vocab_kernels`), and how far apart the two paths' log-probs and
    gradients are (the cotangent is rounded to bf16 on both);
  * `kernels`: the two kernels alone, per launch setting of `--sweep`, with the matmul's
    throughput (2 x tokens x d x vocab FLOPs per call) against the bf16 peak. The XLA path's
    matmul to float32 logits is the first line, for reference.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from benchmarks.common import emit, list_option, peaks, timeit
from benchmarks.decode_kernel import parse_sweep
from jaxagent import models
from jaxagent.models import logprobs, vocab_kernels


def _problem(name, tokens, seed=0):
  cfg = models.get_config(name, dtype="bfloat16", param_dtype="bfloat16")
  k = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(k[0], (tokens, cfg.d_model)).astype(jnp.bfloat16)
  shape = (cfg.vocab_size, cfg.d_model) if cfg.tie_embeddings else (cfg.d_model, cfg.vocab_size)
  w = (0.05 * jax.random.normal(k[1], shape)).astype(jnp.bfloat16)
  targets = jax.random.randint(k[2], (tokens,), 0, cfg.vocab_size)
  g = jax.random.normal(k[3], (tokens,))
  return cfg, h, w, targets, g


def _time(fn, *args, iters):
  out = fn(*args)
  jax.block_until_ready(out)
  return timeit(lambda: jax.block_until_ready(fn(*args)), warmup=1, iters=iters)["median_s"]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--models", default="qwen3-0.6b")
  ap.add_argument("--tokens", type=int, default=4096, help="tokens per chunk (the learner's "
                  "default StepConfig.logprob_chunk_tokens)")
  ap.add_argument("--temperature", type=float, default=0.9)
  ap.add_argument("--parts", default="chunk,kernels")
  ap.add_argument("--sweep", default="", help='launch settings of the kernels, e.g. '
                  '"block_m=64,128;num_warps=4,8" (default: the module\'s defaults)')
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--interpret", action="store_true", help="the kernels of `--parts kernels` "
                  "in Pallas interpret mode (CPU; `chunk` picks it by the backend)")
  ap.add_argument("--record", action="store_true")
  args = ap.parse_args()
  parts = set(list_option("--parts", args.parts, ["chunk", "kernels"]))
  peak = peaks()["bf16_flops"]
  for name in args.models.split(","):
    cfg, h, w, targets, g = _problem(name, args.tokens)
    tied, temp = cfg.tie_embeddings, jnp.float32(args.temperature)
    flops = 2 * args.tokens * cfg.d_model * cfg.vocab_size
    common = dict(model=name, tokens=args.tokens, d=cfg.d_model, vocab=cfg.vocab_size)
    if "chunk" in parts:
      row, outs = {}, {}
      for path, fused in (("xla", False), ("fused", True)):

        def fwd(h, w, fused=fused):
          return logprobs._chunk_logprobs(h, w, targets, temp, tied, False, False, False, fused)

        def fwd_bwd(h, w, fused=fused):
          (lp, _), vjp = jax.vjp(fwd, h, w)
          return lp, vjp((g, jnp.zeros_like(g)))

        outs[path] = jax.jit(fwd_bwd)(h, w)
        row[path] = dict(forward_ms=1e3 * _time(jax.jit(fwd), h, w, iters=args.iters),
                         forward_backward_ms=1e3 * _time(jax.jit(fwd_bwd), h, w,
                                                         iters=args.iters))
      (lp_x, grads_x), (lp_f, grads_f) = outs["xla"], outs["fused"]
      rel = lambda a, b: float(jnp.linalg.norm((a.astype(jnp.float32) - b.astype(jnp.float32))
                                               .ravel()) / jnp.linalg.norm(
                                                   a.astype(jnp.float32).ravel()))
      emit("vocab_chunk", args.record, **common, **row,
           speedup=row["xla"]["forward_backward_ms"] / row["fused"]["forward_backward_ms"],
           logprob_max_abs_diff=float(jnp.max(jnp.abs(lp_x - lp_f))),
           grad_rel_diff={"h": rel(grads_x[0], grads_f[0]), "w": rel(grads_x[1], grads_f[1])})
    if "kernels" in parts:
      gemm = jax.jit(lambda h, w: logprobs._project(h, w, tied))
      t = _time(gemm, h, w, iters=args.iters)
      emit("vocab_kernels_xla_matmul", args.record, **common, ms=1e3 * t,
           tflops=flops / t / 1e12, peak_fraction=flops / t / peak)
      lse, _ = vocab_kernels.logsumexp(h, w, 1.0 / temp, tied=tied, interpret=args.interpret)
      for launch in parse_sweep(args.sweep):
        items = tuple(sorted(launch.items()))
        full = {**vocab_kernels.tuning(), **launch}
        if cfg.vocab_size % full["block_n"] or cfg.d_model % full["block_k"]:
          emit("vocab_kernels", args.record, **common, launch=launch,
               error="the launch's blocks do not tile this shape")
          continue
        try:
          fl = lambda h, w: vocab_kernels.logsumexp(h, w, 1.0 / temp, tied=tied,
                                                    interpret=args.interpret, launch=items)
          fc = lambda h, w: vocab_kernels.cotangent(h, w, 1.0 / temp, lse, g, targets,
                                                    tied=tied, interpret=args.interpret,
                                                    launch=items)
          t_l, t_c = _time(fl, h, w, iters=args.iters), _time(fc, h, w, iters=args.iters)
        except Exception as e:  # a launch Triton cannot compile: report it, go on
          emit("vocab_kernels", args.record, **common, launch=launch,
               error=f"{type(e).__name__}: {str(e)[:200]}")
          continue
        emit("vocab_kernels", args.record, **common, launch=launch,
             logsumexp_ms=1e3 * t_l, logsumexp_tflops=flops / t_l / 1e12,
             cotangent_ms=1e3 * t_c, cotangent_tflops=flops / t_c / 1e12,
             peak_fraction=[flops / t_l / peak, flops / t_c / peak])


if __name__ == "__main__":
  main()
