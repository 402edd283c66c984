"""Decode throughput of the engine and its fraction of the HBM-bandwidth roofline.

    python benchmarks/generate.py --models smollm2-135m,qwen2.5-1.5b --batches 64,256

Random-init bf16 weights; `--prompt-len` random prompt tokens per slot, then `--new-tokens`
decode steps for every slot (no EOS). The roofline is the bytes one decode step must read,
weights plus the live K/V of every slot, over the HBM bandwidth, averaged over the run.

A sweep over cache layouts, attention paths and the Pallas kernel's launch settings:

    python benchmarks/generate.py --models qwen3-0.6b --batches 256 \
        --variants "stacked/auto/;per_layer/auto/;per_layer/pallas/block_k=128,num_warps=8"

The decode program with and without the q|k|v and gate|up weights merged once per call:

    python benchmarks/generate.py --models smollm2-135m --batches 256 --merge-weights on,off

The params are prepared once for the run, as rollouts do (`Engine.prepare`: the merged
weights made once, not at the start of every decode call); `--prepare on,off` compares:

    python benchmarks/generate.py --models qwen2.5-1.5b --batches 256 --prepare on,off

With merged weights, the decode kernel fed the raw q|k|v projection (bias, q / k norms and
RoPE in the kernel; head sizes up to `decode_attention.FUSED_QKV_MAX_HEAD_DIM`) against q, k
and v prepared by XLA:

    python benchmarks/generate.py --models smollm2-135m --batches 256 --fused-qkv on,off

The layer norms' weights folded into the merged matrices (their row scales in the decode
kernel and the SwiGLU kernel, no norm kernel a layer) against XLA's norms:

    python benchmarks/generate.py --models smollm2-135m,qwen2.5-1.5b --batches 256 \
        --fold-norms on,off

The prepared decode matrices chained, two GEMMs a layer instead of four (auto: small models):

    python benchmarks/generate.py --models smollm2-135m --batches 256 --chain-weights on,off

Samples of one prompt (a GRPO group), with and without the engine's prompt sharing:

    python benchmarks/generate.py --models qwen3-0.6b --batches 512 --prompt-len 128 \
        --group 8 --share on,off

each variant `layout/attention/kernel[/merge]` (kernel: `JAXAGENT_DECODE_KERNEL` settings, see
`jaxagent/models/decode_attention.py`; `/merge`: the new token's K/V written after the layer
stack and its attention merged by log-sum-exp, instead of `EngineConfig.decode_write_first`).
"""
import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from benchmarks.common import (ON_OFF, add_decode_switches, decode_roofline_bytes,
                               decode_switch_runs, emit, kv_bytes_per_token, list_option,
                               mean_live_kv, peaks)
from jaxagent import models
from jaxagent.models import decoder
from jaxagent.generate import Engine, EngineConfig, SamplingConfig


def run(name, batch, prompt_len, new_tokens, steps, record, attention="auto", temperature=1.0,
        layout="auto", kernel="", write_first=True, xla_options=None, group=1, share=True,
        norm_rope="auto", prepare=True, switches=None):
  os.environ["JAXAGENT_DECODE_KERNEL"] = kernel
  cfg = models.get_config(name, param_dtype="bfloat16", dtype="bfloat16",
                          norm_rope_impl=norm_rope)
  params = jax.jit(lambda k: models.init_params(cfg, k))(jax.random.key(0))
  max_len = prompt_len + new_tokens + steps
  eng = Engine(cfg, EngineConfig(slots=batch, max_len=max_len, eos_ids=(),
                                 sampling=SamplingConfig(temperature), kv_page=128,
                                 decode_attention=attention, cache_layout=layout,
                                 decode_write_first=write_first,
                                 decode_gpu_options=xla_options, share_prompts=share,
                                 **(switches or {})))
  rng = np.random.default_rng(0)
  if batch % group or 64 % group:
    raise SystemExit(f"--group {group} must divide the batch {batch} and 64 (a prefill call)")
  prompts = np.repeat(rng.integers(0, cfg.vocab_size, (batch // group, prompt_len)), group,
                      0).tolist()

  # As a rollout does (`Engine.prepare`): the merged decode weights made once for the run (a
  # rollout makes them once per policy version), not at the start of every decode call.
  run_params = eng.prepare(params) if prepare else params

  def one_pass():
    state = eng.init_decode_state()
    t0 = time.perf_counter()
    for i in range(0, batch, 64):
      rows = list(range(i, min(i + 64, batch)))
      state, _ = eng.prefill_insert(run_params, state, prompts[i:i + 64], rows, rows)
    jax.block_until_ready(state.k)
    t1 = time.perf_counter()
    done = 0
    while done < new_tokens - 1:
      state, out = eng.generate(run_params, state, steps=steps,
                                kv_len=prompt_len + done + steps)
      done += steps
    jax.block_until_ready(out.tokens)
    return t1 - t0, time.perf_counter() - t1, done

  one_pass()  # compile every bucket
  prefill_s, decode_s, n_steps = one_pass()
  kv_tok = kv_bytes_per_token(cfg)
  w_bytes = cfg.num_params() * 2
  avg_len = mean_live_kv(prompt_len, n_steps)  # prefill leaves prompt_len keys cached
  step_bytes = decode_roofline_bytes(cfg, batch, avg_len)
  roof_step_s = step_bytes / peaks()["hbm_bytes_s"]
  step_s = decode_s / n_steps
  # With a group's prompt K/V counted once: the bytes a step must read from HBM at best.
  distinct_bytes = step_bytes - batch * (1 - 1 / group) * prompt_len * kv_tok
  emit("decode", record, model=name, batch=batch, attention=attention,
       layout=eng.cache_layout, kernel=kernel, write_first=write_first,
       merge_weights=eng.merges(steps, run_params),
       fused_qkv=eng.fuses_qkv(steps, run_params),
       fold_norms=eng.fuses_qkv(steps, run_params) and eng.fold_norms,
       chain_weights=prepare and eng.fuses_qkv(steps, run_params) and eng.chain_weights,
       prepared=prepare,
       norm_rope=decoder.norm_rope_path(cfg, jax.default_backend()) if cfg.qk_norm else "none",
       xla_options="default" if xla_options is None else dict(xla_options),
       prompt_len=prompt_len, new_tokens=n_steps,
       decode_steps_per_call=steps, tokens_per_s=batch * n_steps / decode_s,
       step_ms=step_s * 1e3, roofline_step_ms=roof_step_s * 1e3,
       roofline_fraction=roof_step_s / step_s, prefill_s=prefill_s, group=group,
       share_prompts=share,
       distinct_roofline_fraction=distinct_bytes / peaks()["hbm_bytes_s"] / step_s,
       weight_gb=w_bytes / 1e9, avg_kv_gb=batch * avg_len * kv_tok / 1e9)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--models", default="smollm2-135m,qwen2.5-1.5b")
  ap.add_argument("--batches", default="64,256")
  ap.add_argument("--prompt-len", type=int, default=256)
  ap.add_argument("--new-tokens", type=int, default=512)
  ap.add_argument("--steps", type=int, default=16, help="decode steps per device call")
  ap.add_argument("--attention", default="auto", help="decode attention: auto, xla, pallas")
  ap.add_argument("--layouts", default="auto",
                  help="KV cache layouts to compare, e.g. stacked,per_layer")
  ap.add_argument("--variants", default="",
                  help="';'-separated layout/attention/kernel[/merge] variants (overrides "
                       "--layouts and --attention)")
  ap.add_argument("--xla-options", default="",
                  help="';'-separated JSON dicts of XLA options for the decode program, one "
                       "run each (default: the engine's DECODE_GPU_OPTIONS; '{}': XLA's)")
  ap.add_argument("--group", type=int, default=1,
                  help="samples per prompt (consecutive slots; divides 64)")
  ap.add_argument("--share", default="on", help="prompt sharing: on, off or on,off")
  ap.add_argument("--norm-rope", default="auto",
                  help="Qwen3's q / k norms and RoPE (ModelConfig.norm_rope_impl): auto, pallas, "
                       "xla, or a list, one run each (e.g. pallas,xla)")
  add_decode_switches(ap)  # one run per combination of their values
  ap.add_argument("--prepare", default="on",
                  help="params prepared once for the run as rollouts do (Engine.prepare: the "
                       "merged decode weights made once, not in every decode call): on, off, "
                       "or on,off (one run each)")
  ap.add_argument("--record", action="store_true")
  args = ap.parse_args()
  variants = ([(v.split("/") + ["", "", ""])[:4] for v in args.variants.split(";")]
              if args.variants else
              [(layout, args.attention, "", "") for layout in args.layouts.split(",")])
  shares = list_option("--share", args.share, ON_OFF)
  prepares = list_option("--prepare", args.prepare, ON_OFF)
  xla_sets = ([tuple(sorted(json.loads(x).items())) for x in args.xla_options.split(";")]
              if args.xla_options else [None])
  for name in args.models.split(","):
    for b in map(int, args.batches.split(",")):
      for (layout, attention, kernel, mode), xla, share, switches, norm_rope, prep in (
          itertools.product(variants, xla_sets, shares, decode_switch_runs(args),
                            args.norm_rope.split(","), prepares)):
        if mode not in ("", "merge"):
          raise SystemExit(f"--variants: unknown mode {mode!r} (expected '' or 'merge')")
        try:
          run(name, b, args.prompt_len, args.new_tokens, args.steps, args.record,
              attention or "auto", layout=layout or "auto", kernel=kernel,
              write_first=mode != "merge", xla_options=xla, group=args.group,
              share=share, norm_rope=norm_rope, prepare=prep,
              switches=switches)
        except Exception as e:  # one failing variant must not lose the others' numbers
          print(f"FAILED {name} b={b} {layout}/{attention}/{kernel}/{mode}: {type(e).__name__}: "
                f"{str(e)[:2000]}", flush=True)


if __name__ == "__main__":
  main()
