"""ReTool-style math with a Python interpreter: SFT cold start on code demonstrations, then GRPO.

Task: reasoning-gym gsm_symbolic word problems (`jaxagent/envs/math_tool.py`); the policy runs
code in its own persistent sandboxed interpreter (`<code>` -> `<interpreter>`), answers in
`<answer>`, and gets +1 / -1 from math-verify. Interpreter output is an observation (no loss).

Run:
  python -m jaxagent.launch --config=configs/math_tool.py        # SmolLM2-135M-Instruct, CPU
  python -m jaxagent.launch --config=configs/math_tool.py:tiny   # a random tiny model, ~30 s
  python -m jaxagent.launch --config=configs/math_tool.py:gpu    # SmolLM2-135M, one GPU
  python -m jaxagent.launch --config=configs/math_tool.py:qwen \
      --config.model.path=/path/to/Qwen2.5-1.5B-Instruct         # an HF checkpoint directory
Your own problems replace the built-in train and/or eval split, every record of the file: JSONL
(`.jsonl`, `.jsonl.gz`) of `{"question": ..., "answer": ...}` (a GSM8K answer "... #### 72"
counts as 72), an ArrayRecord file of such JSON records, or a Parquet file (e.g. verl's gsm8k,
with question_key=extra_info.question, answer_key=reward_model.ground_truth):
  python -m jaxagent.launch --config=configs/math_tool.py \
      --config.env.kwargs.train_file=/data/train.jsonl \
      --config.env.kwargs.eval_file=/data/test.jsonl
with `--config.env.kwargs.question_key=problem` (and `answer_key`) for other field names. A
file setting may be a glob pattern of a split's shards ('/data/gsm8k/train-*.parquet', read in
sorted order). The SFT warm start demonstrates the interpreter on built-in generated problems,
or, with `--config.env.kwargs.sft_file=/data/train.jsonl`, on your records' worked solutions
(GSM8K answers: each `<<48/2=24>>` calculator note a line of code; `solution_key` names the
solution when it is not under answer_key); records without a usable solution are counted in a
warning and left out.
Switch progressive reward shaping on with e.g. `--config.env.kwargs.format_weight=0.2
--config.env.kwargs.tool_weight=0.05 --config.env.kwargs.shaping_steps=20`.

Expected:
  tiny (measured): finishes in under a minute on a CPU (about 35 s after imports); metrics.jsonl
    has `reward/correct` = -1 (a random model never answers) and eval pass@1 0.
  default (2-core CPU; not yet run to the end here): held-out pass@1 0.00 before training
    (measured, n=50: the model never writes an answer tag). After the SFT warm start on 256
    verified code demonstrations the model should write `<code>` cells and answer from the
    interpreter's output, so pass@1 should rise above 0, bounded by how faithfully a 135M model
    copies the problem's numbers into code; GRPO adds little in 8 steps. Needs several GB of
    host memory (train.micro_batches bounds it).
  gpu (measured on one H200, benchmarks/RESULTS.md): held-out pass@1 (n=300, greedy) 0.000
    before, 0.410 / 0.417 after the SFT warm start, 0.513 / 0.527 (+/- 0.029) after 18 / 22
    GRPO steps (seeds 0 / 1; `--config.train.time_limit_s=540 --config.eval.before=False`,
    at most 14 min for the whole run while sharing the GPU with two other runs); the sampled
    reward rises from about -0.43 to -0.30 (figures/math_tool_reward_h200.png). No
    interpreter timeouts.
  qwen (not measured): a Qwen2.5-1.5B-Instruct start should use the interpreter after SFT and
    reach a clearly higher pass@1.
"""
import pathlib

import ml_collections
from ml_collections.config_dict import placeholder

from jaxagent.config_files import load_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  # Model, mesh, loss, optimizer, logging and checkpoints as in the quickstart.
  c = load_config(pathlib.Path(__file__).with_name("quickstart.py"))
  c.workdir = "runs/math_tool"
  c.total_steps = 8

  c.env = ml_collections.ConfigDict(dict(name="math_tool", kwargs=dict(
      sources=("gsm_symbolic",), eval_sources=("gsm_symbolic",), train_size=2000,
      eval_size=100, sft_size=256, max_output_chars=256, code_timeout_s=5.0,
      code_memory_mb=1024, format_weight=0.0, tool_weight=0.0, shaping_steps=0,
      shaping_start=0.0, seed=0,
      # Your own problems ("" = the built-in sources; solution_key "" = answer_key): see the
      # header.
      train_file="", eval_file="", question_key="question", answer_key="answer",
      sft_file="", solution_key="")))

  c.rollout = ml_collections.ConfigDict(dict(
      slots=64, max_len=512, temperature=1.0, top_p=1.0, top_k=0, max_turns=4,
      max_tokens_per_turn=96, max_total_tokens=placeholder(int), max_prompt_tokens=384,
      tool_timeout_s=10.0,
      traj_tool_timeout_s=30.0, decode_steps=8,
      # Most tokens of one tool result's text (None: no cap); of a longer one, "left" keeps
      # the tail, "right" the head, "middle" both.
      max_observation_tokens=placeholder(int), observation_truncation="middle",
      mesh="learner",  # "data": replicated weights for decoding on several devices
      devices=0))  # > 0: the last n devices only decode (with train.off_policy_steps > 0)
  c.train = ml_collections.ConfigDict(dict(
      prompts_per_step=8, samples_per_prompt=4, mini_batches=1, micro_batches=4, epochs=1,
      advantage="grpo", zero_variance="drop", dynamic_sampling=False, max_sampling_rounds=3,
      pack_len=512, len_buckets=(256, 512), nonfinite="raise",
      gather_weights=False, logprob_save_probs=False, row_rounding="multiple",
      off_policy_steps=0,  # > 0: rollouts collected that many steps ahead (README)
      time_limit_s=0.0))
  c.sft = ml_collections.ConfigDict(dict(
      steps=16, batch_size=16, lr=3e-5, num_examples=256, data="", warmup_steps=0))
  c.eval = ml_collections.ConfigDict(dict(size=100, every=0, pass_k=0, before=True))
  c.log.dump_every = 2

  if arg == "tiny":
    c.workdir = "runs/math_tool-tiny"
    c.total_steps = 2
    c.model.path = "tiny-llama"
    c.model.tokenizer = "smollm2-135m-instruct"
    c.model.init_std = 0.2
    c.env.kwargs.update(train_size=32, eval_size=4, sft_size=8)
    c.rollout.update(slots=8, max_len=384, max_tokens_per_turn=16, max_turns=2)
    c.train.update(prompts_per_step=2, samples_per_prompt=2, micro_batches=1, pack_len=512,
                   len_buckets=(512,))
    c.sft.update(steps=1, batch_size=4, num_examples=8)
    c.eval.update(size=4, every=2)
    c.log.update(progress=False, dump_every=1)
  elif arg == "gpu":
    c.workdir = "runs/math_tool-gpu"
    c.total_steps = 100
    c.model.dtype = "bfloat16"
    c.env.kwargs.update(train_size=8000, eval_size=500, sft_size=1024)
    c.rollout.update(slots=256, max_len=1024, max_tokens_per_turn=256, max_turns=6)
    c.train.update(micro_batches=4, prompts_per_step=32, samples_per_prompt=8,
                   pack_len=2048, len_buckets=(1024, 2048), dynamic_sampling=True,
                   row_rounding="pow2")
    c.sft.update(steps=64, batch_size=32, num_examples=1024)
    c.eval.update(size=300, every=0, pass_k=0)
    c.log.update(dump_every=10)
  elif arg == "qwen":
    c.workdir = "runs/math_tool-qwen"
    c.total_steps = 200
    c.model.update(path="<HF directory of Qwen2.5-Instruct: set --config.model.path>",
                   param_dtype="float32", dtype="bfloat16", remat="full")
    c.env.kwargs.update(train_size=8000, eval_size=500, sft_size=1024,
                        eval_sources=("gsm_symbolic", "champ"))
    c.rollout.update(slots=256, max_len=2048, max_tokens_per_turn=512, max_turns=8)
    c.optimizer.update(lr=1e-6)
    c.train.update(micro_batches=16, prompts_per_step=32, samples_per_prompt=8,
                   pack_len=4096, len_buckets=(2048, 4096), dynamic_sampling=True)
    c.sft.update(steps=64, batch_size=32, lr=1e-5, num_examples=1024)
    c.eval.update(size=600, every=25, pass_k=4)
    c.log.update(dump_every=10)
  elif arg not in (None, ""):
    raise ValueError(f"unknown math_tool variant {arg!r}; expected '', 'tiny', 'gpu' or 'qwen'")
  return c
