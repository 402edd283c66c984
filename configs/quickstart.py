"""Quickstart: SmolLM2-135M-Instruct learns to use a calculator, on a CPU.

Run (the README's main job; no flags runs this file):
  python -m jaxagent.launch
  python -m jaxagent.launch --config=configs/quickstart.py:tiny   # under a minute; a random tiny model

Expected (2-core CPU, 11 to 15 minutes on a quiet machine, longer on a shared one): held-out
pass@1 ~0 before training (the model never writes an <answer> tag); after the SFT warm start,
the easy problems it answers from memory (the demonstrations answer easy problems directly and
use the calculator only on hard ones); after GRPO, which learns to call the calculator on every
problem, close to 1. The SFT set is 80% easy problems, so the warm-started model rarely reaches
for the tool on easy ones. Numbers of real runs are in benchmarks/RESULTS.md.
"""
import ml_collections
from ml_collections.config_dict import placeholder


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = "runs/quickstart"
  c.seed = 0
  c.total_steps = 5

  # path: an HF directory, a .gguf file, an embedded preset, or an architecture preset such as
  # "tiny-llama" (random init with init_std / init_seed, vocabulary of `tokenizer`; "" = path's).
  # param_dtype: stored (master) weights; dtype: compute. remat: "none", "full", "dots" or
  # "dots_attention" (what the backward pass recomputes).
  c.model = ml_collections.ConfigDict(dict(
      path="smollm2-135m-instruct", tokenizer="", param_dtype="float32", dtype="float32",
      remat="full", init_std=0.02, init_seed=0,  # remat: 4x less update memory
      scan_layers=True,  # False: unrolled layer loop, faster updates on GPUs, longer compile
      # Training attention: "auto" (Pallas packed-segment kernels on GPUs, XLA elsewhere),
      # "pallas", "cudnn" or "xla".
      attention="auto",
      # The learner's vocabulary projection for token log-probs: "auto" (fused Pallas kernels
      # on GPUs for bf16 / f16 models up to d_model 2048, XLA elsewhere), "pallas" or "xla".
      logprob="auto",
      # Qwen3's q / k norms and RoPE: "auto" (one Pallas kernel each way on GPUs, XLA
      # elsewhere), "pallas" or "xla".
      norm_rope="auto"))
  # The task (`jaxagent.envs.make_env(name, **kwargs)`); kwargs are the task's own settings,
  # documented by its class (here `ArithmeticToolEnv`: min/max_terms and min/max_digits shape the
  # "hard" problems, easy_max_digits the "easy" ones, easy_fraction their share of the train and
  # eval sets, sft_easy_fraction of the SFT set).
  c.env = ml_collections.ConfigDict(dict(name="quickstart", kwargs=dict(
      min_terms=3, max_terms=4, min_digits=2, max_digits=3, train_size=2000, eval_size=200,
      sft_size=256, easy_fraction=0.5, easy_max_digits=2, sft_easy_fraction=0.8,
      seed=0)))
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))  # -1: the other devices
  # Low-rank adapters (`jaxagent.models.lora`): rank 0 trains every weight; rank r > 0 freezes
  # the loaded weights and trains `W + alpha / r * A @ B` on `targets` ("all", "attention",
  # "mlp", or names such as "wq,wv" / "q_proj,v_proj"). No optimizer state or reference copy
  # of the base then; checkpoints hold the adapter, exports the merged model and the adapter.
  # init_from: a PEFT adapter directory to start from (of these rank, alpha and targets).
  # forward: how the learner reads a target: "merged" (W + alpha / r * A @ B as one weight,
  # rounded as the sampler's) or "unmerged" (x @ W + alpha / r * (x @ A) @ B: no full weight
  # gradients, a faster update). dropout: PEFT's lora_dropout on the adapter's input in the
  # update (needs forward="unmerged").
  c.lora = ml_collections.ConfigDict(dict(rank=0, alpha=16.0, targets="all", init_from="",
                                          forward="merged", dropout=0.0))

  # Settings that default to None are typed placeholders, so that `--config.key=value` can set
  # them (the command line cannot override a plain None).
  # rollout: KV slots and cache length per slot (`EngineConfig`), sampling, and the budgets of
  # `jaxagent.agent.RolloutConfig` (turns, tokens, tool time limits, decode steps per call).
  c.rollout = ml_collections.ConfigDict(dict(
      slots=64, max_len=192, temperature=1.0, top_p=1.0, top_k=0, max_turns=3,
      max_tokens_per_turn=32, max_total_tokens=placeholder(int), tool_timeout_s=5.0,
      traj_tool_timeout_s=15.0, decode_steps=8,
      mesh="learner",  # "data": decode with replicated weights, each device its own slots
      # Devices that only decode (the last n; 0: the learner's own devices decode too): with
      # train.off_policy_steps > 0 the rollouts then run beside the update. One process only.
      devices=0,
      # Longest prompt decoded (None: what fits); the fit check plans it.
      max_prompt_tokens=placeholder(int),
      # Most tokens of one tool result's text (None: no cap); a longer one is cut where
      # observation_truncation says ("left" keeps the tail, "right" the head, "middle" both),
      # marked "...[N tokens truncated]...", inside the observation's wrapper.
      max_observation_tokens=placeholder(int), observation_truncation="middle"))
  # DAPO's soft overlong punishment, added to the RL reward of any task (not to the evals):
  # past overlong_max_tokens - overlong_cache_tokens policy tokens a trajectory loses up to
  # overlong_coef, linearly, all of it from overlong_max_tokens on (None: the policy-token
  # budget, rollout.max_turns x max_tokens_per_turn); logged as reward/overlong. 0 cache
  # tokens: off.
  c.reward = ml_collections.ConfigDict(dict(
      overlong_cache_tokens=0, overlong_max_tokens=placeholder(int), overlong_coef=1.0))
  # `jaxagent.rl.losses.LossConfig`: algo "grpo" / "gspo" / "gspo_token", agg (see losses.py).
  # tis_cap (None: off): the ratio is taken against the learner's own log-probs before the
  # step's first update, and each policy token's loss is weighted by min(pi_learner /
  # pi_sampler, tis_cap) (tis_level "token", or "sequence": one weight per trajectory), which
  # corrects for sampler / learner numerics and for train.off_policy_steps. One more forward
  # pass a step.
  c.loss = ml_collections.ConfigDict(dict(
      algo="grpo", agg="token_mean", clip_low=0.2, clip_high=0.28, dual_clip=placeholder(float),
      kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0,
      max_len_norm=placeholder(float), tis_cap=placeholder(float), tis_level="token"))
  # AdamW; max_grad_norm 0 turns clipping off; schedule "constant", "cosine" or "linear".
  c.optimizer = ml_collections.ConfigDict(dict(
      lr=1e-5, weight_decay=0.0, b1=0.9, b2=0.99, max_grad_norm=1.0, warmup_steps=0,
      schedule="constant"))
  # Per RL step: prompts_per_step groups of samples_per_prompt rollouts; advantage "grpo",
  # "dr_grpo" or "rloo"; zero_variance "drop" (groups with equal rewards are not trained on) or
  # "keep"; dynamic_sampling: DAPO's refill of dropped groups (with zero_variance "drop"), up
  # to max_sampling_rounds; the batch packs into rows of pack_len tokens (lengths len_buckets),
  # split into mini_batches (equal groups of rows drawn anew each epoch, one update each),
  # each accumulated over micro_batches; epochs: passes over each step's batch (epochs x
  # mini_batches updates per step); nonfinite "raise" or "skip" (a NaN/Inf step).
  c.train = ml_collections.ConfigDict(dict(
      prompts_per_step=16, samples_per_prompt=4, mini_batches=1, micro_batches=1, epochs=1,
      advantage="grpo", zero_variance="drop", dynamic_sampling=False, max_sampling_rounds=3,
      pack_len=256, len_buckets=(128, 256), nonfinite="raise",
      # With fsdp and micro_batches > 1: all-gather the weights once per step, not in every
      # micro-batch (one unsharded copy of the params per device; StepConfig.gather_weights).
      gather_weights=False,
      # Keep softmax - onehot(target) of every logit chunk from the forward pass (compute dtype,
      # tokens per micro-batch x vocab x 2 bytes) instead of recomputing the logits in the
      # backward pass: one vocabulary matmul less per step (StepConfig.logprob_save_probs).
      logprob_save_probs=False,
      # Packed row count B: "multiple" (of mini_batches x micro_batches x data-parallel
      # devices: least padding, one update program per distinct B) or "pow2" (that multiple x a power of two: at most
      # ~log2 programs, up to 2x padded rows; for runs where recompiles cost more than padding).
      row_rounding="multiple",
      # Rollouts collected ahead of the learner: step s trains on rollouts sampled from the params
      # after step s - 1 - off_policy_steps, collected on a thread while the learner runs the
      # steps before s (0: each step samples from the params it then updates). Host work
      # (tools, rewards, packing) overlaps the update; the ratio is then against an older
      # policy (loss.tis_cap corrects for it). Costs one copy of the compute-dtype weights.
      off_policy_steps=0,
      time_limit_s=0.0))  # RL wall-clock budget in s (0: none): final eval + checkpoint, then stop
  # SFT warm start (steps=0: none): on num_examples of the task's demonstrations, or on the
  # chat JSONL file `data` ({"messages": [...]} per line; loss on assistant turns). Its Adam has
  # its own lr and warmup, optimizer.max_grad_norm and Adam's default b1, b2 (0.9, 0.999) with no
  # weight decay: optimizer.b1, b2 and weight_decay are the RL updates' only.
  c.sft = ml_collections.ConfigDict(dict(
      steps=8, batch_size=16, lr=3e-5, num_examples=256, data="", warmup_steps=0))
  # Held-out eval on the first `size` examples: greedy pass@1 (and pass@k with pass_k > 1
  # samples) before training (`before`), after the warm start, every `every` RL steps (0: none)
  # and at the end.
  c.eval = ml_collections.ConfigDict(dict(size=150, every=0, pass_k=0, before=True))
  # dump_every: write dump_count trajectories (tokens, roles, loss mask, gold, reward,
  # advantage) to <workdir>/samples/step_NNNNNN.{txt,jsonl} (step_000004.txt: RL step 4) every
  # dump_every RL steps (0: never), and each eval's first dump_count greedy ones, with their
  # successes, to samples/eval_before, eval_after_sft and eval_step_NNNNNN.
  c.log = ml_collections.ConfigDict(dict(tensorboard=True, progress=True, dump_every=4,
                                         dump_count=4))
  c.checkpoint_every = 0       # save every N RL steps (0: off); rerunning resumes
  c.checkpoint_keep = 3        # keep the newest N checkpoints
  c.checkpoint_keep_every = 0  # and every K-th step (0: none)
  c.checkpoint_async = True    # write checkpoints in the background while training goes on
  c.checkpoint_dir = ""        # "" -> <workdir>/checkpoints; shared storage for multi-host
  c.export = False             # write <workdir>/export (HF safetensors) at the end

  if arg == "tiny":
    c.workdir = "runs/quickstart-tiny"
    c.total_steps = 2
    c.model.path = "tiny-llama"
    c.model.tokenizer = "smollm2-135m-instruct"
    c.model.init_std = 0.2
    c.env.kwargs.update(train_size=64, eval_size=8, sft_size=16)
    c.rollout.update(slots=8, max_len=128, max_tokens_per_turn=12, max_turns=2)
    c.train.update(prompts_per_step=4, samples_per_prompt=2, pack_len=128, len_buckets=(128,))
    c.sft.update(steps=2, batch_size=4, num_examples=16)
    c.eval.update(size=8, every=2)
    c.log.update(progress=False, dump_every=1)
  elif arg not in (None, ""):
    raise ValueError(f"unknown quickstart variant {arg!r}; expected '' or 'tiny'")
  return c
