"""Multi-hop question answering with a search engine (Search-R1 style), over a generated world.

The questions and documents come from `envs/knowledge_base.py`: fictional people, cities,
countries, universities and companies, stored as a tfds ArrayRecord dataset and read back from
its data source. No model can know these facts, so it has to search for them.

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

Your own corpus and questions: `corpus_file` (JSONL, ArrayRecord or Parquet of `{"title", "text",
"id"?}` records, other keys ignored, or Search-R1's `{"id", "contents"}`:
`problem_file.read_documents`)
replaces the generated documents as what the search tool indexes, and
`train_file` / `eval_file` (JSON records `{"question": ..., "answers": [...]}`, or "answer" /
"golden_answers", a string or a list of accepted answers; `jaxagent/envs/problem_file.py`) the
generated questions; the three go together (the generated questions are about a world your
corpus does not describe). The prompt then speaks of "a collection of documents". The "sft"
split keeps the generated world's demonstrations (they teach the tags and the search-then-answer
pattern, searching that world's documents, not yours), under the same system prompt; with
`sft_size=0` it is empty and no world is generated. Retrieval shaping needs each question's
gold documents: `titles_key` names the record key that lists their titles (a list of titles, or
HotpotQA's `supporting_facts`, `[[title, sentence], ...]`), each of which must be a corpus
title; without it `retrieval_weight` must be 0 (an error says so) and `reward/retrieval` is not
logged.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Literal, Sequence

from jaxagent.agent.env import (OBSERVATION_TEMPLATES, Env, Example, NoSplitError,
                                check_shaping_settings)
from jaxagent.agent.parsers import XMLTagParser
from jaxagent.agent.trajectory import OBSERVATION, POLICY, Trajectory, data_continuation_ids
from jaxagent.envs import knowledge_base as kb_lib
from jaxagent.envs.problem_file import (MISSING, lookup, raise_bad_records, read_documents,
                                        read_problems, resolve_problem_file)
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

# The prompt with a corpus of your own (`corpus_file`), for every split.
CORPUS_SYSTEM_PROMPT = (
    "You answer questions with the help of a search engine over a collection of documents. "
    "Reason inside <think> and </think>. To search, write <search>query</search>; the best "
    "matching documents come back between <information> and </information>. Search for one "
    "fact at a time, as often as you need. When you know the answer, give just the answer "
    "inside <answer> and </answer>, for example <answer>Lusk Works</answer>.")
# The answer keys tried in turn when `answer_key` is "" (NQ / HotpotQA / FlashRAG files).
DEFAULT_ANSWER_KEYS = ("answers", "answer", "golden_answers")

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


def _one_line(title: str) -> str:
  """A title as a search result line shows it (white space collapsed)."""
  line = " ".join(title.split())
  return title if line == title else line  # the title itself: a corpus's titles not copied


def _gold_titles(record: dict, key: str, where: str, corpus: set[str]) -> list[str]:
  """The gold document titles of a question record: `record[key]`, a list of titles or of
  `[title, ...]` lists (HotpotQA's supporting facts), or `{"title": [...], ...}` (the same as
  the Hugging Face hotpot_qa dataset writes them), each a title of the corpus; a dotted key reads
  inside an object ("extra_info.supporting_facts")."""
  value = lookup(record, key)
  if value is MISSING:
    last = key.rsplit(".", 1)[-1]
    inside = [k for k in _key_paths(record) if k.rsplit(".", 1)[-1] == last and k != key][:1]
    raise ValueError(f"{where}: no {key!r} key (SearchQAEnv.titles_key); the record has "
                     f"{sorted(map(str, record))}"
                     + (f"; did you mean {inside[0]!r}? (set SearchQAEnv.titles_key="
                        f"{inside[0]!r})" if inside else ""))
  if isinstance(value, dict):
    if "title" not in value:
      raise ValueError(f"{where}: {key!r} is an object without a 'title' list (it has "
                       f"{sorted(map(str, value))})")
    value = value["title"]
  items = value if isinstance(value, list) else [value]
  titles: list[str] = []
  for item in items:
    title = item[0] if isinstance(item, list) and item else item
    if not isinstance(title, str) or not title.strip():
      raise ValueError(f"{where}: {key!r} must list titles (text), [title, ...] lists or be "
                       f"{{\"title\": [...]}}, got "
                       f"{value!r:.80}")
    if _one_line(title) not in titles:
      titles.append(_one_line(title))
  if not titles:
    raise ValueError(f"{where}: {key!r} lists no titles")
  missing = [t for t in titles if t not in corpus]
  if missing:
    raise ValueError(f"{where}: gold title(s) {missing!r:.120} are no document's title in "
                     "corpus_file, so no search could retrieve them")
  return titles


def _key_paths(record: dict, prefix: str = ""):
  """Every (dotted) key of `record`, the keys inside its objects included."""
  for k, v in record.items():
    yield f"{prefix}{k}"
    if isinstance(v, dict):
      yield from _key_paths(v, f"{prefix}{k}.")


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
    corpus_file: your own documents ("" = the generated ones), a JSONL, ArrayRecord or Parquet
      file of `{"title", "text", "id"?}` records, other keys ignored (or `{"id", "contents"}`,
      the first line of the contents its title); needs `train_file` and `eval_file`.
    train_file, eval_file: your own questions for the train / eval split (each file setting
      may be a glob pattern of a split's shards, `train-*.parquet`), every record in file
      order (`train_size` / `eval_size` then do not apply; the trainer evaluates on the first
      `eval.size`); need `corpus_file`.
    question_key, answer_key: the question files' keys of the question and of its answer(s)
      ("" = the first of "answers", "answer", "golden_answers" a record has; a dotted key reads
      inside an object: "answers.text" for SQuAD, "answer.aliases" for TriviaQA).
    titles_key: the question files' key listing each question's gold document titles (a list
      of titles, or `[[title, ...], ...]` as HotpotQA's "supporting_facts"; a dotted key reads
      inside an object), for the retrieval reward ("" = none: `retrieval_weight` must be 0 and the reward is not logged).
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
               shaping_steps: int = 0, shaping_start: float = 0.0, corpus_file: str = "",
               train_file: str = "", eval_file: str = "", question_key: str = "question",
               answer_key: str = "", titles_key: str = ""):
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
    resolved = self._check_file_settings(corpus_file, train_file, eval_file, question_key,
                                         answer_key, titles_key, retrieval_weight)
    # A glob pattern's files listed (and checked) once, here: exactly these are read.
    self._file_lists = {k: files for k, (_, files) in resolved.items()}
    files = {k: str(path) for k, (path, _) in resolved.items()}
    self.corpus_file = files.pop("corpus", "")
    self._files = files  # split -> question file
    self.question_key, self.titles_key = question_key, titles_key
    self.answer_keys = (answer_key,) if answer_key else DEFAULT_ANSWER_KEYS
    self.system_prompt = CORPUS_SYSTEM_PROMPT if self.corpus_file else SYSTEM_PROMPT
    # With your corpus, the generated world is only the sft split's demonstrations.
    self.kb_config = kb_lib.KBConfig(
        seed=kb_seed, num_countries=num_countries, num_cities=num_cities,
        num_universities=num_universities, num_people=num_people, num_companies=num_companies,
        min_hops=min_hops, max_hops=max_hops, distractors=distractors,
        train_size=0 if self.corpus_file else train_size,
        eval_size=0 if self.corpus_file else eval_size, sft_size=sft_size)
    self.kb: kb_lib.KnowledgeBase | None = None
    if not self.corpus_file or sft_size:
      try:
        self.kb = kb_lib.load_kb(self.kb_config, data_dir or None)
      except OSError as e:  # a data_dir under a file, read-only or not creatable: a traceback
        where = data_dir or str(kb_lib.default_data_dir())
        raise ValueError(f"SearchQAEnv: cannot prepare the knowledge base under {where!r} "
                         f"({type(e).__name__}: {e.strerror or e}): set env.kwargs.data_dir (or "
                         "$JAXAGENT_DATA_DIR) to a directory this process can create and write"
                         ) from e
      try:
        _check_passages_keep_the_facts(self.kb, max_passage_chars)
      except ValueError as e:
        if not self.corpus_file:
          raise
        raise ValueError(f"{e} (with corpus_file, this is about the sft split's demonstrations "
                         "over the generated world; sft_size=0 drops them)") from None
    documents = (read_documents(self.corpus_file, owner="SearchQAEnv",
                                files=self._file_lists["corpus"]) if self.corpus_file
                 else self.kb.documents)
    self.index = BM25Index(documents)
    self.search_tool = SearchTool(self.index, k=top_k, max_k=max(10, top_k),
                                  max_chars_per_passage=max_passage_chars)
    # What the demonstrations search: the generated world's documents, also with your corpus.
    self._demo_search = self.search_tool
    if self.corpus_file and self.kb is not None:
      self._demo_search = SearchTool(BM25Index(self.kb.documents), k=top_k, max_k=max(10, top_k),
                                     max_chars_per_passage=max_passage_chars)
    self.tools = ToolRegistry([self.search_tool])
    self.parser = XMLTagParser({"search": ("search", "query")}, answer_tag="answer")
    self.train_on_observations = not mask_observations
    other = "f1" if outcome == "exact_match" else "exact_match"
    schedule = ProgressiveSchedule(shaping_steps, start=shaping_start) if shaping_steps else None
    components = [
        # Only the <answer> block, the answer the rollout's parser reads (a `\\boxed{}` or
        # `####` guess in a thought or a search query, with no answer given, scores 0).
        Component(outcome, AnswerMatch(outcome), 1.0, role="outcome"),
        Component(other, AnswerMatch(other), 0.0, role="fixed"),  # logged only
        Component("format", FormatReward(_FORMAT), format_weight, role="shaping"),
    ]
    # Your questions without gold titles have nothing to score retrieval against: the
    # component is left out (retrieval_weight is 0, checked above), not logged as 0.
    if not self.corpus_file or titles_key:
      components.append(Component("retrieval", RetrievalHits(), retrieval_weight,
                                  role="shaping"))
    self._reward = CompositeReward(components, schedule=schedule)
    self._cache: dict[str, list[Example]] = {}
    self._titles: set[str] | None = None  # _corpus_titles

  @staticmethod
  def _check_file_settings(corpus_file, train_file, eval_file, question_key, answer_key,
                           titles_key, retrieval_weight) -> dict[str, tuple]:
    """The checked path and files (`resolve_problem_file`) of each set file ("corpus", "train",
    "eval"), or a ValueError."""
    for field, value in (("corpus_file", corpus_file), ("train_file", train_file),
                         ("eval_file", eval_file), ("answer_key", answer_key),
                         ("titles_key", titles_key)):
      if not isinstance(value, str):
        raise ValueError(f"SearchQAEnv.{field} must be a str (\"\" = not set), got {value!r}")
    if not isinstance(question_key, str) or not question_key:
      raise ValueError(f"SearchQAEnv.question_key must be a non-empty str (a record's key), got "
                       f"{question_key!r}")
    if question_key in ((answer_key,) if answer_key else DEFAULT_ANSWER_KEYS) + (titles_key,):
      raise ValueError(f"SearchQAEnv.question_key={question_key!r} is also the answer_key or "
                       "titles_key; the keys must differ")
    questions = {s: f for s, f in (("train", train_file), ("eval", eval_file)) if f}
    if corpus_file and len(questions) < 2:
      missing = " and ".join(f"{s}_file" for s in ("train", "eval") if s not in questions)
      raise ValueError(f"SearchQAEnv.corpus_file={corpus_file!r} replaces the generated knowledge "
                       f"base, whose questions your corpus cannot answer: set {missing} too (a "
                       "JSONL, ArrayRecord or Parquet file of {\"question\": ..., \"answers\": [...]} "
                       "records)")
    if questions and not corpus_file:
      set_ = ", ".join(f"{s}_file" for s in questions)
      raise ValueError(f"SearchQAEnv.{set_} need{'s' if len(questions) == 1 else ''} "
                       "corpus_file: your questions are searched in "
                       "your documents (the generated knowledge base is a fictional world); set "
                       "corpus_file to a JSONL, ArrayRecord or Parquet file of {\"title\": ..., "
                       "\"text\": ...} records")
    if titles_key and not corpus_file:
      raise ValueError(f"SearchQAEnv.titles_key={titles_key!r} reads your question files; "
                       "set corpus_file, train_file and eval_file (or leave titles_key \"\")")
    if corpus_file and not titles_key and retrieval_weight != 0:
      raise ValueError(f"SearchQAEnv.retrieval_weight={retrieval_weight!r} scores the searches by "
                       "the gold documents they retrieved, and your question files give none: "
                       "set SearchQAEnv.titles_key to the record key listing each question's "
                       "gold document titles (e.g. HotpotQA's 'supporting_facts'), or "
                       "retrieval_weight=0")
    out = {s: resolve_problem_file(f, f"SearchQAEnv.{s}_file") for s, f in questions.items()}
    if corpus_file:
      out["corpus"] = resolve_problem_file(corpus_file, "SearchQAEnv.corpus_file")
    return out

  # ------------------------------------------------------------------ data
  def examples(self, split: str) -> Sequence[Example]:
    """"train", "eval" (held-out questions over the same world, or your files') or "sft"."""
    if split not in kb_lib.SPLITS:
      raise NoSplitError(f"unknown split {split!r}; expected one of {list(kb_lib.SPLITS)}",
                         split=split)
    if split not in self._cache:
      if split in self._files:
        self._cache[split] = self._from_file(split)
      else:
        questions = self.kb.questions[split] if self.kb is not None else []
        self._cache[split] = [self.to_example(q, self.system_prompt) for q in questions]
    return self._cache[split]

  def _from_file(self, split: str) -> list[Example]:
    probs = read_problems(self._files[split], question_key=self.question_key,
                          answer_key=self.answer_keys, owner="SearchQAEnv",
                          setting=f"{split}_file", gsm8k_answers=False,
                          files=self._file_lists[split],
                          record_keys=(self.titles_key,) if self.titles_key else (),
                          required_keys={self.titles_key: "titles_key"} if self.titles_key
                          else None)
    titles: list[list[str]] = [[] for _ in probs]
    if self.titles_key:
      corpus = self._corpus_titles()
      bad = []
      for i, p in enumerate(probs):
        try:
          titles[i] = _gold_titles(p.record, self.titles_key, p.where, corpus)
        except ValueError as e:
          bad.append(str(e))
      raise_bad_records(bad, len(probs), f"SearchQAEnv.{split}_file={self._files[split]!r} "
                        f"(titles_key={self.titles_key!r})")
    out = []
    for p, gold_titles in zip(probs, titles):
      meta = {"where": p.where}
      if self.titles_key:
        meta["supporting_titles"] = gold_titles
      out.append(Example(id=f"{split}-file-{p.key}", prompt=(
          {"role": "system", "content": self.system_prompt},
          {"role": "user", "content": f"Question: {p.question}"}),
          gold=[p.gold] if isinstance(p.gold, str) else list(p.gold), metadata=meta))
    return out

  def _corpus_titles(self) -> set[str]:
    """The corpus's titles as search results show them, built once for both question files."""
    if self._titles is None:
      self._titles = {_one_line(d.title) for d in self.index.documents}
    return self._titles

  @staticmethod
  def to_example(q: kb_lib.Question, system_prompt: str = SYSTEM_PROMPT) -> Example:
    messages = ({"role": "system", "content": system_prompt},
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
    """Search each hop's entity by name, state the fact read, answer with the last one (of the
    generated world's questions; a question of your files has no demonstration)."""
    meta = example.metadata
    if "relations" not in meta:
      return None
    relations, queries, answers = meta["relations"], meta["queries"], meta["hop_answers"]
    segs: list[tuple[int, str]] = []
    known = ""
    for rel, query, found in zip(relations, queries, answers):
      need = kb_lib.hop_thought(rel, query)
      thought = f"{known} Now I need to find {need}." if known else f"I need to find {need}."
      segs.append((POLICY, f"<think>{thought}</think>\n<search>{query}</search>"))
      segs.append((OBSERVATION, self.format_observation(self._demo_search({"query": query}))))
      fact = kb_lib.hop_fact(rel, query, found)
      known = fact[0].upper() + fact[1:] + "."
    segs.append((POLICY, f"<think>{known}</think>\n<answer>{answers[-1]}</answer>"))
    return segs
