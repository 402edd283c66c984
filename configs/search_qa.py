"""Search-R1-style multi-hop QA over a generated knowledge base: SFT on search demonstrations,
then GRPO.

Task (`jaxagent/envs/search_qa.py`): questions about fictional entities (1-3 hops by default)
that only the knowledge base answers; the policy reasons in `<think>`, searches with
`<search>query</search>` (BM25, top 3), reads `<information>`, answers in `<answer>`; reward is
exact match. The knowledge base is a tfds ArrayRecord dataset built on first use under
`$JAXAGENT_DATA_DIR` (default `~/.cache/jaxagent/tensorflow_datasets`; set
`--config.env.kwargs.data_dir` to put it elsewhere, e.g. under the workdir).

Run:
  python -m jaxagent.launch --config=configs/search_qa.py        # SmolLM2-135M-Instruct, CPU
  python -m jaxagent.launch --config=configs/search_qa.py:tiny   # a random tiny model, ~30 s
  python -m jaxagent.launch --config=configs/search_qa.py:gpu    # SmolLM2-135M, one GPU
  python -m jaxagent.launch --config=configs/search_qa.py:qwen \
      --config.model.path=/path/to/Qwen2.5-3B-Instruct           # an HF checkpoint directory
Knobs: difficulty `--config.env.kwargs.max_hops=4 --config.env.kwargs.distractors=3`; the
retrieved-token masking ablation `--config.env.kwargs.mask_observations=False` (the
`<information>` tokens then get loss, as in Search-R1's ablation); progressive shaping
`--config.env.kwargs.format_weight=0.2 --config.env.kwargs.retrieval_weight=0.2
--config.env.kwargs.shaping_steps=30`; a token cap on each search result
`--config.rollout.max_observation_tokens=128` (the passages' middle cut, marked inside the
`<information>` tags; the retrieval reward reads what the policy saw).
Your own corpus and questions (all three files: JSONL, ArrayRecord files of JSON records, or
Parquet files such as Search-R1's nq_train.parquet) replace the generated knowledge base:
  python -m jaxagent.launch --config=configs/search_qa.py \
      --config.env.kwargs.corpus_file=/data/wiki.jsonl \
      --config.env.kwargs.train_file=/data/nq_train.jsonl \
      --config.env.kwargs.eval_file=/data/nq_dev.jsonl
(each may be a glob pattern of a split's shards, '/data/wiki-*.parquet', read in sorted order).
The corpus holds `{"title": ..., "text": ..., "id"?: ...}` records (or Search-R1's
`{"id": ..., "contents": ...}`, the title on the first line), the question files
`{"question": ..., "answers": [...]}` ("answer" or "golden_answers" too; a string or a list of
accepted answers; `--config.env.kwargs.question_key` / `answer_key` for other names, a dotted
one inside an object: `answer_key=answers.text` for SQuAD, `answer.aliases` for TriviaQA). The SFT
warm start still demonstrates searching on the generated world (`sft_size` questions; its
documents, not yours). The retrieval reward needs each question's gold titles:
`--config.env.kwargs.titles_key=supporting_facts` (HotpotQA; or a key listing titles), each a
corpus title; without it `retrieval_weight` must stay 0 and `reward/retrieval` is not logged.
Each passage is cut to `max_passage_chars` (200 here) in the observation: for a corpus of
100-word Wikipedia passages raise it, e.g. `--config.env.kwargs.max_passage_chars=700`, with
rows to match (`rollout.max_len`, `train.pack_len`).

Expected:
  tiny (measured): finishes in under a minute on a CPU (about 35 s after imports); metrics.jsonl
    has `reward/exact_match` 0 and `reward/retrieval` 0 (a random model never searches).
  default (2-core CPU; not measured): exact match about 0 before training (the facts are
    fictional); after SFT on 256 search demonstrations the model should search with the right
    entity names and start to answer 1-hop questions; multi-hop questions need it to copy the
    bridge entity from the retrieved text, which GRPO improves slowly.
  gpu (measured on one H200, benchmarks/RESULTS.md): held-out EM (n=300, greedy) 0.000 before,
    0.717 / 0.823 after the SFT warm start, 0.810 / 0.850 after 15 / 14 GRPO steps (seeds
    0 / 1, `--config.train.time_limit_s=540`). Masking ablation, same seeds and budget: with
    mask_observations=False held-out EM is 0.807 / 0.803 after RL, and the sampled EM stays
    flat in both seeds (first vs last five steps: 0.63 -> 0.62, 0.64 -> 0.64) where the
    masked runs climb (0.63 -> 0.71, 0.63 -> 0.69) (figures/search_qa_ablation_h200.png).
  qwen (not measured): Search-R1's picture on a world no model knows: EM rises with RL,
    fastest on 1-2 hops; with mask_observations=False training should be less stable.
"""
import pathlib

import ml_collections
from ml_collections.config_dict import placeholder

from jaxagent.config_files import load_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  # Model, mesh, loss, optimizer, logging and checkpoints as in the quickstart.
  c = load_config(pathlib.Path(__file__).with_name("quickstart.py"))
  c.workdir = "runs/search_qa"
  c.total_steps = 8

  c.env = ml_collections.ConfigDict(dict(name="search_qa", kwargs=dict(
      kb_seed=0, num_countries=8, num_cities=40, num_universities=20, num_people=240,
      num_companies=160, min_hops=1, max_hops=3, distractors=1, train_size=2000,
      eval_size=100, sft_size=256, data_dir="", top_k=3, max_passage_chars=200,
      mask_observations=True, outcome="exact_match", format_weight=0.0,
      retrieval_weight=0.0, shaping_steps=0, shaping_start=0.0,
      # Your own corpus and questions ("" = the generated knowledge base; answer_key "" tries
      # answers, answer, golden_answers): see the header.
      corpus_file="", train_file="", eval_file="", question_key="question", answer_key="",
      titles_key="")))

  # Rows and cache of 1280 tokens: the longest 3-hop demonstrations (3 searches of 3 passages)
  # run to about 1100 tokens (at 1024, 27 of the 256 demonstrations, a third of the 3-hop ones,
  # were left out of the warm start).
  c.rollout = ml_collections.ConfigDict(dict(
      slots=64, max_len=1280, temperature=1.0, top_p=1.0, top_k=0, max_turns=4,
      max_tokens_per_turn=64, max_total_tokens=placeholder(int), max_prompt_tokens=256,
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
      pack_len=1280, len_buckets=(640, 1280), nonfinite="raise",
      gather_weights=False, logprob_save_probs=False, row_rounding="multiple",
      off_policy_steps=0,  # > 0: rollouts collected that many steps ahead (README)
      time_limit_s=0.0))
  c.sft = ml_collections.ConfigDict(dict(
      steps=16, batch_size=8, lr=3e-5, num_examples=256, data="", warmup_steps=0))
  c.eval = ml_collections.ConfigDict(dict(size=100, every=0, pass_k=0, before=True))
  c.log.dump_every = 2

  if arg == "tiny":
    c.workdir = "runs/search_qa-tiny"
    c.total_steps = 2
    c.model.path = "tiny-llama"
    c.model.tokenizer = "smollm2-135m-instruct"
    c.model.init_std = 0.2
    # A small world with 1-hop questions keeps the demonstrations short.
    c.env.kwargs.update(num_countries=3, num_cities=8, num_universities=4, num_people=20,
                        num_companies=12, max_hops=1, train_size=24, eval_size=4, sft_size=8,
                        top_k=2, max_passage_chars=160)
    c.rollout.update(slots=8, max_len=384, max_tokens_per_turn=16, max_turns=2)
    c.train.update(prompts_per_step=2, samples_per_prompt=2, micro_batches=1, pack_len=512,
                   len_buckets=(512,))
    c.sft.update(steps=1, batch_size=4, num_examples=8)
    c.eval.update(size=4, every=2)
    c.log.update(progress=False, dump_every=1)
  elif arg == "gpu":
    c.workdir = "runs/search_qa-gpu"
    c.total_steps = 100
    c.model.dtype = "bfloat16"
    c.env.kwargs.update(num_people=1000, num_companies=600, num_cities=120,
                        num_universities=60, num_countries=20, train_size=8000, eval_size=500,
                        sft_size=1024, max_passage_chars=400)
    c.rollout.update(slots=256, max_len=2048, max_tokens_per_turn=128, max_turns=6)
    c.train.update(micro_batches=8, prompts_per_step=32, samples_per_prompt=8,
                   pack_len=2048, len_buckets=(1024, 2048), dynamic_sampling=True,
                   row_rounding="pow2")
    c.sft.update(steps=64, batch_size=32, num_examples=1024)
    c.eval.update(size=300, every=0, pass_k=0)
    c.log.update(dump_every=10)
  elif arg == "qwen":
    c.workdir = "runs/search_qa-qwen"
    c.total_steps = 200
    c.model.update(path="<HF directory of Qwen2.5-Instruct: set --config.model.path>",
                   param_dtype="float32", dtype="bfloat16", remat="full")
    c.env.kwargs.update(num_people=1000, num_companies=600, num_cities=120,
                        num_universities=60, num_countries=20, max_hops=4, distractors=2,
                        train_size=8000, eval_size=500, sft_size=1024, max_passage_chars=400)
    c.rollout.update(slots=256, max_len=4096, max_tokens_per_turn=256, max_turns=8)
    c.optimizer.update(lr=1e-6)
    c.train.update(micro_batches=16, prompts_per_step=32, samples_per_prompt=8,
                   pack_len=4096, len_buckets=(2048, 4096), dynamic_sampling=True)
    c.sft.update(steps=64, batch_size=32, lr=1e-5, num_examples=1024)
    c.eval.update(size=500, every=25, pass_k=4)
    c.log.update(dump_every=10)
  elif arg not in (None, ""):
    raise ValueError(f"unknown search_qa variant {arg!r}; expected '', 'tiny', 'gpu' or 'qwen'")
  return c
