"""Several tasks trained at once: `MixtureEnv` (`env.name = "mixture"`).

Each example belongs to one task. The mixture's examples are its tasks' examples with their ids
prefixed by the task's label (`"<label>/<id>"`) and the label in `metadata["task"]`; every call
the trainer and the rollout driver make for an example goes to its task's env with the task's
own example: the prompt (`render_prompt`), the trajectory's tools (`new_episode`), the
parser and its stop strings, the observation format, the reward, the success test
(`is_success`, through `env_for`) and the demonstration. So a math trajectory stops at its own
tags, calls its own tools and is scored by its own verifier while a search trajectory beside it
in the same batch does the same with its own.

    c.env.name = "mixture"
    c.env.kwargs = dict(tasks=dict(
        arith=dict(env="quickstart", weight=1.0),
        gsm=dict(env="math_tool", weight=3.0, kwargs=dict(difficulty="medium"))))

Splits:
  * "train": with weights, each task's share of the training examples is its weight's share
    (its examples repeated, or a subset of them drawn with `seed`, by default the run's, to
    that count; the total is the sum of the tasks' sizes); without weights, every task's
    examples once.
  * "eval" and "sft": the tasks' examples interleaved one task at a time, so that the first n
    (`eval.size`, `sft.num_examples`) hold about n / tasks of each. A task without an "sft"
    split gives no demonstrations (logged once): its `examples("sft")` raises
    `agent.env.NoSplitError` (or, from an env written before it, what `agent.env.lacks_split`
    also reads as a missing split). Any other error (a broken data file) is raised, naming the
    task (`TaskSplitError`, a `ValueError`). A task without an "eval" or "train" split makes
    the mixture's `examples` of that split raise `NoSplitError`, naming the task.

The trainer logs a task's share of a step's rewards as `reward/task/<label>` and its held-out
pass@1 as `eval/task/<label>/pass@1` (`task_of`).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import numbers
from typing import Any, Mapping, Sequence

import numpy as np

from jaxagent.agent.env import Env, Episode, Example, NoSplitError, lacks_split
from jaxagent.agent.trajectory import Trajectory
from jaxagent.rewards import RewardOutput

log = logging.getLogger(__name__)

TASK_KEY = "task"  # the key of an example's `metadata` that names its task
_SPEC_KEYS = ("env", "weight", "kwargs")


def _plain(value):
  """A config section (`ml_collections.ConfigDict`, which is no `Mapping`) as a dict."""
  return value.to_dict() if callable(getattr(value, "to_dict", None)) else value


def _build(label: str, spec) -> tuple[Env, float | None]:
  """(env, weight) of one entry of `tasks`: an `Env`, or a mapping with "env" (a registered
  name or "module:Class"; default: the label), "weight" and "kwargs"."""
  if isinstance(spec, Env):
    return spec, None
  spec = _plain(spec)
  if not isinstance(spec, Mapping):
    raise ValueError(f"mixture task {label!r}: expected an Env or a mapping with keys "
                     f"{', '.join(map(repr, _SPEC_KEYS))}, got {type(spec).__name__}")
  unknown = sorted(set(spec) - set(_SPEC_KEYS))
  if unknown:
    raise ValueError(f"mixture task {label!r}: unknown key(s) {unknown}; a task takes "
                     f"{', '.join(map(repr, _SPEC_KEYS))} (the env's own settings go under "
                     "'kwargs')")
  from jaxagent.envs import make_env
  name = spec.get("env", label)
  kwargs = _plain(spec.get("kwargs")) or {}
  if not isinstance(name, str) or not name:
    raise ValueError(f"mixture task {label!r}: 'env' must name a task (e.g. 'quickstart'), "
                     f"got {name!r}")
  if name == "mixture":
    raise ValueError(f"mixture task {label!r}: a mixture cannot hold another mixture; list its "
                     "tasks here instead")
  if not isinstance(kwargs, Mapping):
    raise ValueError(f"mixture task {label!r}: 'kwargs' must be a mapping of the env's settings, "
                     f"got {type(kwargs).__name__}")
  try:
    env = make_env(name, **dict(kwargs))
  except ValueError as e:
    raise ValueError(f"mixture task {label!r}: {e}") from e
  return env, spec.get("weight")


class TaskSplitError(ValueError):
  """A mixture task's split failed to load (a broken data file), named with the task. A type
  of its own, so that its message, which quotes the task's error, is never read as the words
  of a missing split (`agent.env.lacks_split`'s fallback for plain ValueErrors): the warm
  start reports it as a load failure."""


def _equal(a: Example, b: Example) -> bool:
  """`a == b`, False where comparing raises (metadata holding arrays, whose `==` has no truth
  value)."""
  try:
    return bool(a == b)
  except Exception:  # noqa: BLE001 - the task's own metadata
    return False


class MixtureEnv(Env):
  """Tasks trained together; see the module docstring.

  Args:
    tasks: label -> an `Env`, or a mapping {"env": registered name or "module:Class" (default:
      the label), "weight": float (optional), "kwargs": the env's settings (optional)}. Labels
      are non-empty strings without "/".
    weights: label -> weight, for tasks given as `Env`s (or to override); either every task
      has a weight or none does. Weights are finite and >= 0, and not all 0.
    seed: the seed of the weighted train split's subsets. Unset (None), the trainer gives the
      run's `seed` (`use_run_seed`), so that runs of other seeds draw other subsets; a mixture
      used outside a trainer then draws with 0.
  """

  name = "mixture"

  def __init__(self, tasks: Mapping[str, Any], weights: Mapping[str, float] | None = None,
               seed: int | None = None):
    tasks, weights = _plain(tasks), _plain(weights)
    if not isinstance(tasks, Mapping) or not tasks:
      raise ValueError("a mixture needs `tasks`: a mapping of labels to tasks, e.g. "
                       "{'arith': {'env': 'quickstart'}, 'gsm': {'env': 'math_tool'}}")
    envs, given = {}, {}
    for label, spec in tasks.items():
      if not isinstance(label, str) or not label or "/" in label:
        raise ValueError(f"mixture task label {label!r}: labels are non-empty strings without "
                         "'/' (they prefix the task's example ids)")
      envs[label], w = _build(label, spec)
      if w is not None:
        given[label] = w
    if weights is not None:
      if not isinstance(weights, Mapping):
        raise ValueError(f"mixture weights must map task labels to numbers, got {weights!r}")
      unknown = sorted(set(weights) - set(envs))
      if unknown:
        raise ValueError(f"mixture weights name unknown task(s) {unknown}; the tasks are "
                         f"{sorted(envs)}")
      given.update(weights)
    if given and set(given) != set(envs):
      raise ValueError(f"mixture weights: either every task has one or none does; missing for "
                       f"{sorted(set(envs) - set(given))}")
    for label, w in given.items():
      if isinstance(w, bool) or not isinstance(w, numbers.Real) or not 0 <= w < math.inf:
        raise ValueError(f"mixture task {label!r}: weight {w!r} must be a finite number >= 0")
    if given and not any(given.values()):
      raise ValueError("mixture weights are all 0: no task would be trained")
    obs = {bool(getattr(e, "train_on_observations", False)) for e in envs.values()}
    if len(obs) > 1:
      raise ValueError(
          "mixture tasks disagree on train_on_observations ("
          + ", ".join(f"{k}: {bool(getattr(e, 'train_on_observations', False))}"
                      for k, e in envs.items())
          + "): the trainer takes one setting for every trajectory")
    self.envs: dict[str, Env] = envs
    self.weights: dict[str, float] | None = ({k: float(v) for k, v in given.items()}
                                             if given else None)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
      raise ValueError(f"mixture seed must be an int, got {seed!r}")
    self.seed: int | None = None if seed is None else int(seed)
    self.train_on_observations = obs.pop()
    # Scored concurrently only as far as every task allows.
    self.reward_threads = min(max(1, int(getattr(e, "reward_threads", 1))) for e in envs.values())
    # Mixture id -> (the mixture's example, its label, the task's own example), one entry per
    # split that holds the id: ids are unique within a split, and a task may number its train
    # and eval examples alike.
    self._origin: dict[str, list[tuple[Example, str, Example]]] = {}
    self._splits: dict[str, list[Example]] = {}
    self._no_sft_logged = False

  def use_run_seed(self, seed: int) -> None:
    """Draw the weighted train split's subsets with the run's `seed` unless the mixture was
    given its own (the trainer calls this before it reads any split)."""
    if self.seed is None:
      if "train" in self._splits:
        raise RuntimeError("use_run_seed after the train split was drawn: call it first")
      self.seed = int(seed)

  # ------------------------------------------------------------------ examples
  def _tagged(self, label: str, ex: Example) -> Example:
    if not isinstance(ex, Example):
      raise ValueError(f"mixture task {label!r} gave a {type(ex).__name__}, not a "
                       "jaxagent.agent.Example")
    out = dataclasses.replace(ex, id=f"{label}/{ex.id}",
                              metadata={**ex.metadata, TASK_KEY: label})
    self._origin.setdefault(out.id, []).append((out, label, ex))
    return out

  def _found(self, example: Example) -> tuple[Example, str, Example] | None:
    """The `_origin` entry of `example`: itself (as the trainer passes it), else an equal one
    (a copy), else None."""
    entries = self._origin.get(example.id, ())
    return (next((e for e in entries if e[0] is example), None)
            or next((e for e in entries if _equal(e[0], example)), None))

  def _task_examples(self, split: str) -> dict[str, list[Example]]:
    out = {}
    for label, env in self.envs.items():
      try:
        exs = list(env.examples(split))
      except Exception as e:  # noqa: BLE001 - the task's own code and data
        if not lacks_split(e, split):
          raise TaskSplitError(f"mixture task {label!r} ({type(env).__name__}) cannot give "
                               f"its {split!r} examples: {type(e).__name__}: {e}") from e
        if split != "sft":
          raise NoSplitError(f"mixture task {label!r} ({type(env).__name__}) has no {split!r} "
                             f"split: {type(e).__name__}: {e}", split=split) from e
        if not self._no_sft_logged:
          log.warning("mixture task %r has no 'sft' examples (%s: %s); it gives no "
                      "demonstrations", label, type(e).__name__, e)
        continue
      out[label] = [self._tagged(label, ex) for ex in exs]
    if split == "sft":
      self._no_sft_logged = True
    return out

  def examples(self, split: str) -> Sequence[Example]:
    if split not in self._splits:
      per_task = self._task_examples(split)
      if split == "train" and self.weights is not None:
        self._splits[split] = self._weighted(per_task)
      else:  # one task at a time, so a prefix holds about as many of each
        self._splits[split] = [ex for group in itertools.zip_longest(*per_task.values())
                               for ex in group if ex is not None]
    return self._splits[split]

  def _weighted(self, per_task: dict[str, list[Example]]) -> list[Example]:
    """Each task's examples repeated or subsampled (seeded) to its weight's share of the
    tasks' total size; a task with weight 0 gives none."""
    total = sum(len(v) for v in per_task.values())
    wsum = sum(self.weights[k] for k in per_task)
    out = []
    rng = np.random.default_rng(0 if self.seed is None else self.seed)
    for label, exs in per_task.items():
      want = round(total * self.weights[label] / wsum) if wsum else 0
      if want and not exs:
        raise ValueError(f"mixture task {label!r} has weight {self.weights[label]} but no "
                         "'train' examples")
      if not want and self.weights[label] > 0 and exs:
        raise ValueError(
            f"mixture task {label!r}: weight {self.weights[label]} of {wsum:g} in all gives it "
            f"{total * self.weights[label] / wsum:.2g} of the {total} train examples, which "
            "rounds to none: raise its weight (or set it to 0 to leave the task out)")
      full, rest = divmod(want, len(exs)) if exs else (0, 0)
      picked = exs * full + [exs[i] for i in sorted(rng.permutation(len(exs))[:rest])]
      out += picked
    return out

  # ------------------------------------------------------------------ dispatch
  def task_of(self, example: Example | str) -> str:
    """The label of the task of `example` (an `Example`, or the id of one of the mixture's)."""
    if isinstance(example, str):
      label = example.partition("/")[0]
      if label not in self.envs or "/" not in example:
        raise ValueError(f"example id {example!r} is not one of this mixture's ('<task>/<id>' "
                         f"with a task among {sorted(self.envs)})")
      return label
    found = self._found(example)
    if found is not None:
      return found[1]
    label = example.metadata.get(TASK_KEY) if isinstance(example.metadata, Mapping) else None
    if label not in self.envs:
      raise ValueError(f"example {example.id!r} is not one of this mixture's (no known "
                       f"metadata[{TASK_KEY!r}]; the tasks are {sorted(self.envs)})")
    return label

  def _source(self, example: Example) -> tuple[Env, Example]:
    found = self._found(example)
    if found is not None:
      _, label, ex = found
      return self.envs[label], ex
    return self.envs[self.task_of(example)], example

  def env_for(self, example: Example) -> Env:
    return self._source(example)[0]

  def render_prompt(self, example: Example, tokenizer) -> list[int]:
    env, ex = self._source(example)
    return env.render_prompt(ex, tokenizer)

  def new_episode(self, example: Example) -> Episode:
    env, ex = self._source(example)
    return env.new_episode(ex)

  def reward(self, trajectory: Trajectory, example: Example, tokenizer, step: int) -> RewardOutput:
    env, ex = self._source(example)
    return env.reward(trajectory, ex, tokenizer, step)

  def is_success(self, out: RewardOutput) -> bool:
    raise TypeError("a mixture's success test depends on the example's task: call "
                    "env.env_for(example).is_success(out)")

  def format_observation(self, result):
    raise TypeError("a mixture's observations are framed by the example's task: call "
                    "env.env_for(example).format_observation(result)")

  def encode_observation(self, text: str, tokenizer) -> list[int]:
    raise TypeError("a mixture's observations are tokenized by the example's task: call "
                    "env.env_for(example).encode_observation(text, tokenizer)")

  def demonstration(self, example: Example):
    env, ex = self._source(example)
    return env.demonstration(ex)

  @property
  def parser(self):
    raise AttributeError("a mixture has no parser of its own: each task's env parses its "
                         "trajectories (env.env_for(example).parser)")

  @property
  def member_envs(self) -> Sequence[Env]:
    return tuple(self.envs.values())
