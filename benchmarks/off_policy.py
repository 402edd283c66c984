"""Rollouts collected ahead of the learner: RL step time with `train.off_policy_steps` 0 and k,
on the learner's devices or on devices of their own (`rollout.devices`).

    python benchmarks/off_policy.py                      # CPU, tiny-llama, 4 timed steps
    python benchmarks/off_policy.py --model qwen2.5-0.5b --dtype bfloat16 --slots 256 \
        --prompts 32 --samples 8 --steps 8 --reward-ms 20   # a GPU
    python benchmarks/off_policy.py ... --runs 0/0,1/0,1/1  # 2 GPUs: + one that only decodes

Runs the RL loop of the quickstart's config (no warm start, no evals, no checkpoints) on a
calculator task (`CalculatorEnv` with generated sums and products) and a randomly initialised
model of a preset's architecture, once per `--runs` entry (`k/n`: train.off_policy_steps=k,
rollout.devices=n), and prints each run's mean RL step time over the timed steps (after
`--warmup` steps, which compile), with the mean rollout, update and rollout-wait times the
trainer logs, and the speed-up of each run over the first as the last line (one JSON object).
A setting listed twice (`0/0,1/0,0/0`) is reported by its later run, whose programs come from
the compilation cache: the first run of a process also pays compiles in its timed steps when
the packed row count varies (`compile_s`). `--reward-ms` makes every trajectory's reward take that long on
the host (a verifier that runs unit tests, a judge call): the work a collector thread overlaps
with the update. A random policy earns no reward, so zero-variance groups are kept and the loss
has an entropy bonus: every step makes an update, as a trained policy's would.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from benchmarks import common
from configs.quickstart import get_config
import numpy as np

from jaxagent.agent import Example
from jaxagent.agent.env import CalculatorEnv
from jaxagent.trainer import Trainer


class SlowRewardEnv(CalculatorEnv):
  """Calculator problems (`a op b op c`), with a reward that takes `reward_ms` of host time."""

  name = "calculator_slow_reward"
  reward_threads = 4

  def __init__(self, *, reward_ms: float = 0.0, train_size: int = 256, seed: int = 0):
    super().__init__()
    self.reward_ms, self.train_size, self.seed = reward_ms, train_size, seed

  def examples(self, split):
    rng = np.random.default_rng(self.seed + (split == "eval"))
    out = []
    for i in range(self.train_size if split == "train" else 8):
      a, b, c = rng.integers(10, 1000, 3)
      op1, op2 = rng.choice(["+", "-", "*"], 2)
      expr = f"{a} {op1} {b} {op2} {c}"
      out.append(Example(f"{split}-{i}", f"Compute {expr} with the calculator.",
                         str(eval(expr)), {"expression": expr}))  # noqa: S307 - our own digits
    return out

  def reward(self, trajectory, example, tokenizer, step):
    time.sleep(self.reward_ms / 1e3)
    return super().reward(trajectory, example, tokenizer, step)


def config(args, k: int, n: int, workdir: str):
  c = get_config()
  c.workdir = workdir
  c.total_steps = args.warmup + args.steps
  c.model.update(path=args.model, tokenizer=args.tokenizer, param_dtype="float32",
                 dtype=args.dtype, init_std=0.02)
  c.env.name = "benchmarks.off_policy:SlowRewardEnv"
  c.env.kwargs = dict(train_size=max(256, args.prompts * c.total_steps),
                      reward_ms=args.reward_ms)
  c.rollout.update(devices=n, mesh=args.rollout_mesh, slots=args.slots, max_len=args.max_len,
                   max_tokens_per_turn=args.tokens_per_turn, max_turns=args.turns)
  c.train.update(prompts_per_step=args.prompts, samples_per_prompt=args.samples,
                 zero_variance="keep", pack_len=args.pack_len, len_buckets=(args.pack_len,),
                 off_policy_steps=k)
  c.loss.entropy_coef = 0.01
  c.sft.steps = 0
  c.eval.update(size=0, before=False)
  c.log.update(progress=False, tensorboard=False, dump_every=0)
  c.checkpoint_every = 0
  return c


def run(args, k: int, n: int) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer(config(args, k, n, workdir))
    try:
      t0 = time.perf_counter()
      trainer.run()
      wall = time.perf_counter() - t0
      rows = [r for r in trainer.writer.history if "time/step_s" in r]
    finally:
      trainer.close()
  timed = rows[args.warmup:]
  mean = lambda key: statistics.fmean(r[key] for r in timed)
  return {"off_policy_steps": k, "rollout_devices": n, "step_s": mean("time/step_s"),
          "rollout_s": mean("time/rollout_s"), "rollout_wait_s": mean("time/rollout_wait_s"),
          "update_s": mean("time/update_s"), "wall_s": wall,
          "staleness": [r["rollout/staleness"] for r in rows],
          "policy_tokens": mean("rollout/policy_tokens"), "pack_rows": mean("pack/rows"),
          "compile_s": mean("time/compile_s")}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="tiny-llama", help="architecture preset (random init)")
  ap.add_argument("--dtype", default="float32", help="compute dtype (bfloat16 on a GPU)")
  ap.add_argument("--tokenizer", default="smollm2-135m-instruct",
                  help="tokenizer preset, .gguf or HF directory (its vocabulary sizes the model)")
  ap.add_argument("--runs", default="0/0,1/0",
                  help="comma-separated k/n: train.off_policy_steps=k, rollout.devices=n; "
                  "the first is the baseline")
  ap.add_argument("--rollout-mesh", default="learner", choices=("learner", "data"),
                  help="rollout.mesh (data: each rollout device decodes its own slots)")
  ap.add_argument("--steps", type=int, default=4, help="timed RL steps per run")
  ap.add_argument("--warmup", type=int, default=2, help="untimed RL steps first (compiles)")
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--samples", type=int, default=4)
  ap.add_argument("--slots", type=int, default=32)
  ap.add_argument("--max-len", type=int, default=256)
  ap.add_argument("--tokens-per-turn", type=int, default=32)
  ap.add_argument("--turns", type=int, default=3)
  ap.add_argument("--pack-len", type=int, default=512)
  ap.add_argument("--reward-ms", type=float, default=0.0,
                  help="host time of each trajectory's reward")
  args = ap.parse_args()
  try:
    runs = [tuple(int(x) for x in r.split("/")) for r in args.runs.split(",")]
    assert all(len(r) == 2 for r in runs)
  except (ValueError, AssertionError):
    sys.exit(f"--runs takes k/n pairs such as 0/0,1/0,1/1; got {args.runs!r}")
  info = common.device_info()
  out = {}
  for k, n in runs:
    out[f"{k}/{n}"] = run(args, k, n)
    print("RESULT " + json.dumps({"bench": "off_policy", **info, **vars(args),
                                  **out[f"{k}/{n}"]}), flush=True)
  base = next(iter(out.values()))["step_s"]
  print(json.dumps({"bench": "off_policy", "device": info.get("device"),
                    "step_s": {k: round(v["step_s"], 4) for k, v in out.items()},
                    "speedup_vs_first": {k: round(base / v["step_s"], 3)
                                         for k, v in out.items()},
                    "jax": jax.__version__}))


if __name__ == "__main__":
  main()
