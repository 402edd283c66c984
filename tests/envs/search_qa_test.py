"""search_qa: the generated knowledge base (determinism, tfds ArrayRecord build read back a batch
of records at a time, also without TensorFlow), answerability by BM25, prompt, parsing, EM/F1 and
shaping rewards, demonstrations and the observation-masking switch."""
import json
import pathlib
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

from jaxagent.agent.trajectory import OBSERVATION, POLICY, demonstration_trajectory
from jaxagent.envs import knowledge_base as kb
from jaxagent.envs import make_env
from jaxagent.envs.search_qa import SYSTEM_PROMPT, SearchQAEnv
from jaxagent.tools import BM25Index

SMALL = dict(num_countries=3, num_cities=9, num_universities=4, num_people=24, num_companies=14,
             train_size=30, eval_size=10, sft_size=6)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def env(data_dir):
  return SearchQAEnv(data_dir=str(data_dir), kb_seed=5, max_hops=3, **SMALL)


# ----------------------------------------------------------------------------- knowledge base
def test_world_is_deterministic_in_the_seed():
  cfg = kb.KBConfig(seed=1, **SMALL)
  w1, w2 = kb.generate_world(cfg), kb.generate_world(cfg)
  assert w1.documents == w2.documents
  assert kb.generate_questions(w1, cfg) == kb.generate_questions(w2, cfg)
  w3 = kb.generate_world(kb.KBConfig(seed=2, **SMALL))
  assert [d.title for d in w3.documents] != [d.title for d in w1.documents]
  assert cfg.dataset_name == kb.KBConfig(seed=1, **SMALL).dataset_name != kb.KBConfig(**SMALL).dataset_name


def test_facts_are_stated_in_the_source_documents():
  cfg = kb.KBConfig(seed=3, **SMALL)
  world = kb.generate_world(cfg)
  names = {d.title for d in world.documents}
  assert len(names) == len(world.documents), "entity names are unique"
  for e, doc in zip(world.entities, world.documents):
    assert doc.title == e.name and doc.id == e.doc_id
    for rel, target in e.relations.items():
      assert kb.hop_fact(rel, e.name, world.entities[target].name).lower() in doc.text.lower(), (rel, doc)


def test_distractors_name_every_other_entity_and_confusable_facts_another_city():
  # Distractors capped at all other entities: each document mentions each of them exactly once.
  import re
  cfg = kb.KBConfig(seed=4, distractors=10**6, **SMALL)
  world = kb.generate_world(cfg)
  names = [e.name for e in world.entities]
  for e, doc in zip(world.entities, world.documents):
    x = re.escape(e.name)
    mentioned = [m.group(1) for t in kb._MENTIONS
                 for m in re.finditer(re.escape(t).replace(r"\{x\}", x).replace(r"\{z\}", "(.+?)"),
                                      doc.text)]
    assert sorted(mentioned) == sorted(n for n in names if n != e.name), doc.id
    later = re.search(r"(?:moved to|branch office in) (\w+)\.", doc.text)
    if e.kind in ("person", "company"):
      rel = "birth_city" if e.kind == "person" else "headquarters"
      assert later.group(1) in {names[c] for c in world.by_kind("city")} - {names[e.relations[rel]]}


def test_world_generation_is_linear_in_the_entity_count():
  # Each document listed all other entities (each person and company all other cities) to draw
  # from: these 9360 entities took 5 s, and the time grew with the square of the count.
  import time
  cfg = kb.KBConfig(num_countries=160, num_cities=800, num_universities=400, num_people=4800,
                    num_companies=3200)
  start = time.process_time()  # this process's CPU: other work on the machine does not count
  n = len(kb.generate_world(cfg).documents)
  seconds = time.process_time() - start
  assert n == 9360
  assert seconds < 2.5, f"generating {n} entities took {seconds:.1f} s of CPU"


def test_config_counts_must_be_ints():
  # A float count (e.g. 1e3 from a command line) failed deep in generation with
  # "'float' object cannot be interpreted as an integer"; min_hops=1.0 built a second dataset.
  for bad in (dict(num_people=1e3), dict(min_hops=1.0), dict(max_hops=True), dict(num_cities="9")):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=rf"KBConfig.{name} must be an int, got"):
      kb.KBConfig(**{**SMALL, **bad})
  with pytest.raises(ValueError, match="KBConfig.seed must be an int >= 0, got -1"):
    kb.KBConfig(seed=-1)


def test_questions_split_disjoint_and_balanced():
  cfg = kb.KBConfig(seed=4, min_hops=1, max_hops=4, **SMALL)
  qs = kb.generate_questions(kb.generate_world(cfg), cfg)
  assert {s: len(v) for s, v in qs.items()} == {"eval": 10, "sft": 6, "train": 30}
  all_q = [q for v in qs.values() for q in v]
  assert len({q.question for q in all_q}) == len(all_q)
  hops = [q.hops for q in all_q]
  assert set(hops) == {1, 2, 3, 4} and max(hops.count(h) for h in (1, 2, 3, 4)) - min(
      hops.count(h) for h in (1, 2, 3, 4)) <= 1
  for q in all_q:
    assert q.answers == (q.hop_answers[-1],) and len(q.queries) == len(q.supporting_ids) == q.hops
    assert q.queries[1:] == q.hop_answers[:-1], "each hop searches the entity the last one found"
  with pytest.raises(ValueError, match="distinct questions"):
    big = kb.KBConfig(seed=4, max_hops=1, **{**SMALL, "train_size": 10_000})
    kb.generate_questions(kb.generate_world(big), big)


def test_no_question_names_its_own_answer():
  """'What is the capital of the country where X is located?' with X that capital: 3 of the
  default 200 eval questions (and 2 of 2000 train) had the question's own entity as the gold."""
  cfg = kb.KBConfig()
  qs = kb.generate_questions(kb.generate_world(cfg), cfg)
  assert {s: len(v) for s, v in qs.items()} == {s: getattr(cfg, f"{s}_size") for s in qs}
  for q in (q for v in qs.values() for q in v):
    assert q.answers[0] != q.queries[0] and q.answers[0].lower() not in q.question.lower(), q


@pytest.mark.parametrize("distractors", [0, 1, 3])
def test_gold_answer_is_retrieved_by_the_right_queries(distractors):
  """Every hop's supporting document is in the BM25 top 3 for the hop's query, and the last
  search's results contain the gold answer."""
  cfg = kb.KBConfig(seed=7, max_hops=4, distractors=distractors, **SMALL)
  world = kb.generate_world(cfg)
  index = BM25Index(world.documents)
  for split in kb.generate_questions(world, cfg).values():
    for q in split:
      for query, doc_id in zip(q.queries, q.supporting_ids):
        hits = index.search(query, 3)
        assert doc_id in [h.id for h in hits], (q, query)
      assert any(q.answers[0] in h.text for h in index.search(q.queries[-1], 3)), q
  mentions = sum(d.text.count("confused with") + d.text.count("guidebook") + d.text.count("Visitors")
                 + d.text.count("newspaper") for d in world.documents)
  assert mentions == distractors * len(world.documents)


def test_tfds_build_and_read_back(data_dir):
  cfg = kb.KBConfig(seed=9, **SMALL)
  builder = kb.build_kb(cfg, data_dir)
  assert builder.info.file_format.value == "array_record"
  files = list(pathlib.Path(builder.data_dir).glob("*.array_record*"))
  assert {f.name.split("-")[1].split(".")[0] for f in files} == {"documents", "train", "eval", "sft"}
  sources = builder.as_data_source()
  assert len(sources["documents"]) == len(kb.generate_world(cfg).documents)
  assert len(sources["eval"]) == 10
  loaded = kb.load_kb(cfg, data_dir)
  world = kb.generate_world(cfg)
  assert loaded.documents == world.documents
  assert loaded.questions == kb.generate_questions(world, cfg)
  # A second load reuses the prepared files.
  mtimes = {f: f.stat().st_mtime for f in files}
  kb.load_kb(cfg, data_dir)
  assert {f: f.stat().st_mtime for f in files} == mtimes


def test_each_split_is_read_a_batch_of_records_at_a_time(data_dir, monkeypatch,
                                                           batched_reads):
  """One record a read (grain's MapDataset, item by item) took 1.06 s at the default sizes, a
  batch a read 0.59 s; what is read is unchanged: the generated world and questions, in order."""
  cfg = kb.KBConfig(seed=9, **SMALL)
  source_type = type(kb.build_kb(cfg, data_dir).as_data_source()["train"])
  monkeypatch.setattr(kb, "_READ_BATCH", 4)
  reads = batched_reads(source_type)
  loaded = kb.load_kb(cfg, data_dir)
  world = kb.generate_world(cfg)
  assert loaded.documents == world.documents
  assert loaded.questions == kb.generate_questions(world, cfg)
  sizes = [len(world.documents)] + [SMALL[f"{s}_size"] for s in ("train", "eval", "sft")]
  assert reads == [list(range(start, min(start + 4, n))) for n in sizes
                   for start in range(0, n, 4)]


def test_a_tilde_in_the_data_dir_is_the_home_directory(tmp_path, monkeypatch):
  # "~/kb" (a command line's data_dir=~/kb, a quoted JAXAGENT_DATA_DIR) was a folder named "~"
  # in the working directory.
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.chdir(tmp_path)
  cfg = kb.KBConfig(seed=9, **{**SMALL, "train_size": 2, "eval_size": 1, "sft_size": 1})
  loaded = kb.load_kb(cfg, "~/kb")
  assert loaded.data_dir.is_relative_to(tmp_path / "home" / "kb") and len(loaded.questions["eval"]) == 1
  monkeypatch.setenv("JAXAGENT_DATA_DIR", "~/env")
  assert kb.default_data_dir() == tmp_path / "home" / "env"
  assert not (tmp_path / "~").exists()


def test_a_url_data_dir_is_refused(tmp_path, monkeypatch):
  # pathlib made "gs://bucket/kb" the relative path "gs:/bucket/kb": the dataset was written
  # under a folder named "gs:" in the working directory.
  monkeypatch.chdir(tmp_path)
  cfg = kb.KBConfig(seed=9, **{**SMALL, "train_size": 2, "eval_size": 1, "sft_size": 1})
  with pytest.raises(ValueError, match=r"data_dir must be a local directory, got the URL "
                                       r"'gs://bucket/kb'"):
    kb.load_kb(cfg, "gs://bucket/kb")
  monkeypatch.setenv("JAXAGENT_DATA_DIR", "s3://bucket/kb")
  with pytest.raises(ValueError, match=r"\$JAXAGENT_DATA_DIR must be a local directory"):
    kb.load_kb(cfg)
  assert not list(tmp_path.iterdir())


def test_a_dataset_another_process_prepared_while_this_one_waited_is_read(tmp_path, monkeypatch):
  # The builder was made before taking the lock: when another process had prepared the dataset
  # meanwhile, it found it prepared but knew no splits, and load_kb failed with "has no split
  # 'documents' (has [])" and the advice to delete the directory.
  import contextlib
  cfg = kb.KBConfig(seed=9, **{**SMALL, "train_size": 2, "eval_size": 1, "sft_size": 1})
  lock = kb._file_lock

  @contextlib.contextmanager
  def lock_taken_after_another_process_prepared(path):
    kb.SearchQAKB(config=kb.SearchQAKBConfig(cfg), data_dir=str(tmp_path),
                  file_format="array_record").download_and_prepare()
    with lock(path):
      yield

  monkeypatch.setattr(kb, "_file_lock", lock_taken_after_another_process_prepared)
  loaded = kb.load_kb(cfg, tmp_path)
  assert loaded.documents == kb.generate_world(cfg).documents and len(loaded.questions["train"]) == 2


def test_a_prepared_dataset_is_read_without_the_lock(tmp_path, monkeypatch):
  # The lock was taken to read a prepared dataset too: a data dir that cannot be written (a
  # read-only mount, a file system without locks) failed though nothing had to be written.
  cfg = kb.KBConfig(seed=9, **{**SMALL, "train_size": 2, "eval_size": 1, "sft_size": 1})
  kb.build_kb(cfg, tmp_path)

  def no_lock(path):
    raise PermissionError(f"[Errno 13] Permission denied: '{path}'")

  monkeypatch.setattr(kb, "_file_lock", no_lock)
  loaded = kb.load_kb(cfg, tmp_path)
  assert loaded.documents == kb.generate_world(cfg).documents and len(loaded.questions["train"]) == 2


def test_a_build_leaves_nothing_in_the_temporary_directory(tmp_path, monkeypatch):
  # tfds made an empty directory under the system's temporary directory for every builder of a
  # dataset not prepared yet (to look for its published info), two a fresh knowledge base.
  system_tmp = tmp_path / "system_tmp"
  system_tmp.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
  cfg = kb.KBConfig(seed=9, **{**SMALL, "train_size": 2, "eval_size": 1, "sft_size": 1})
  kb.build_kb(cfg, tmp_path / "data")
  assert kb.load_kb(cfg, tmp_path / "data").questions["train"]
  assert list(system_tmp.iterdir()) == []


def test_a_split_of_size_zero_is_built_and_read_empty(tmp_path):
  """sft_size=0 (RL without a warm start) or eval_size=0 ended the build with tfds's
  AssertionError "Failed to finalize writing of split 'sft': No examples were yielded"."""
  cfg = kb.KBConfig(seed=9, **{**SMALL, "sft_size": 0, "eval_size": 0})
  loaded = kb.load_kb(cfg, tmp_path)
  assert loaded.questions == kb.generate_questions(kb.generate_world(cfg), cfg)
  assert [len(loaded.questions[s]) for s in ("train", "eval", "sft")] == [SMALL["train_size"], 0, 0]
  env = SearchQAEnv(data_dir=str(tmp_path), kb_seed=9, **{**SMALL, "sft_size": 0, "eval_size": 0})
  assert len(env.examples("train")) == SMALL["train_size"] and env.examples("sft") == []


def test_a_damaged_prepared_file_is_named_with_the_fix(tmp_path):
  cfg = kb.KBConfig(seed=9, **SMALL)
  builder = kb.build_kb(cfg, tmp_path)
  (path,) = pathlib.Path(builder.data_dir).glob("*-train.array_record*")
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
  with pytest.raises(ValueError, match=r"cannot read split 'train' of the prepared knowledge "
                     r"base at .*; delete that directory to rebuild it"):
    kb.load_kb(cfg, tmp_path)


def test_a_data_dir_that_cannot_be_written_is_named(tmp_path):
  """A data_dir under a file (or read-only) failed with a NotADirectoryError / PermissionError
  traceback from tfds's locking and writing, through the launcher too."""
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ValueError, match=r"SearchQAEnv: cannot prepare the knowledge base under "
                     r"'.*a_file/kb' \(NotADirectoryError: Not a directory\): set "
                     r"env.kwargs.data_dir \(or \$JAXAGENT_DATA_DIR\)"):
    SearchQAEnv(data_dir=str(tmp_path / "a_file" / "kb"), **SMALL)


def test_a_changed_generator_does_not_read_back_the_old_world(tmp_path, monkeypatch):
  """The prepared dataset was named by the config alone: after an edit of the generator (an
  upgrade), load_kb read back the world the old code wrote, not the one the code generates."""
  import importlib.util
  cfg = kb.KBConfig(seed=9, **SMALL)
  old = kb.load_kb(cfg, tmp_path)
  source = pathlib.Path(kb.__file__).read_text()
  edited = source.replace('"{x} is mentioned in several regional almanacs."',
                          '"{x} is mentioned in a newer almanac."')
  assert edited != source
  path = tmp_path / "edited_knowledge_base.py"
  path.write_text(edited)
  spec = importlib.util.spec_from_file_location("edited_knowledge_base", path)
  new_kb = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, spec.name, new_kb)  # its dataclasses look themselves up
  spec.loader.exec_module(new_kb)
  new_cfg = new_kb.KBConfig(seed=9, **SMALL)
  loaded = new_kb.load_kb(new_cfg, tmp_path)
  assert loaded.documents == new_kb.generate_world(new_cfg).documents != old.documents
  assert kb.load_kb(cfg, tmp_path).documents == old.documents  # each version reads its own


def test_build_and_read_without_tensorflow(tmp_path):
  """tfds writes and reads the ArrayRecord dataset, and grain reads it, with TensorFlow hidden."""
  script = textwrap.dedent(f"""
      import json, sys
      class NoTF:
          def __init__(self, inner): self.inner = inner
          def find_spec(self, name, path=None, target=None):
              if name.split('.')[0] == 'tensorflow':
                  return None
              return self.inner.find_spec(name, path, target)
          def __getattr__(self, attr): return getattr(self.inner, attr)
      sys.meta_path[:] = [NoTF(f) if hasattr(f, 'find_spec') else f for f in sys.meta_path]
      from jaxagent.envs import knowledge_base as kb
      cfg = kb.KBConfig(seed=11, **{SMALL!r})
      k = kb.load_kb(cfg, {str(tmp_path)!r})
      ok = k.questions == kb.generate_questions(kb.generate_world(cfg), cfg)
      print(json.dumps({{"tf": "tensorflow" in sys.modules, "docs": len(k.documents), "same": ok}}))
  """)
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert report == {"tf": False, "docs": 54, "same": True}


# ----------------------------------------------------------------------------- the task
def test_prompt_and_examples(env, smol_tok):
  ex = env.examples("eval")[0]
  q = env.kb.questions["eval"][0]
  assert ex.id == q.id and ex.gold == list(q.answers)
  assert ex.prompt == ({"role": "system", "content": SYSTEM_PROMPT},
                       {"role": "user", "content": f"Question: {q.question}"})
  text = smol_tok.decode(env.render_prompt(ex, smol_tok))
  assert "<search>" in text and q.question in text
  with pytest.raises(ValueError, match="unknown split"):
    env.examples("test")


def test_parser_and_search_tool(env):
  p = env.parser.parse("<think>I need X.</think>\n<search> Kroskbu Stairnci </search>")
  assert p.kind == "tool_call" and p.call.name == "search"
  assert p.call.arguments == {"query": "Kroskbu Stairnci"}
  assert env.parser.parse("<think>done</think><answer>Riampo</answer>").answer == "Riampo"
  q = env.kb.questions["train"][0]
  result = env.tools.get("search")({"query": q.queries[0]})
  obs = env.format_observation(result)
  assert obs.startswith("\n<information>Doc 1 (Title: ") and obs.endswith("</information>\n")
  assert f"(Title: {q.supporting_titles[0]})" in obs
  assert obs.count("Doc ") == 3


def test_passages_keep_the_sentence_each_hop_reads(data_dir, env):
  """A passage cut before a hop's fact leaves a question no search answers and a demonstration
  that states a fact its observation does not show: refused, with the smallest safe value."""
  with pytest.raises(ValueError, match=r"max_passage_chars=60 cuts the sentence that answers \d+ "
                     r"of the \d+ question hops out of its passage; set it to at least \d+"):
    SearchQAEnv(data_dir=str(data_dir), kb_seed=5, max_hops=3, max_passage_chars=60, **SMALL)
  for ex in env.examples("sft"):  # at the default, each hop's observation states its fact
    observations = [t for r, t in env.demonstration(ex) if r == OBSERVATION]
    for obs, rel, query, found in zip(observations, ex.metadata["relations"],
                                      ex.metadata["queries"], ex.metadata["hop_answers"]):
      assert kb.hop_fact(rel, query, found).lower() in obs.lower(), (ex.id, rel)


def test_observation_tokens_never_spell_control_tokens(env, smol_tok):
  ids = env.encode_observation("<information><|im_end|></information>", smol_tok)
  assert smol_tok.encode("<|im_end|>")[0] not in ids


@pytest.mark.parametrize("answer,em,f1", [
    ("Riampo", 1.0, 1.0), ("the riampo", 1.0, 1.0), ("Riampo City", 0.0, 2 / 3), ("Gixwam", 0.0, 0.0)])
def test_reward_em_f1(env, make_traj, char_tok, answer, em, f1):
  ex = SearchQAEnv.to_example(kb.Question("q", "Where?", ("Riampo",), ("country",), ("Treivnaem",),
                                          ("Riampo",), ("city-1",), ("Treivnaem",)))
  out = env.reward(make_traj([(POLICY, f"<think>ok</think>\n<answer>{answer}</answer>")]), ex,
                   char_tok, 0)
  assert out.components["exact_match"] == em and out.components["f1"] == pytest.approx(f1)
  assert out.total == em and env.is_success(out) == bool(em)


@pytest.mark.parametrize("text", [
    "<think>It is \\boxed{Riampo}.</think>",
    "<think>so</think>\n#### Riampo",
    "<search>\\boxed{Riampo}</search>",
])
def test_only_an_answer_the_parser_reads_scores(env, char_tok, text):
  """A guess outside `<answer>` (the parser reads no answer) scored exact match 1 and success."""
  ex = SearchQAEnv.to_example(kb.Question("q", "Where?", ("Riampo",), ("country",), ("Treivnaem",),
                                          ("Riampo",), ("city-1",), ("Treivnaem",)))
  assert env.parser.parse(text).kind != "answer"
  traj = demonstration_trajectory(char_tok.encode("Q"), [(POLICY, text)], char_tok)
  traj.finish("max_tokens_per_turn")
  out = env.reward(traj, ex, char_tok, 0)
  assert out.components["exact_match"] == out.components["f1"] == out.total == 0.0
  assert not env.is_success(out)


@pytest.mark.parametrize("outcome", ["f1", "exact_match"])
def test_an_answer_put_together_across_turns_is_no_answer(data_dir, outcome):
  """Through the real rollout: `<answer>X <search>q</search>` runs the search, `</answer>` is
  then a malformed call and the trajectory ends without an answer (final_answer None), but the
  text holds `<answer>X <search>q</search></answer>`, which F1 scored 2/3 as the outcome."""
  from jaxagent.agent.env import Example
  from jaxagent.agent.rollout import RolloutConfig, rollout
  from tests.agent.rollout_test import EOS, TOK, FakeEngine

  env = SearchQAEnv(data_dir=str(data_dir), kb_seed=5, max_hops=3, outcome=outcome, **SMALL)
  gold = env.examples("train")[0].gold
  ex = Example(id="x", prompt="Q", gold=gold, metadata=env.examples("train")[0].metadata)
  cfg = RolloutConfig(max_turns=4, max_tokens_per_turn=64, tool_timeout_s=20, traj_tool_timeout_s=60)

  def run(turns):
    cache = [TOK.encode(t) for t in turns]
    engine = FakeEngine(lambda rid, t: cache[t] if t < len(cache) else [EOS], slots=1, max_len=2048)
    (traj,) = rollout(engine, None, env, [ex], tokenizer=TOK, num_samples=1, cfg=cfg)
    return traj, env.reward(traj, ex, TOK, 0)

  traj, out = run([f"<answer>{gold[0]} <search>x</search>", "</answer>"])
  assert (traj.stop_reason, traj.final_answer) == ("eos", None)
  assert out.components["f1"] == out.components["exact_match"] == out.total == 0.0
  traj, out = run([f"<search>{gold[0]}</search>", f"<answer>{gold[0]}</answer>"])
  assert (traj.stop_reason, traj.final_answer) == ("answer", gold[0])
  assert out.components["f1"] == out.components["exact_match"] == out.total == 1.0


def test_retrieval_hits_and_progressive_shaping(data_dir, make_traj, char_tok):
  env = SearchQAEnv(data_dir=str(data_dir), kb_seed=5, max_hops=3, outcome="f1",
                    format_weight=0.5, retrieval_weight=0.5, shaping_steps=4, **SMALL)
  ex = SearchQAEnv.to_example(kb.Question("q", "?", ("Riampo",), ("founder", "birth_city"),
                                          ("Bidond Holdings", "Kroskbu Stairnci"),
                                          ("Kroskbu Stairnci", "Riampo"), ("company-1", "person-2"),
                                          ("Bidond Holdings", "Kroskbu Stairnci")))
  segs = [(POLICY, "<think>a</think>\n<search>Bidond Holdings</search>"),
          (OBSERVATION, "\n<information>Doc 1 (Title: Bidond Holdings): founded by ...</information>\n"),
          (POLICY, "<think>b</think>\n<answer>Riampo City</answer>")]
  traj = make_traj(segs)
  for step, alpha in ((0, 0.0), (2, 0.5), (4, 1.0)):
    out = env.reward(traj, ex, char_tok, step)
    assert out.components["retrieval"] == 0.5 and out.components["format"] == 1.0
    assert out.weights["f1"] == pytest.approx(alpha) and out.weights["exact_match"] == 0.0
    assert out.total == pytest.approx(alpha * 2 / 3 + (1 - alpha) * (0.5 + 0.5 * 0.5))
  # An <information> block written by the policy itself breaks the format.
  bad = make_traj([(POLICY, "<information>Riampo</information><answer>Riampo</answer>")])
  assert env.reward(bad, ex, char_tok, 0).components["format"] == 0.0


def test_retrieval_counts_only_titles_the_search_returned(data_dir, make_traj, char_tok):
  from jaxagent.agent.parsers import ToolCall
  from jaxagent.agent.trajectory import ToolOutcome
  env = SearchQAEnv(data_dir=str(data_dir), kb_seed=5, max_hops=3, outcome="f1",
                    retrieval_weight=0.5, **SMALL)
  ex = SearchQAEnv.to_example(kb.Question("q", "?", ("Riampo",), ("founder", "birth_city"),
                                          ("Bidond Holdings", "Kroskbu Stairnci"),
                                          ("Kroskbu Stairnci", "Riampo"), ("company-1", "person-2"),
                                          ("Bidond Holdings", "Kroskbu Stairnci")))
  planted = "Doc 1 (Title: Bidond Holdings): x\nDoc 2 (Title: Kroskbu Stairnci): y"

  def rollout(outcome, call=ToolCall("search", {"query": "q"})):
    traj = make_traj([(POLICY, "<search>q</search>"),
                      (OBSERVATION, f"\n<information>{outcome.output or outcome.error}</information>\n"),
                      (POLICY, "<answer>Riampo</answer>")])
    traj.turns[0].call, traj.turns[0].outcome = call, outcome
    return env.reward(traj, ex, char_tok, 0).components["retrieval"]

  # The policy's own text quoted back by an error observation earns nothing.
  assert rollout(ToolOutcome(ok=False, error=f"malformed call: {planted}"), call=None) == 0.0
  assert rollout(ToolOutcome(ok=False, error=planted)) == 0.0
  # A query echoed by a search without results is not a result line either.
  assert rollout(ToolOutcome(ok=True, output=f"No results found for {planted!r}.")) == 0.0
  assert rollout(ToolOutcome(ok=True, output="Doc 1 (Title: Bidond Holdings): founded")) == 0.5
  assert rollout(ToolOutcome(ok=True, output=planted)) == 1.0


def test_demonstrations_search_each_hop_and_score_one(env, smol_tok):
  for ex in env.examples("sft"):
    segs = env.demonstration(ex)
    searches = [t for r, t in segs if r == POLICY and "<search>" in t]
    assert len(searches) == ex.metadata["hops"]
    for query, text in zip(ex.metadata["queries"], searches):
      assert text.endswith(f"<search>{query}</search>")
    assert segs[-1][1].endswith(f"<answer>{ex.gold[0]}</answer>")
    traj = demonstration_trajectory(env.render_prompt(ex, smol_tok), segs, smol_tok)
    traj.finish("answer")
    out = env.reward(traj, ex, smol_tok, 0)
    assert (out.components["exact_match"], out.components["retrieval"], out.components["format"]) == (
        1.0, 1.0, 1.0)


def test_mask_observations_switch(data_dir, env):
  assert env.train_on_observations is False
  ablation = make_env("search_qa", data_dir=str(data_dir), kb_seed=5, max_hops=3,
                      mask_observations=False, **SMALL)
  assert ablation.train_on_observations is True
  with pytest.raises(ValueError, match="outcome"):
    SearchQAEnv(data_dir=str(data_dir), outcome="bleu", **SMALL)
  # A string from a text config is truthy: "no" kept the masking on and ran the default arm.
  for value in ("no", "False", 0, None):
    with pytest.raises(ValueError, match=rf"SearchQAEnv.mask_observations must be a bool.*{value!r}"):
      make_env("search_qa", data_dir=str(data_dir), mask_observations=value, **SMALL)
  # The reward's checks named its parts ("Component 'retrieval': weight ...",
  # "ProgressiveSchedule.num_steps must be an int >= 1" for shaping_steps=-1, where 0 is off).
  for setting, message in ((dict(retrieval_weight="0.2"), "retrieval_weight must be a finite"),
                           (dict(shaping_steps=-1), r"shaping_steps must be an int >= 0 \(0 = fixed"),
                           (dict(shaping_start=1.5), r"shaping_start must be a number in \[0, 1\]")):
    with pytest.raises(ValueError, match=f"SearchQAEnv.{message}"):
      make_env("search_qa", data_dir=str(data_dir), **setting, **SMALL)
  for value in ("300", 300.0, 0):
    with pytest.raises(ValueError, match=rf"SearchQAEnv.max_passage_chars must be an int >= 1 or "
                       rf"None.*got {value!r}"):
      make_env("search_qa", data_dir=str(data_dir), max_passage_chars=value, **SMALL)
  # The search tool's own check said "SearchTool k must be >= 1", naming no setting.
  for value in (0, -1, 2.5, "3", True):
    with pytest.raises(ValueError, match=rf"SearchQAEnv.top_k must be an int >= 1.*got {value!r}"):
      make_env("search_qa", data_dir=str(data_dir), top_k=value, **SMALL)


def test_unmasked_observations_enter_the_loss_mask(env, smol_tok):
  """With the trainer hook (`Trajectory.to_pack_item(..., observation_loss=True)`), the
  `<information>` tokens of the ablation get loss; by default only the policy's tokens do."""
  ex = env.examples("sft")[0]
  traj = demonstration_trajectory(env.render_prompt(ex, smol_tok), env.demonstration(ex), smol_tok)
  roles = traj.roles
  masked = traj.to_pack_item(1.0).loss_mask
  unmasked = traj.to_pack_item(1.0, observation_loss=True).loss_mask
  assert (masked == (roles == POLICY)).all()
  assert (unmasked == ((roles == POLICY) | (roles == OBSERVATION))).all()
  assert (roles == OBSERVATION).sum() > 0
  # Observation tokens were never sampled: their old log-probs are left for the trainer.
  old = traj.to_pack_item(1.0, observation_loss=True).old_logps
  assert np.isnan(old[roles == OBSERVATION]).all() and not np.isnan(old[roles != OBSERVATION]).any()
