"""Multi-hop question answering with a search engine (Search-R1 style), over a generated world.

The questions and documents come from `envs/knowledge_base.py`: fictional people, cities,
countries, universities and companies, stored as a tfds ArrayRecord dataset and read with grain.
No model can know these facts, so it has to search for them.

Protocol (one trajectory):

    <think>I need to find who founded Bidond Holdings.</think>
    <search>Bidond Holdings</search>
    <information>Doc 1 (Title: Bidond Holdings): ... founded by Kroskbu Stairnci ...</information>
    <think>Bidond Holdings was founded by Kroskbu Stairnci. Now I need ...</think>
    ...
    <answer>Riampo</answer>

The `<information>` block is the search tool's observation: it is not the policy's text, so by
default it gets no loss. `mask_observations=False` marks it trainable instead (the retrieved-
token masking ablation of Search-R1): the env then sets `train_on_observations = True`, which
the trainer reads when it turns RL trajectories into packed rows (their old log-probs, which the
sampler never produced, are scored with the current policy before the update). The SFT warm
start trains on the demonstrations' policy tokens in both arms, so the arms differ only in RL.

Reward: exact match of the `<answer>` (only that block, as the rollout's parser reads the answer,
and only in a trajectory that the rollout ended with an answer) against the gold entity name (or
token F1 with
`outcome="f1"`; the other metric is logged with weight 0), plus optional shaping terms: the tag
format and the share of the question's supporting documents that the searches retrieved. With
`shaping_steps > 0` a `ProgressiveSchedule` moves the weight from shaping to the outcome over
that many steps.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Literal, Sequence

from jaxagent.agent.env import OBSERVATION_TEMPLATES, Env, Example, check_shaping_settings
from jaxagent.agent.parsers import XMLTagParser
from jaxagent.agent.trajectory import OBSERVATION, POLICY, Trajectory, data_continuation_ids
from jaxagent.envs import knowledge_base as kb_lib
from jaxagent.rewards import (Component, CompositeReward, FormatConfig, FormatReward,
                              ProgressiveSchedule, RewardInput, RewardOutput, TextMatchReward)
from jaxagent.tools import BM25Index, SearchTool, ToolRegistry

SYSTEM_PROMPT = (
    "You answer questions about a fictional world with the help of a search engine over its "
    "encyclopedia; you cannot know these facts without searching. Reason inside <think> and "
    "</think>. To search, write <search>query</search>; the best matching articles come back "
    "between <information> and </information>. Search for one fact at a time, using the name "
    "of the person, place or organisation. When you know the answer, give just the name inside "
    "<answer> and </answer>, for example <answer>Lusk Works</answer>.")

OBSERVATIONS_KEY = "observations"
_FORMAT = FormatConfig(allowed_tags=("think", "search", "answer"), answer_tag="answer")


class RetrievalHits:
  """Share of the question's supporting documents that appeared in the search results."""

  def __call__(self, inp: RewardInput) -> float:
    titles = inp.metadata.get("supporting_titles")
    if not titles:
      raise KeyError("RetrievalHits needs RewardInput.metadata['supporting_titles']")
    seen = set(_RESULT_TITLE.findall(inp.metadata.get(OBSERVATIONS_KEY, "")))
    return sum(t in seen for t in titles) / len(titles)


class AnswerMatch:
  """`TextMatchReward(metric)` of the `<answer>` block, and 0.0 for a trajectory that the rollout
  ended otherwise than with an answer ("stop_reason" in the metadata; "" = not finished, read as
  before): an answer block put together across turns (`<answer>X <search>q</search>` ran the
  search, then `</answer>` was malformed) was never read as an answer, yet F1 gave it partial
  credit."""

  def __init__(self, metric: Literal["exact_match", "f1"]):
    self._inner = TextMatchReward(metric, fallback=False)

  def __call__(self, inp: RewardInput) -> float:
    if inp.ended_without_answer:
      inp = dataclasses.replace(inp, response_text="")  # no answer read: 0.0, golds still checked
    return self._inner(inp)


# A result line of `format_passages` ("Doc 2 (Title: X): text"), at the start of a line or of
# the observation block: only titles the search returned count, not the same words quoted back
# from the policy's own text inside a line.
_RESULT_TITLE = re.compile(r"^(?:<information>)?Doc \d+ \(Title: (.*?)\): ", re.MULTILINE)


def _search_results(trajectory: Trajectory) -> str:
  """What the retrieval reward reads: the outputs of the trajectory's successful `search`
  calls. An error observation (a malformed call quotes the policy's text back) does not count.
  A turn without a tool outcome (a demonstration's) counts with its observation text."""
  out = []
  for t in trajectory.turns:
    if t.outcome is not None:
      if t.outcome.ok and t.call is not None and t.call.name == "search":
        out.append(t.outcome.output)
    elif t.observation_span is not None:
      out.append(t.observation_text or "")
  return "\n".join(out)


def _check_passages_keep_the_facts(kb: kb_lib.KnowledgeBase, max_chars: int | None) -> None:
  """Raises if cutting passages to `max_chars` drops the fact a hop of some question reads.

  Such a cut leaves questions that no search can answer, and demonstrations that state a fact
  their observation does not show.
  """
  if max_chars is None:
    return
  texts = {d.id: " ".join(d.text.split()).lower() for d in kb.documents}
  needs = []
  for q in (q for split in kb_lib.SPLITS for q in kb.questions[split]):
    for rel, query, found, doc_id in zip(q.relations, q.queries, q.hop_answers, q.supporting_ids):
      fact = kb_lib.hop_fact(rel, query, found).lower()
      at = texts[doc_id].find(fact)
      if at >= 0:
        needs.append(at + len(fact))
  cut = sum(n > max_chars for n in needs)
  if cut:
    raise ValueError(f"SearchQAEnv.max_passage_chars={max_chars} cuts the sentence that answers "
                     f"{cut} of the {len(needs)} question hops out of its passage; set it to at "
                     f"least {max(needs)}")


class SearchQAEnv(Env):
  """Search-R1-style multi-hop QA over a generated knowledge base (see the module docstring).

  Args:
    kb_seed, num_countries, num_cities, num_universities, num_people, num_companies, min_hops,
      max_hops, distractors, train_size, eval_size, sft_size: the knowledge base and its
      questions (`knowledge_base.KBConfig`); hops and distractors set the difficulty.
    data_dir: where the tfds dataset is prepared ("" = `knowledge_base.default_data_dir()`).
    top_k: passages per search.
    max_passage_chars: each passage is cut to this many characters in the observation (None:
      not cut); it must keep the sentence each hop reads from its supporting document (a
      ValueError says the smallest value that does).
    mask_observations: False trains on the retrieved `<information>` tokens too (ablation).
    outcome: "exact_match" or "f1", the outcome reward.
    format_weight, retrieval_weight: weights of the shaping terms (0 = off).
    shaping_steps: steps over which a `ProgressiveSchedule` hands the shaping weight to the
      outcome (0 = fixed weights); `shaping_start` is its alpha at step 0.
  """

  name = "search_qa"
  reward_threads = 4  # the reward components keep no state (text matching over the trajectory)
  observation_template = OBSERVATION_TEMPLATES["information"]

  def __init__(self, *, kb_seed: int = 0, num_countries: int = 8, num_cities: int = 40,
               num_universities: int = 20, num_people: int = 240, num_companies: int = 160,
               min_hops: int = 1, max_hops: int = 3, distractors: int = 1,
               train_size: int = 2000, eval_size: int = 200, sft_size: int = 256,
               data_dir: str = "", top_k: int = 3, max_passage_chars: int = 300,
               mask_observations: bool = True,
               outcome: Literal["exact_match", "f1"] = "exact_match",
               format_weight: float = 0.0, retrieval_weight: float = 0.0,
               shaping_steps: int = 0, shaping_start: float = 0.0):
    if outcome not in ("exact_match", "f1"):
      raise ValueError(f"SearchQAEnv.outcome must be 'exact_match' or 'f1', got {outcome!r}")
    if max_passage_chars is not None and (isinstance(max_passage_chars, bool) or not isinstance(
        max_passage_chars, int) or max_passage_chars < 1):
      # A string failed a comparison after the knowledge base was built ("'>' not supported").
      raise ValueError(f"SearchQAEnv.max_passage_chars must be an int >= 1 or None (passages "
                       f"uncut), got {max_passage_chars!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
      # The search tool refused it as "SearchTool k", a name the env's settings do not have.
      raise ValueError(f"SearchQAEnv.top_k must be an int >= 1 (passages per search), got {top_k!r}")
    check_shaping_settings("SearchQAEnv", format_weight=format_weight,
                           retrieval_weight=retrieval_weight, shaping_steps=shaping_steps,
                           shaping_start=shaping_start)
    # A truthy string ("no", "False" from a text config) kept the masking on: the ablation
    # trained as the default arm, without a word.
    if not isinstance(mask_observations, bool):
      raise ValueError(f"SearchQAEnv.mask_observations must be a bool (False also trains on the "
                       f"retrieved <information> tokens), got {mask_observations!r}")
    self.kb_config = kb_lib.KBConfig(
        seed=kb_seed, num_countries=num_countries, num_cities=num_cities,
        num_universities=num_universities, num_people=num_people, num_companies=num_companies,
        min_hops=min_hops, max_hops=max_hops, distractors=distractors, train_size=train_size,
        eval_size=eval_size, sft_size=sft_size)
    try:
      self.kb = kb_lib.load_kb(self.kb_config, data_dir or None)
    except OSError as e:  # a data_dir under a file, read-only or not creatable: a traceback
      where = data_dir or str(kb_lib.default_data_dir())
      raise ValueError(f"SearchQAEnv: cannot prepare the knowledge base under {where!r} "
                       f"({type(e).__name__}: {e.strerror or e}): set env.kwargs.data_dir (or "
                       "$JAXAGENT_DATA_DIR) to a directory this process can create and write"
                       ) from e
    _check_passages_keep_the_facts(self.kb, max_passage_chars)
    self.index = BM25Index(self.kb.documents)
    self.search_tool = SearchTool(self.index, k=top_k, max_k=max(10, top_k),
                                  max_chars_per_passage=max_passage_chars)
    self.tools = ToolRegistry([self.search_tool])
    self.parser = XMLTagParser({"search": ("search", "query")}, answer_tag="answer")
    self.train_on_observations = not mask_observations
    other = "f1" if outcome == "exact_match" else "exact_match"
    schedule = ProgressiveSchedule(shaping_steps, start=shaping_start) if shaping_steps else None
    self._reward = CompositeReward([
        # Only the <answer> block, the answer the rollout's parser reads (a `\\boxed{}` or
        # `####` guess in a thought or a search query, with no answer given, scores 0).
        Component(outcome, AnswerMatch(outcome), 1.0, role="outcome"),
        Component(other, AnswerMatch(other), 0.0, role="fixed"),  # logged only
        Component("format", FormatReward(_FORMAT), format_weight, role="shaping"),
        Component("retrieval", RetrievalHits(), retrieval_weight, role="shaping"),
    ], schedule=schedule)
    self._cache: dict[str, list[Example]] = {}

  # ------------------------------------------------------------------ data
  def examples(self, split: str) -> Sequence[Example]:
    """"train", "eval" (held-out questions over the same world) or "sft"."""
    if split not in kb_lib.SPLITS:
      raise ValueError(f"unknown split {split!r}; expected one of {list(kb_lib.SPLITS)}")
    if split not in self._cache:
      self._cache[split] = [self.to_example(q) for q in self.kb.questions[split]]
    return self._cache[split]

  @staticmethod
  def to_example(q: kb_lib.Question) -> Example:
    messages = ({"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Question: {q.question}"})
    return Example(id=q.id, prompt=messages, gold=list(q.answers), metadata={
        "hops": q.hops, "relations": list(q.relations), "queries": list(q.queries),
        "hop_answers": list(q.hop_answers), "supporting_ids": list(q.supporting_ids),
        "supporting_titles": list(q.supporting_titles)})

  # ------------------------------------------------------------------ observations
  def encode_observation(self, text: str, tokenizer) -> list[int]:
    # Retrieved text is data: it must never spell the chat template's control tokens.
    return data_continuation_ids(tokenizer, text)

  # ------------------------------------------------------------------ reward
  def reward(self, trajectory: Trajectory, example: Example, tokenizer, step: int) -> RewardOutput:
    meta = {**example.metadata, OBSERVATIONS_KEY: _search_results(trajectory)}
    inp = trajectory.to_reward_input(tokenizer, example.gold, metadata=meta, policy_only=True)
    return self._reward(inp, step=step)

  def is_success(self, out: RewardOutput) -> bool:
    return out.components.get("exact_match", 0.0) >= 1.0

  # ------------------------------------------------------------------ SFT
  def demonstration(self, example: Example):
    """Search each hop's entity by name, state the fact read, answer with the last one."""
    meta = example.metadata
    relations, queries, answers = meta["relations"], meta["queries"], meta["hop_answers"]
    segs: list[tuple[int, str]] = []
    known = ""
    for rel, query, found in zip(relations, queries, answers):
      need = kb_lib.hop_thought(rel, query)
      thought = f"{known} Now I need to find {need}." if known else f"I need to find {need}."
      segs.append((POLICY, f"<think>{thought}</think>\n<search>{query}</search>"))
      segs.append((OBSERVATION, self.format_observation(self.search_tool({"query": query}))))
      fact = kb_lib.hop_fact(rel, query, found)
      known = fact[0].upper() + fact[1:] + "."
    segs.append((POLICY, f"<think>{known}</think>\n<answer>{answers[-1]}</answer>"))
    return segs
