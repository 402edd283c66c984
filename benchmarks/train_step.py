"""`train_step` throughput and MFU on packed rows (GRPO loss + AdamW), random init.

    python benchmarks/train_step.py --models qwen2.5-0.5b,qwen2.5-1.5b --rows 64 --len 2048

Rows are packed from a realistic multi-turn length mix by `jaxagent.rl.packing` (its
efficiency over all the rows it packed is reported, `packing_efficiency`; the step times the
first `--rows` of them, whose fill is `timed_rows_fill`); params are float32 masters with
bfloat16 compute. Defaults are the fastest measured on an H100 (RESULTS.md): the unrolled
layer loop (`--scan` for the `lax.scan`), remat "dots_attention", 8 micro-batches, the token
log-probs' backward from saved probabilities (`StepConfig.logprob_save_probs`; `--no-save-probs` recomputes).

With `--lora-rank`, `--lora-forward merged,unmerged` times the adapter update with each
`LoraConfig.forward` one after the other in the same job (same batch, same base), one result
row each:

    python benchmarks/train_step.py --models qwen2.5-1.5b --lora-rank 16 \
        --lora-forward merged,unmerged

JAX's GPU client takes 75% of the card's memory unless told otherwise; this script lets it
take 95% ($XLA_PYTHON_CLIENT_MEM_FRACTION, if unset), since the 1.5B step at 8 micro-batches
needs more than 75% of an 80 GB card.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax
import numpy as np

from benchmarks.common import emit, peaks, timeit
from benchmarks.forward import useful_flops
from jaxagent import models
from jaxagent.models import decoder, logprobs, lora
from jaxagent.rl import losses, packing, step


def length_mix(n, rng):
  """Multi-turn trajectory lengths: prompt + 1-4 turns with observations."""
  return [int(rng.integers(100, 400) + sum(rng.integers(60, 300) for _ in range(rng.integers(1, 5))))
          for _ in range(n)]


def make_batch(rows, length, vocab, rng):
  items, total = [], 0
  while total < rows * length * 1.02:
    n = min(length, length_mix(1, rng)[0])
    toks = rng.integers(0, vocab, n).astype(np.int32)
    mask = np.zeros(n, np.float32)
    mask[n // 4:] = 1.0
    items.append(packing.PackItem(tokens=toks, loss_mask=mask,
                                  old_logps=np.where(mask > 0, -2.0, 0.0).astype(np.float32),
                                  advantages=float(rng.normal())))
    total += n
  pb = packing.pack(items, packing.PackingConfig(max_len=length, row_multiple=8))
  arrays = pb.arrays()
  arrays = {k: v[:rows] for k, v in arrays.items()}
  seg_lens = []
  for r in range(arrays["segment_ids"].shape[0]):
    ids, counts = np.unique(arrays["segment_ids"][r], return_counts=True)
    seg_lens += [int(c) for i, c in zip(ids, counts) if i > 0]
  # The step times the first `rows` rows only. Best-fit decreasing fills its last rows least,
  # so their fill alone (98.4% for 64 x 2048) overstates the packing: the packer's own
  # efficiency is over every row it used for all the items (97.8% there; 91.0% with its rows
  # rounded up to a multiple of 8).
  timed = int((arrays["segment_ids"] > 0).sum())
  stats = {"timed_rows_fill": timed / arrays["segment_ids"].size,
           "row_fill": pb.stats["row_fill"], "efficiency": pb.stats["efficiency"],
           "rows_used": pb.stats["rows_used"], "tokens_left_out": pb.stats["real_tokens"] - timed}
  return arrays, stats, seg_lens


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
  ap.add_argument("--rows", type=int, default=64)
  ap.add_argument("--len", type=int, default=2048)
  ap.add_argument("--micro-batches", type=int, default=8)
  ap.add_argument("--attention", default="auto")
  ap.add_argument("--logprob", default="auto", help="ModelConfig.logprob_impl: auto, pallas "
                  "(fused vocabulary kernels) or xla")
  ap.add_argument("--norm-rope", default="auto", help="ModelConfig.norm_rope_impl: auto, "
                  "pallas (one kernel each way for Qwen3's q / k norms and RoPE) or xla")
  ap.add_argument("--remat", default="dots_attention")
  ap.add_argument("--scan", action="store_true", help="ModelConfig.scan_layers=True: the "
                  "layer loop as a lax.scan (default: unrolled over per-layer weights)")
  ap.add_argument("--save-probs", action=argparse.BooleanOptionalAction, default=True,
                  help="StepConfig.logprob_save_probs: keep softmax - onehot from the forward "
                  "pass instead of recomputing the logits in the backward pass (default on; "
                  "--no-save-probs recomputes)")
  ap.add_argument("--param-dtype", default="float32")
  ap.add_argument("--lora-rank", type=int, default=0, help="> 0: train a LoRA adapter of this "
                  "rank (alpha 2 x rank) over the frozen params (`jaxagent.models.lora`)")
  ap.add_argument("--lora-targets", default="all")
  ap.add_argument("--lora-forward", default="merged", help="LoraConfig.forward, a comma list "
                  "timed one after another: merged (W + scale A @ B as one weight) and/or "
                  "unmerged (x @ W + scale (x @ A) @ B: no full weight gradients)")
  ap.add_argument("--lora-dropout", type=float, default=0.0, help="LoraConfig.dropout of the "
                  "unmerged forward's runs (the merged forward has none)")
  ap.add_argument("--record", action="store_true")
  ap.add_argument("--trace", default="", help="also profile 2 steps into this directory and "
                  "print the kernel time per step by kind (benchmarks/trace_summary.py)")
  args = ap.parse_args()
  forwards = [f.strip() for f in args.lora_forward.split(",") if f.strip()]
  bad = [f for f in forwards if f not in lora.FORWARDS]
  if bad or not forwards:
    ap.error(f"--lora-forward: {args.lora_forward!r}; give a comma list of "
             f"{', '.join(lora.FORWARDS)}")
  if not args.lora_rank and forwards != ["merged"]:
    ap.error("--lora-forward needs --lora-rank > 0 (it chooses how the adapter is read)")
  rng = np.random.default_rng(0)
  for name in args.models.split(","):
    cfg = models.get_config(name, param_dtype=args.param_dtype, dtype="bfloat16",
                            attention_impl=args.attention, remat=args.remat,
                            scan_layers=args.scan, logprob_impl=args.logprob,
                            norm_rope_impl=args.norm_rope)
    batch, pack_stats, seg_lens = make_batch(args.rows, args.len, cfg.vocab_size, rng)
    scfg = step.StepConfig(loss=losses.LossConfig(clip_high=0.28),
                           micro_batches=args.micro_batches, entropy=False,
                           logprob_save_probs=args.save_probs)
    # (in a list that a full fine-tune's timing empties: its state holds the params then)
    params = [jax.jit(lambda k: models.init_params(cfg, k))(jax.random.key(0))]
    for forward in forwards:
      time_one(args, name, cfg, scfg, params, forward, batch, pack_stats, seg_lens)


def time_one(args, name, cfg, scfg, params, forward, batch, pack_stats, seg_lens):
  """Time the update (full, or the adapter's read with `forward`) and emit its row.
  `params`: a list holding the params (the frozen base with LoRA)."""
  lcfg = None
  if args.lora_rank:
    lcfg = lora.LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank,
                           targets=args.lora_targets, forward=forward,
                           dropout=args.lora_dropout if forward == "unmerged" else 0.0)
    learner = step.Learner(cfg, scfg, step.make_optimizer(1e-6), lora=lcfg, base=params[0])
    state = learner.init(lora.init_lora(cfg, lcfg, jax.random.key(1)))
  else:
    learner = step.Learner(cfg, scfg, step.make_optimizer(1e-6))
    state = learner.init(params.pop())
  dev_batch = learner.put_batch(batch)
  holder = [state]
  del state
  base_args = () if lcfg is None else (learner.base,)

  def one():
    s, m = (learner._train(holder[0], dev_batch, *base_args) if learner._train
            else learner.train_step(holder[0], batch))
    holder[0] = s
    jax.block_until_ready(s.params)

  t = timeit(one, warmup=2, iters=4)
  n_tok = int((batch["segment_ids"] > 0).sum())
  flops = useful_flops(cfg, seg_lens)
  mem = jax.devices()[0].memory_stats() or {}
  row = emit("train_step", args.record, model=name, rows=args.rows, len=args.len,
             lora_rank=args.lora_rank, lora_targets=args.lora_targets if lcfg else None,
             lora_forward=lcfg.forward if lcfg else None,
             lora_dropout=lcfg.dropout if lcfg else None,
             peak_gib=mem.get("peak_bytes_in_use", 0) / 2**30,
             micro_batches=args.micro_batches, attention=args.attention,
             logprob=logprobs.logprob_path(cfg, jax.default_backend()),
             norm_rope=decoder.norm_rope_path(cfg, jax.default_backend()), remat=args.remat,
             scan_layers=args.scan, save_probs=args.save_probs,
             param_dtype=args.param_dtype, step_s=t["median_s"],
             tokens_per_s=n_tok / t["median_s"],
             mfu=flops / t["median_s"] / peaks()["bf16_flops"],
             # The packer's: real tokens over the rows it used for all the items.
             packing_efficiency=pack_stats["row_fill"],
             packing_efficiency_rounded_rows=pack_stats["efficiency"],
             timed_rows_fill=pack_stats["timed_rows_fill"],
             packed_rows=pack_stats["rows_used"], tokens_left_out=pack_stats["tokens_left_out"])
  if lcfg is not None:
    print(f"{name} LoRA r{lcfg.rank} forward={lcfg.forward}: step {row['step_s']:.4f} s, "
          f"MFU {row['mfu']:.1%}", flush=True)
  if args.trace:
    from benchmarks import trace_summary
    out = os.path.join(args.trace, name if lcfg is None else f"{name}-{lcfg.forward}")
    with jax.profiler.trace(out, create_perfetto_trace=True):
      for _ in range(2):
        one()
    trace_summary.print_summary(trace_summary.summarize(out, steps=2, top=25))

if __name__ == "__main__":
  main()
