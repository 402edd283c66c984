"""Sampler vs learner log-probs of the same tokens, per training attention path.

    python benchmarks/logprob_gap.py --model qwen3-0.6b --prompts 32 --gen 256 \
        --dtypes bfloat16,float32 --impls auto,cudnn,xla

The engine samples `--gen` tokens for each random prompt at temperature 1 (its log-probs are
those of the sampling distribution); the learner then scores the same token ledger, packed
into rows the way the trainer packs them (`Learner.score`), with each `attention_impl`. Prints
the mean and max |difference| over the sampled tokens. Random-init weights stored in the
compute dtype (what the engine reads); nothing is downloaded.
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from benchmarks.common import add_decode_switches, decode_switch_runs, emit
from jaxagent import models
from jaxagent.models import decoder, logprobs
from jaxagent.generate import Engine, EngineConfig, SamplingConfig
from jaxagent.generate.scheduler import run_requests
from jaxagent.rl import packing, step


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="qwen3-0.6b")
  ap.add_argument("--prompts", type=int, default=32)
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--gen", type=int, default=256)
  ap.add_argument("--pack-len", type=int, default=1024)
  ap.add_argument("--dtypes", default="bfloat16,float32")
  ap.add_argument("--impls", default="auto,cudnn,xla")
  ap.add_argument("--logprob-impls", default="auto", help="the learner's vocabulary path "
                  "(ModelConfig.logprob_impl): auto, pallas, xla")
  add_decode_switches(ap)  # the sampler's decode weights
  ap.add_argument("--record", action="store_true")
  args = ap.parse_args()
  if args.prompts < 1 or args.prompt_len < 2 or args.gen < 1:
    ap.error(f"need --prompts >= 1, --prompt-len >= 2 and --gen >= 1; got {args.prompts}, "
             f"{args.prompt_len} and {args.gen}")
  if args.pack_len < args.prompt_len + args.gen:
    # Packing drops a longer trajectory: the gap was measured over the shorter prompts only,
    # or, with none left, the script failed on an empty reduction after sampling.
    ap.error(f"--pack-len {args.pack_len} must hold the longest trajectory, --prompt-len + "
             f"--gen = {args.prompt_len + args.gen}")
  rng = np.random.default_rng(0)
  for dtype in args.dtypes.split(","):
    cfg = models.get_config(args.model, dtype=dtype, param_dtype=dtype)
    params = jax.jit(lambda k: models.init_params(cfg, k))(jax.random.key(0))
    lens = rng.integers(args.prompt_len // 2, args.prompt_len + 1, args.prompts)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in lens]
    for switches in decode_switch_runs(args):
      eng = Engine(cfg, EngineConfig(
          slots=args.prompts, max_len=args.prompt_len + args.gen, eos_ids=(),
          sampling=SamplingConfig(1.0), **switches))
      outs = run_requests(eng, params, prompts, max_new_tokens=args.gen,
                          request_ids=list(range(args.prompts)), seed=1)
      # `run_requests` decodes 8 steps a call (its default) and prepares the params (so
      # chains where `chain_weights`).
      _score(args, cfg, dtype, params, prompts, outs, eng.merges(8), eng.fuses_qkv(8),
             eng.fuses_qkv(8) and eng.fold_norms, eng.fuses_qkv(8) and eng.chain_weights)


def _score(args, cfg, dtype, params, prompts, outs, merged, fused_qkv, fold_norms,
           chain_weights):
  """The learner's log-probs of the sampled token ledgers, per training path, against the
  sampler's."""
  items = [packing.PackItem(tokens=np.asarray(p + o.tokens, np.int32),
                            loss_mask=np.r_[np.zeros(len(p)), np.ones(len(o.tokens))]
                            .astype(np.float32),
                            old_logps=np.r_[np.zeros(len(p)), o.logprobs].astype(np.float32),
                            advantages=0.0)
           for p, o in zip(prompts, outs)]
  batch = packing.pack(items, packing.PackingConfig(max_len=args.pack_len,
                                                    row_multiple=1)).arrays()
  mask = batch["loss_mask"] > 0
  for impl, lp_impl in itertools.product(args.impls.split(","), args.logprob_impls.split(",")):
    c = cfg.replace(attention_impl=impl, logprob_impl=lp_impl)
    try:
      learner = step.Learner(c, step.StepConfig(), step.make_optimizer(1e-6))
      logps, _ = learner.score(params, batch)
    except Exception as e:  # a path this device lacks (cuDNN off GPU): say so and go on
      print(f"{dtype} {impl} {lp_impl}: failed: {type(e).__name__}: {str(e)[:200]}")
      continue
    gap = np.abs(np.asarray(logps, np.float64) - batch["old_logps"])[mask]
    backend = jax.default_backend()
    emit("logprob_gap", args.record, model=args.model, dtype=dtype, attention=impl,
         resolved=decoder.attention_path(c, backend), logprob=logprobs.logprob_path(c, backend),
         merged_decode_weights=merged, fused_qkv=fused_qkv, fold_norms=fold_norms,
         chain_weights=chain_weights, tokens=int(mask.sum()),
         mean_abs_gap=float(gap.mean()), max_abs_gap=float(gap.max()))


if __name__ == "__main__":
  main()
