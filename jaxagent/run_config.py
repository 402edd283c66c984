"""A run config's checks and the settings read from it (`jaxagent.trainer` re-exports these).

`check_config` names unknown and missing keys (with a suggestion for a typo) and impossible
settings before anything is built; `KNOWN_CONFIG_KEYS` lists every key a run reads
(`configs/quickstart.py` sets them all). Settings that are legal but rarely meant are logged
once per process as warnings. `overlong_shaping` reads DAPO's soft overlong punishment from
the `reward` section.
"""
from __future__ import annotations

import logging
import math
import pathlib
from typing import get_args

import numpy as np

from jaxagent import checkpoint, config_files, sharding
from jaxagent._token_ids import is_int
from jaxagent.agent.rollout import RolloutConfig
from jaxagent.generate import EngineConfig, SamplingConfig
from jaxagent.models import lora as lora_lib
from jaxagent.models.config import RUN_MODEL_KEYS
from jaxagent.rewards.shaping import OverlongConfig
from jaxagent.rl import advantages as adv_lib
from jaxagent.rl import losses, packing, step as step_lib

# The trainer's logger: a run's config warnings are logged under it, as they were when these
# checks lived in `jaxagent.trainer`.
log = logging.getLogger("jaxagent.trainer")

# Every key a run config may set: those of `configs/quickstart.py`, which sets them all
# (`tests/trainer_test.py` keeps the two equal); the `model` section's are `run_overrides`'.
# Under `env.kwargs` any key goes: the task's own settings, checked by the task.
KNOWN_CONFIG_KEYS = frozenset("""
    checkpoint_async checkpoint_dir checkpoint_every checkpoint_keep checkpoint_keep_every
    env.name env.kwargs
    eval.before eval.every eval.pass_k eval.size
    export seed total_steps workdir
    log.dump_count log.dump_every log.progress log.tensorboard
    lora.alpha lora.dropout lora.forward lora.init_from lora.rank lora.targets
    loss.agg loss.algo loss.clip_high loss.clip_low loss.dual_clip loss.entropy_coef
    loss.kl_coef loss.kl_estimator loss.max_len_norm loss.tis_cap loss.tis_level
    mesh.data mesh.fsdp mesh.tensor
    optimizer.b1 optimizer.b2 optimizer.lr optimizer.max_grad_norm optimizer.schedule
    optimizer.warmup_steps optimizer.weight_decay
    reward.overlong_cache_tokens reward.overlong_coef reward.overlong_max_tokens
    rollout.decode_steps rollout.max_len rollout.max_observation_tokens rollout.max_prompt_tokens
    rollout.max_tokens_per_turn rollout.max_total_tokens rollout.max_turns rollout.mesh
    rollout.devices rollout.observation_truncation rollout.slots rollout.temperature
    rollout.tool_timeout_s rollout.top_k rollout.top_p rollout.traj_tool_timeout_s
    sft.batch_size sft.data sft.lr sft.num_examples sft.steps sft.warmup_steps
    train.advantage train.dynamic_sampling train.epochs train.gather_weights
    train.len_buckets train.logprob_save_probs train.max_sampling_rounds train.micro_batches
    train.mini_batches train.nonfinite train.off_policy_steps train.pack_len
    train.prompts_per_step train.row_rounding train.samples_per_prompt train.time_limit_s
    train.zero_variance
""".split()) | {f"model.{k}" for k in RUN_MODEL_KEYS}
_FREE_FORM = ("env.kwargs",)
# The keys a run reads with a default (`.get`), which a config may leave out; the trainer reads
# every other known key as an attribute, so a config without one failed with an AttributeError
# traceback from wherever it was first read (for eval.pass_k: the first eval, after training).
OPTIONAL_CONFIG_KEYS = frozenset("""
    checkpoint_async checkpoint_dir checkpoint_every checkpoint_keep checkpoint_keep_every
    env.kwargs export log.dump_count lora.alpha lora.dropout lora.forward lora.init_from
    lora.rank lora.targets
    loss.dual_clip loss.max_len_norm loss.tis_cap loss.tis_level
    model.attention model.init_seed model.init_std model.logprob model.norm_rope
    model.scan_layers model.tokenizer
    reward.overlong_cache_tokens reward.overlong_coef reward.overlong_max_tokens
    rollout.max_observation_tokens rollout.max_prompt_tokens rollout.max_total_tokens
    rollout.devices rollout.mesh rollout.observation_truncation
    sft.data sft.warmup_steps
    train.gather_weights train.len_buckets train.logprob_save_probs train.mini_batches
    train.nonfinite train.off_policy_steps train.row_rounding train.time_limit_s
""".split())


def config_keys(config, prefix: str = "") -> list[str]:
  """Dotted keys of a (nested) config's leaves; free-form sections count as one key."""
  out = []
  for k, v in config.items():
    key = prefix + k
    if hasattr(v, "items") and key not in _FREE_FORM:
      out += config_keys(v, key + ".")
    else:
      out.append(key)
  return out


def check_config(config) -> None:
  """Raise ValueError naming unknown keys (typos are otherwise silently ignored: the trainer
  reads optional keys with defaults) and counts that would make a run do nothing."""
  unknown = [k for k in config_keys(config) if k not in KNOWN_CONFIG_KEYS]
  if unknown:
    raise ValueError("unknown config key(s): " +
                     ", ".join(config_files.did_you_mean(k, KNOWN_CONFIG_KEYS) for k in unknown) +
                     ". configs/quickstart.py sets every key a run reads.")
  present = set(config_keys(config))
  if "model.path" not in present:
    raise ValueError("the config names no model: set model.path to a preset, an HF model "
                     "directory or a .gguf file (e.g. model.path='smollm2-135m-instruct')")
  missing = sorted(KNOWN_CONFIG_KEYS - OPTIONAL_CONFIG_KEYS - present)
  if missing:
    named = [f"'{k.rpartition('.')[2]}'" + (f" ({k})" if "." in k else "") for k in missing]
    raise ValueError("the config has no key " + ", no key ".join(named[:8])
                     + (f" (and {len(named) - 8} more)" if len(named) > 8 else "")
                     + ", which a run reads. configs/quickstart.py sets every key a run reads "
                     "(a config file can start from it: jaxagent.config_files.load_config).")

  def count(key, least, none_ok=False):
    section, _, name = key.rpartition(".")
    node = config
    for part in filter(None, section.split(".")):
      node = node.get(part) if hasattr(node, "get") else None
    if not hasattr(node, "get") or name not in node:
      return  # an optional key left out (a required one missing is named above)
    v = node.get(name)
    # None where the run reads it as a count passed, then failed (eval.pass_k=None at the
    # first eval, after the warm start) with a TypeError naming no key. Where it reads as
    # "none" or "all" (sft.num_examples=None: every demonstration) it stays allowed.
    if v is None and none_ok:
      return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
      raise ValueError(f"{key} must be an int >= {least}, got {v!r}")
  count("total_steps", 0)
  count("seed", 0)  # the prompt shuffle takes only non-negative seeds; samplers take it mod 2**32
  for key in ("train.prompts_per_step", "train.samples_per_prompt", "train.epochs",
              "rollout.slots", "train.micro_batches", "train.mini_batches",
              "train.max_sampling_rounds", "sft.batch_size"):
    count(key, 1)
  # Negative values were taken as Python slices or ranges: eval.size=-1 evaluated all but the
  # last example, sft.steps=-1 ran the evals before RL and then crashed with an IndexError.
  for key in ("sft.steps", "sft.num_examples", "eval.size", "eval.every", "log.dump_every",
              "log.dump_count"):
    count(key, 0, none_ok=True)
  count("eval.pass_k", 0)
  count("train.off_policy_steps", 0)
  count("rollout.devices", 0)
  # Read only after the first step's rollouts (and the warm start): check them now.
  train = config.get("train") if hasattr(config, "get") else None
  if (hasattr(train, "get") and train.get("samples_per_prompt") == 1
      and (config.get("total_steps") or 0) > 0):
    raise ValueError(
        "train.samples_per_prompt=1 gives every group one member, so every group-relative "
        "advantage (grpo, dr_grpo, rloo) is 0 and no RL step would learn: use 2 or more "
        "(or total_steps=0 for a run without RL)")
  for key, allowed in (("advantage", get_args(adv_lib.Method)),
                       ("zero_variance", get_args(adv_lib.ZeroVariance))):
    if not hasattr(train, "get") or key not in train:
      continue
    v = train.get(key)
    if v not in allowed:  # (None too: it failed after the first step's rollouts, unnamed)
      raise ValueError(f"train.{key} must be one of {allowed}, got {v!r}")
  # Dynamic sampling accepts informative groups only (`DynamicSampler.update`), so "keep" was
  # silently dropped: no zero-variance group reached the update (nor its KL / entropy terms).
  if (hasattr(train, "get") and train.get("dynamic_sampling")
      and train.get("zero_variance") == "keep"):
    raise ValueError(
        "train.dynamic_sampling=True trains only on groups whose rewards differ and samples "
        "more prompts in place of the others, so train.zero_variance='keep' would not keep "
        "them: set train.zero_variance='drop' with dynamic sampling, or "
        "train.dynamic_sampling=False to train on zero-variance groups too")
  # Settings the trainer turns into validated dataclasses only once the model is loaded (minutes
  # for a large one, and after the launcher's fit check): built here as well, so that a bad
  # checkpoint_keep, rollout budget, sampling or packing setting fails before that work.
  checkpoint.CheckpointConfig.from_config(config)
  # `--config.checkpoint_dir=None` gives the string "None": checkpoints went to a directory
  # called None in the current directory (not even under the workdir). A workdir of None (the
  # string) wrote the whole run to ./None; Python None made ./None at launch and then raised a
  # TypeError traceback in the trainer.
  none_text = lambda v: isinstance(v, str) and v.strip().lower() in ("none", "null")
  ckpt_dir = config.get("checkpoint_dir") if hasattr(config, "get") else None
  if none_text(ckpt_dir):
    raise ValueError(f"checkpoint_dir={ckpt_dir!r} is the text {ckpt_dir!r}, not a directory: "
                     "set --config.checkpoint_dir='' for <workdir>/checkpoints (and "
                     "checkpoint_every=0 for no checkpoints), or name a directory (./None "
                     "if a directory of that name is meant)")
  workdir = config.get("workdir", "") if hasattr(config, "get") else ""
  if workdir is None or none_text(workdir):
    raise ValueError(f"workdir={workdir!r} is not a directory: the run writes its metrics, "
                     "samples and checkpoints there; set --config.workdir to one (./None if a "
                     "directory of that name is meant)")
  if hasattr(train, "get"):
    _time_limit_s(train)
  rollout = config.get("rollout") if hasattr(config, "get") else None
  if hasattr(rollout, "get"):
    sharding.check_rollout_mesh(rollout.get("mesh", "learner"))
  if hasattr(rollout, "get") and "max_turns" in rollout:
    _rollout_config(rollout)
    sampling = SamplingConfig(rollout.get("temperature", 1.0), rollout.get("top_p", 1.0),
                              rollout.get("top_k", 0))
    if (sampling.temperature == 0 or sampling.top_k == 1) and (config.get("total_steps") or 0) > 0:
      # Greedy samples of one prompt are one sample repeated (the tools too are called alike),
      # so every group has zero variance and the run would train on nothing.
      raise ValueError(
          f"rollout.temperature={sampling.temperature!r}, rollout.top_k={sampling.top_k!r} "
          "samples greedily: the samples of a prompt would be identical, every group-relative "
          "advantage 0 and no RL step would learn; sample with temperature > 0 and top_k != 1 "
          "(the evals decode greedily already), or total_steps=0 for a run without RL")
    if "max_len" in rollout:  # (rollout.max_len=0 failed in the engines, after the model load)
      EngineConfig(slots=rollout.get("slots", 8), max_len=rollout.max_len, sampling=sampling)
  if hasattr(train, "get") and train.get("pack_len") is not None:
    packing.config_from_train(train, 1)
  overlong_shaping(config)
  # The losses and optimizers (optimizer.b1=1.5, sft.lr=-1, loss.clip_low=-0.2 were refused
  # only in `Trainer`, after the launcher's fit check had compiled every program).
  step_lib.learner_parts(config)
  _warn_long_warmups(config)
  _warn_unused_loss_settings(config)
  # Read by the warm start, after the evals before training: a missing file ended the run there.
  sft = config.get("sft") if hasattr(config, "get") else None
  data = sft.get("data") if hasattr(sft, "get") else None
  if data and sft.get("steps") and not pathlib.Path(data).is_file():
    raise FileNotFoundError(f"sft.data={data!r} is not a file: give a chat JSONL file (one "
                            "{\"messages\": [...]} object per line), or sft.data='' for the "
                            "task's demonstrations")
  lora_cfg = lora_lib.from_config(config.get("lora"))  # a bad rank / alpha / targets fails here
  init_from = config.lora.get("init_from") if "lora" in config else None
  if init_from:
    if not isinstance(init_from, str):
      raise ValueError(f"lora.init_from must be a PEFT adapter directory (a string), got "
                       f"{init_from!r}")
    if lora_cfg is None:
      raise ValueError(f"lora.init_from={init_from!r} starts the run from a LoRA adapter, but "
                       "lora.rank=0 trains every weight: set lora.rank (and lora.alpha, "
                       "lora.targets) to the adapter's")
    if not (pathlib.Path(init_from).expanduser() / lora_lib.PEFT_CONFIG).is_file():
      raise ValueError(f"lora.init_from={init_from!r} is not a PEFT adapter directory (no "
                       f"{lora_lib.PEFT_CONFIG} there)")
  # The warm start on the task's demonstrations takes the first sft.num_examples of them: 0
  # failed there, after the eval before training, saying the task "gave no demonstrations".
  if (hasattr(sft, "get") and not data and sft.get("steps")
      and sft.get("num_examples", None) == 0):
    raise ValueError(f"sft.num_examples=0 leaves the SFT warm start (sft.steps={sft.steps}) "
                     "no demonstrations to train on: set sft.num_examples > 0, give a chat "
                     "JSONL file as sft.data, or set sft.steps=0")


# Warnings of `check_config` already logged by this process: the launcher checks the config
# and then the trainer checks it again.
_CONFIG_WARNINGS: set[str] = set()


def _warn_once(msg: str) -> None:
  if msg not in _CONFIG_WARNINGS:
    _CONFIG_WARNINGS.add(msg)
    log.warning("%s", msg)


def _warn_unused_loss_settings(config) -> None:
  """Logs a warning (once per process) for loss settings that are legal and rarely meant: a KL
  estimator chosen for a run without a KL term (kl_coef 0: no reference model is kept, so the
  estimator is never used, and train/kl_ref is not logged), and a clip range whose upper side
  is narrower than its lower side (the reverse of DAPO's clip-higher, e.g. swapped values)."""
  loss = config.get("loss") if hasattr(config, "get") else None
  if not hasattr(loss, "get"):
    return
  est, coef = loss.get("kl_estimator"), loss.get("kl_coef")
  default_est = losses.LossConfig.kl_estimator
  if coef == 0 and est != default_est:
    _warn_once(f"loss.kl_estimator={est!r} is not used: loss.kl_coef=0 adds no KL term, so the "
               "run keeps no reference model (and logs no train/kl_ref); set loss.kl_coef > 0 "
               f"for a KL penalty with that estimator, or leave kl_estimator at {default_est!r}")
  lo, hi = loss.get("clip_low"), loss.get("clip_high")
  if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi)) and hi < lo:
    _warn_once(f"loss.clip_high={hi} is below loss.clip_low={lo}: the ratio is clipped to "
               f"[{1 - lo:.4g}, {1 + hi:.4g}], narrower above 1 than below, the reverse of DAPO's "
               "clip-higher (clip_high > clip_low, e.g. 0.2 / 0.28); swap them if clip-higher "
               "was meant")


def _warn_long_warmups(config) -> None:
  """Logs a warning (once per process) when a warmup is not shorter than the updates it warms:
  the learning rate then never reaches the configured rate (legal, and rarely meant). The RL
  optimizer makes `total_steps * train.epochs * train.mini_batches` updates
  (`step.learner_parts`); the warm start `sft.steps`. Update i (from 0) runs at i / warmup_steps of the rate during the warmup, so the
  rate is reached only when warmup_steps < the number of updates. (The cosine and linear
  schedules already refuse such a warmup: they need total steps > warmup_steps to decay over.)"""
  get = lambda section, key: (section.get(key) if hasattr(section, "get") else None)
  opt, train, sft = (get(config, k) for k in ("optimizer", "train", "sft"))
  epochs = get(train, "epochs") or 1
  minis = get(train, "mini_batches") or 1
  runs = [("optimizer.warmup_steps", get(opt, "warmup_steps"), "optimizer.lr",
           (get(config, "total_steps") or 0) * epochs * minis,
           f"total_steps={get(config, 'total_steps')} x train.epochs={epochs}"
           + (f" x train.mini_batches={minis}" if minis != 1 else "") + " RL updates")]
  if get(opt, "schedule") not in (None, "constant"):
    runs = []  # `step.make_optimizer` raises for these
  runs.append(("sft.warmup_steps", get(sft, "warmup_steps"), "sft.lr", get(sft, "steps") or 0,
               f"sft.steps={get(sft, 'steps')} warm-start updates"))
  for key, warmup, lr, updates, what in runs:
    if not isinstance(warmup, (int, np.integer)) or isinstance(warmup, bool) or warmup <= 0:
      continue
    if not isinstance(updates, (int, np.integer)) or isinstance(updates, bool) or updates <= 0:
      continue
    if warmup >= updates:
      _warn_once(f"{key}={warmup} is not shorter than the run's {what}: the learning rate never "
                 f"reaches {lr} (the last update runs at {(updates - 1) / warmup:.3g} of it); "
                 f"lower {key} below {updates} if the full rate is meant")


def _rollout_config(r) -> RolloutConfig:
  """The rollout budgets of the `rollout` config section."""
  return RolloutConfig(
      max_turns=r.max_turns, max_tokens_per_turn=r.max_tokens_per_turn,
      max_total_tokens=r.get("max_total_tokens"),
      max_prompt_tokens=r.get("max_prompt_tokens"), tool_timeout_s=r.tool_timeout_s,
      traj_tool_timeout_s=r.traj_tool_timeout_s, decode_steps=r.decode_steps,
      max_observation_tokens=r.get("max_observation_tokens"),
      observation_truncation=r.get("observation_truncation", "middle"))


OVERLONG = "overlong"  # the reward component `reward.overlong_*` adds to RL rewards


def overlong_shaping(config) -> tuple[OverlongConfig, float] | None:
  """DAPO's soft overlong punishment from the `reward` section: (config, weight), or None when
  it is off (`reward.overlong_cache_tokens` 0 or missing).

  `reward.overlong_max_tokens` (L_max) defaults to the policy-token budget of a trajectory,
  `rollout.max_turns * rollout.max_tokens_per_turn`; the punishment counts the policy's own
  tokens over all turns (`Trajectory.num_policy_tokens`), as `rewards.overlong_penalty` does.
  A ramp that starts past the rollout's length cap (`rollout.max_len`, `max_total_tokens`), which
  no trajectory reaches, is an error."""
  reward = config.get("reward") if hasattr(config, "get") else None
  if not hasattr(reward, "get"):
    return None
  cache = reward.get("overlong_cache_tokens", 0)
  if cache is None or (is_int(cache) and cache == 0):
    return None
  if not is_int(cache) or cache < 0:
    raise ValueError(f"reward.overlong_cache_tokens must be an int >= 0 (0: no overlong "
                     f"shaping), got {cache!r}")
  rollout = config.get("rollout") if hasattr(config, "get") else None
  if not hasattr(rollout, "get"):
    rollout = {}
  max_tokens = reward.get("overlong_max_tokens")
  if max_tokens is None:
    turns, per_turn = rollout.get("max_turns"), rollout.get("max_tokens_per_turn")
    if not (is_int(turns) and is_int(per_turn)):
      raise ValueError("reward.overlong_max_tokens is unset and the rollout budget "
                       "(rollout.max_turns x rollout.max_tokens_per_turn) is not given: set it")
    max_tokens, where = int(turns) * int(per_turn), (
        f" (unset: rollout.max_turns={turns} x rollout.max_tokens_per_turn={per_turn})")
  else:
    where = ""
    if not is_int(max_tokens):
      raise ValueError(f"reward.overlong_max_tokens must be an int (policy tokens) or None for "
                       f"the rollout's policy-token budget, got {max_tokens!r}")
  if not 0 < cache <= max_tokens:
    raise ValueError(f"reward.overlong_cache_tokens={cache} must be at most "
                     f"reward.overlong_max_tokens={max_tokens}{where}: the punishment ramps from "
                     f"0 at max - cache policy tokens to -1 at max")
  # A trajectory (prompt and observations included) is cut at the rollout's length cap: when
  # that is at most max - cache tokens, no trajectory's policy tokens pass max - cache and the
  # punishment is 0 on every one (a budget of long turns over a short cache).
  caps = {k: int(v) for k in ("max_total_tokens", "max_len")
          if is_int(v := rollout.get(k)) and v > 0}
  if caps:
    key = min(caps, key=caps.get)
    if caps[key] - 1 <= max_tokens - cache:
      raise ValueError(
          f"reward.overlong_max_tokens={max_tokens}{where} less reward.overlong_cache_tokens="
          f"{cache} is {max_tokens - cache} policy tokens, but rollout.{key}={caps[key]} cuts "
          "every trajectory (prompt and observations included) before that: the overlong "
          "punishment would be 0 on every trajectory. Set reward.overlong_max_tokens to at most "
          f"rollout.{key} (the policy tokens a trajectory may reach), or raise rollout.{key}")
  coef = reward.get("overlong_coef", 1.0)
  if (isinstance(coef, bool) or not isinstance(coef, (int, float, np.number))
      or not math.isfinite(coef) or coef < 0):
    raise ValueError(f"reward.overlong_coef must be a finite number >= 0 (the weight of the "
                     f"punishment, which is in [-1, 0]), got {coef!r}")
  return OverlongConfig(max_tokens=int(max_tokens), cache_tokens=int(cache)), float(coef)


def _time_limit_s(train) -> float:
  """`train.time_limit_s`: the wall-clock budget of the RL loop in seconds (0 or missing: none)."""
  v = train.get("time_limit_s", 0.0)
  try:
    v = 0.0 if v is None else float(v)
  except (TypeError, ValueError):
    raise ValueError(f"train.time_limit_s must be a number of seconds >= 0 (0: no limit), "
                     f"got {v!r}") from None
  if math.isnan(v) or v < 0:
    raise ValueError(f"train.time_limit_s must be a number of seconds >= 0 (0: no limit), "
                     f"got {v!r}")
  return v


