"""search_qa on your own data: a corpus file and question files (JSONL / ArrayRecord / Parquet) in place
of the generated knowledge base, the sft split's demonstrations, the retrieval reward from a
titles key, and every bad setting or record named."""
import json
import re

import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from jaxagent.agent.trajectory import OBSERVATION, POLICY, demonstration_trajectory
from jaxagent.envs.search_qa import CORPUS_SYSTEM_PROMPT, SYSTEM_PROMPT, SearchQAEnv

SMALL = dict(num_countries=3, num_cities=9, num_universities=4, num_people=24, num_companies=14,
             train_size=30, eval_size=10, sft_size=6)
CORPUS = [
    {"title": "Ada Lovelace", "text": "Ada Lovelace wrote the first published algorithm."},
    {"title": "Analytical Engine", "text": "Charles Babbage designed the Analytical Engine."},
    {"title": "Charles Babbage", "text": "Charles Babbage was born in London in 1791.",
     "id": "cb"},
]
TRAIN = [
    {"question": "Who designed the Analytical Engine?", "answers": ["Charles Babbage", "Babbage"],
     "supporting_facts": [["Analytical Engine", 0]]},
    {"question": "In which year was Charles Babbage born?", "answers": [1791],
     "supporting_facts": [["Charles Babbage", 0], ["Charles Babbage", 0]]},
]
EVAL = [{"question": "Where was the designer of the Analytical Engine born?",
         "answer": "London", "supporting_facts": [["Analytical Engine", 0],
                                                  ["Charles  Babbage", 0]]}]


def write_jsonl(path, records):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return str(path)


def write_array_record(path, records):
  writer = ArrayRecordWriter(str(path), "group_size:1")
  for r in records:
    writer.write(json.dumps(r).encode())
  writer.close()
  return str(path)


@pytest.fixture
def files(tmp_path):
  return dict(corpus_file=write_jsonl(tmp_path / "wiki.jsonl", CORPUS),
              train_file=write_jsonl(tmp_path / "nq_train.jsonl", TRAIN),
              eval_file=write_array_record(tmp_path / "nq_dev.array_record", EVAL))


def answer(env, ex, tok, text, search=None):
  segs = []
  if search is not None:
    segs = [(POLICY, f"<search>{search}</search>"),
            (OBSERVATION, env.format_observation(env.search_tool({"query": search})))]
  traj = demonstration_trajectory(tok.encode("Q"), segs + [(POLICY, f"<answer>{text}</answer>")],
                                  tok)
  traj.finish("answer")
  return env.reward(traj, ex, tok, 0)


def test_own_corpus_and_questions_replace_the_generated_world(tmp_path, files, char_tok):
  data_dir = tmp_path / "tfds"
  env = SearchQAEnv(data_dir=str(data_dir), **{**SMALL, "sft_size": 0}, **files)
  assert env.kb is None and not data_dir.exists()  # no world generated for an empty sft split
  assert [d.title for d in env.index.documents] == [d["title"] for d in CORPUS]
  assert [d.id for d in env.index.documents] == ["0", "1", "cb"]
  train, ev = env.examples("train"), env.examples("eval")
  assert [(e.id, e.prompt[1]["content"], e.gold) for e in train] == [
      ("train-file-1", "Question: Who designed the Analytical Engine?",
       ["Charles Babbage", "Babbage"]),
      ("train-file-2", "Question: In which year was Charles Babbage born?", ["1791"])]
  assert (ev[0].id, ev[0].gold) == ("eval-file-0", ["London"])
  assert all(e.prompt[0]["content"] == CORPUS_SYSTEM_PROMPT for e in train + list(ev))
  assert env.examples("sft") == []
  # The search tool reads your corpus.
  assert "(Title: Charles Babbage): Charles Babbage was born in London" in env.search_tool(
      {"query": "Babbage born"}).output
  out = answer(env, train[0], char_tok, "Babbage")
  assert out.components["exact_match"] == 1.0 and env.is_success(out)
  assert answer(env, ev[0], char_tok, "Paris").components["exact_match"] == 0.0
  # No gold titles given: no retrieval term, rather than a retrieval score of 0.
  assert "retrieval" not in out.components


def test_sft_split_keeps_the_generated_demonstrations(tmp_path, files, smol_tok):
  env = SearchQAEnv(data_dir=str(tmp_path / "tfds"), kb_seed=5, **SMALL, **files)
  assert env.kb is not None and env.kb.questions["train"] == env.kb.questions["eval"] == []
  sft = env.examples("sft")
  assert len(sft) == SMALL["sft_size"]
  world_titles = {d.title for d in env.kb.documents}
  for ex in sft:
    assert ex.prompt[0]["content"] == CORPUS_SYSTEM_PROMPT  # the prompt RL sees
    segs = env.demonstration(ex)
    obs = [t for r, t in segs if r == OBSERVATION]
    # Searched in the generated world (your corpus does not hold its facts).
    assert obs and all(any(f"(Title: {t})" in o for t in world_titles) for o in obs)
    traj = demonstration_trajectory(env.render_prompt(ex, smol_tok), segs, smol_tok)
    traj.finish("answer")
    assert env.reward(traj, ex, smol_tok, 0).components["exact_match"] == 1.0
  # A passage cut that drops the demonstrations' facts is named as theirs.
  with pytest.raises(ValueError, match=r"SearchQAEnv.max_passage_chars=40 cuts the sentence .* "
                                       r"\(with corpus_file, this is about the sft split's "
                                       r"demonstrations .* sft_size=0 drops them\)"):
    SearchQAEnv(data_dir=str(tmp_path / "tfds"), kb_seed=5, max_passage_chars=40, **SMALL, **files)
  assert SearchQAEnv(data_dir=str(tmp_path / "tfds"), max_passage_chars=40,
                     **{**SMALL, "sft_size": 0}, **files).search_tool.max_chars_per_passage == 40
  # A question of your files has no demonstration.
  assert env.demonstration(env.examples("train")[0]) is None
  # Without your files the generated world's prompt, as before.
  plain = SearchQAEnv(data_dir=str(tmp_path / "tfds"), kb_seed=5, **SMALL)
  assert plain.examples("sft")[0].prompt[0]["content"] == SYSTEM_PROMPT


def test_titles_key_gives_the_retrieval_reward(tmp_path, files, char_tok):
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **files,
                    titles_key="supporting_facts", retrieval_weight=0.5)
  train, (ev,) = env.examples("train"), env.examples("eval")
  # HotpotQA [title, sentence] pairs give their titles, once each, white space collapsed.
  assert train[1].metadata["supporting_titles"] == ["Charles Babbage"]
  assert ev.metadata["supporting_titles"] == ["Analytical Engine", "Charles Babbage"]
  assert answer(env, ev, char_tok, "London").components["retrieval"] == 0.0
  out = answer(env, ev, char_tok, "London", search="Analytical Engine designed")
  assert out.components["retrieval"] == 0.5 and out.total == pytest.approx(1.25)
  # A list of plain titles works too.
  titles = write_jsonl(tmp_path / "t.jsonl", [{"question": "Who?", "answer": "Ada",
                                               "gold": ["Ada Lovelace"]}])
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **{
      **files, "train_file": titles}, titles_key="gold")
  assert env.examples("train")[0].metadata["supporting_titles"] == ["Ada Lovelace"]
  # Hugging Face's hotpot_qa writes supporting_facts as {"title": [...], "sent_id": [...]}.
  hf = write_jsonl(tmp_path / "hf.jsonl", [{"question": "Who?", "answer": "Ada", "supporting_facts":
                                            {"title": ["Ada Lovelace", "Charles Babbage"],
                                             "sent_id": [0, 0]}}])
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **{
      **files, "train_file": hf}, titles_key="supporting_facts")
  assert env.examples("train")[0].metadata["supporting_titles"] == ["Ada Lovelace",
                                                                    "Charles Babbage"]
  # A dotted key reads inside an object (a verl-style row keeps them in extra_info).
  nested = write_jsonl(tmp_path / "nested.jsonl", [{"question": "Who?", "answer": "Ada", "extra_info": {
      "index": 0, "supporting_facts": [["Ada Lovelace", 0]]}}])
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **{
      **files, "train_file": nested}, titles_key="extra_info.supporting_facts")
  assert env.examples("train")[0].metadata["supporting_titles"] == ["Ada Lovelace"]
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **{
      **files, "train_file": nested}, titles_key="supporting_facts")
  with pytest.raises(ValueError, match=re.escape(
      "nested.jsonl line 1: no 'supporting_facts' key (SearchQAEnv.titles_key); the record has "
      "['answer', 'extra_info', 'question']; did you mean 'extra_info.supporting_facts'? (set "
      "SearchQAEnv.titles_key='extra_info.supporting_facts')")):
    env.examples("train")
  # The same from a Parquet file, which is read only in the question, answer and titles
  # columns: the columns not read (extra_info here) still give the hint.
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist([{"question": "Who?", "answer": "Ada", "extra_info": {
      "index": 0, "supporting_facts": [["Ada Lovelace", "0"]]}}]), str(tmp_path / "nested.parquet"))
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **{
      **files, "train_file": str(tmp_path / "nested.parquet")}, titles_key="supporting_facts")
  # No column holds the key: one error for the file, from its columns, before a row is read.
  with pytest.raises(ValueError, match=re.escape(
      f"SearchQAEnv.train_file={str(tmp_path / 'nested.parquet')!r}: no record can have a "
      "'supporting_facts' key (SearchQAEnv.titles_key), the file has no such column: the file's "
      "columns are ['answer', 'extra_info', 'question']; did you mean "
      "'extra_info.supporting_facts'? (set SearchQAEnv.titles_key='extra_info.supporting_facts')")):
    env.examples("train")


def test_titles_no_search_can_retrieve_are_named(tmp_path, files):
  bad = write_jsonl(tmp_path / "bad.jsonl", [
      TRAIN[0], {"question": "Q?", "answers": ["a"], "supporting_facts": [["Babbage", 0]]},
      {"question": "R?", "answers": ["b"]},
      {"question": "S?", "answers": ["c"], "supporting_facts": [[3, 0]]}])
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0},
                    **{**files, "train_file": bad}, titles_key="supporting_facts")
  with pytest.raises(ValueError) as e:
    env.examples("train")
  msg = str(e.value)
  assert "SearchQAEnv.train_file=" in msg and "3 bad records (of 4)" in msg
  assert "bad.jsonl line 2: gold title(s) ['Babbage'] are no document's title in corpus_file" in msg
  assert ("bad.jsonl line 3: no 'supporting_facts' key (SearchQAEnv.titles_key); the record "
          "has ['answers', 'question']") in msg
  assert "bad.jsonl line 4: 'supporting_facts' must list titles" in msg


def test_question_file_keys_and_bad_records(tmp_path, files):
  # "####" is text here, not a GSM8K marker; a custom answer key.
  own = write_jsonl(tmp_path / "own.jsonl", [{"query": "Tag?", "target": "C#### sharp"}])
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0},
                    **{**files, "train_file": own}, question_key="query", answer_key="target")
  assert env.examples("train")[0].gold == ["C#### sharp"]
  # FlashRAG's key is among the defaults; a misspelt one is named with its fix.
  flash = write_jsonl(tmp_path / "flash.jsonl", [{"question": "Who?", "golden_answers": ["Ada"]},
                                                 {"question": "Who?", "answerz": ["Ada"]},
                                                 {"question": "Who?", "answers": []}])
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0},
                    **{**files, "train_file": flash})
  with pytest.raises(ValueError) as e:
    env.examples("train")
  msg = str(e.value)
  assert "2 bad records (of 3)" in msg
  assert ("flash.jsonl line 2: no 'answers' / 'answer' / 'golden_answers' key "
          "(SearchQAEnv.answer_key); the record has ['answerz', 'question']; did you mean "
          "'answerz'? (set SearchQAEnv.answer_key='answerz')") in msg
  assert "flash.jsonl line 3: the answer ('answers') is an empty list" in msg


def test_dotted_answer_keys_read_squad_and_triviaqa_records(tmp_path, files):
  squad = write_jsonl(tmp_path / "squad.jsonl", [
      {"question": "Who wrote it?", "answers": {"text": ["Ada", "Ada Lovelace"],
                                                "answer_start": [0, 0]}}])
  trivia = write_jsonl(tmp_path / "trivia.jsonl", [
      {"question": "Who?", "answer": {"value": "Ada", "aliases": ["Ada", "Countess Lovelace"]}}])
  # Left to the default keys, a nested answer is named with the dotted key that reads it.
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **{**files, "train_file": squad})
  with pytest.raises(ValueError, match=re.escape(
      "squad.jsonl line 1: the answer ('answers') must be a number, text or a list of them, got "
      "dict with keys ['answer_start', 'text']; a dotted SearchQAEnv.answer_key reads inside it, "
      "e.g. 'answers.text'")):
    env.examples("train")
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0},
                    **{**files, "train_file": squad, "eval_file": trivia}, answer_key="answers.text")
  assert env.examples("train")[0].gold == ["Ada", "Ada Lovelace"]
  with pytest.raises(ValueError, match=re.escape(
      "trivia.jsonl line 1: no 'answers.text' key (SearchQAEnv.answer_key); the record has "
      "['answer', 'question']; did you mean 'answer'?")):
    env.examples("eval")
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0},
                    **{**files, "train_file": trivia}, answer_key="answer.alias")
  with pytest.raises(ValueError, match=re.escape(
      "no 'answer.alias' key (SearchQAEnv.answer_key); the record's 'answer' has ['aliases', "
      "'value']; did you mean 'answer.aliases'? (set SearchQAEnv.answer_key='answer.aliases')")):
    env.examples("train")


def test_bad_corpus_records_are_named(tmp_path, files):
  corpus = write_jsonl(tmp_path / "wiki.jsonl", [
      CORPUS[0], {"title": "No text"}, "not json", {"titel": "T", "text": "x", "url": "u"},
      {"title": "A", "text": "a", "id": "cb"}, {"title": "B", "text": "b", "id": "cb"},
      {"title": 5, "text": "t"}])
  with pytest.raises(ValueError) as e:
    SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **{**files, "corpus_file": corpus})
  msg = str(e.value)
  assert "SearchQAEnv.corpus_file=" in msg and "5 bad records (of 7)" in msg
  assert "wiki.jsonl line 2: has no 'text' field (fields: ['title'])" in msg
  assert "wiki.jsonl line 3: not JSON" in msg
  assert ("wiki.jsonl line 4: 'titel' looks like a misspelt 'title': rename it (fields: "
          "['text', 'titel', 'url']; fields other than title, text and id are ignored)") in msg
  assert "wiki.jsonl line 6: the id 'cb' is the id of wiki.jsonl line 5 too" in msg
  assert "wiki.jsonl line 7: title and text must be strings" in msg
  empty = write_jsonl(tmp_path / "empty.jsonl", [])
  with pytest.raises(ValueError, match="SearchQAEnv.corpus_file=.*holds no documents"):
    SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **{**files, "corpus_file": empty})
  # Search-R1's / FlashRAG's {"id", "contents": "\"Title\"\ntext"} records.
  flash = write_jsonl(tmp_path / "wiki-18.jsonl", [
      {"id": "0", "contents": '"Ada Lovelace"\nAda Lovelace wrote the first algorithm.'},
      {"id": "1", "contents": "Plain title\nline one\nline two"}])
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **{**files, "corpus_file": flash})
  assert [(d.id, d.title, d.text) for d in env.index.documents] == [
      ("0", "Ada Lovelace", "Ada Lovelace wrote the first algorithm."),
      ("1", "Plain title", "line one\nline two")]
  assert "(Title: Ada Lovelace): Ada Lovelace wrote" in env.search_tool({"query": "algorithm"}).output
  # An ArrayRecord corpus reads the same.
  ar = write_array_record(tmp_path / "wiki.array_record", CORPUS)
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **{**files, "corpus_file": ar})
  assert [d.id for d in env.index.documents] == ["0", "1", "cb"]


@pytest.mark.parametrize("settings, message", [
    (dict(train_file=None), r"SearchQAEnv.corpus_file=.* replaces the generated knowledge base.*"
                            r"set train_file too"),
    (dict(train_file=None, eval_file=None), r"set train_file and eval_file too"),
    (dict(corpus_file=None), r"SearchQAEnv.train_file, eval_file need corpus_file"),
    (dict(corpus_file=None, eval_file=None), r"SearchQAEnv.train_file needs corpus_file"),
    (dict(retrieval_weight=0.2), r"SearchQAEnv.retrieval_weight=0.2 scores the searches by the "
                                 r"gold documents.*set SearchQAEnv.titles_key"),
    (dict(corpus_file=None, train_file=None, eval_file=None, titles_key="sf"),
     r"SearchQAEnv.titles_key='sf' reads your question files"),
    (dict(question_key="answers"), r"SearchQAEnv.question_key='answers' is also the answer_key"),
    (dict(train_file=3), r"SearchQAEnv.train_file must be a str"),
    (dict(eval_file="/nope/dev.jsonl"), r"SearchQAEnv.eval_file='/nope/dev.jsonl': no such file"),
    (dict(corpus_file="/data/wiki.csv"), r"SearchQAEnv.corpus_file=.*unknown file format.*"
                                          r"Parquet \(\.parquet"),
])
def test_file_settings_are_checked(tmp_path, files, settings, message):
  kwargs = {**files, **{k: "" if v is None else v for k, v in settings.items()}}
  with pytest.raises(ValueError, match=message):
    SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, **kwargs)


def test_search_r1_parquet_questions_and_a_wikipedia_dump_corpus(tmp_path):
  """Search-R1's nq parquet rows (the question and golden_answers columns beside verl's chat
  prompt and reward_model struct) over a Hugging Face Wikipedia dump's {id, url, title, text}."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  def parquet(name, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / name))
    return str(tmp_path / name)

  corpus = parquet("wiki.parquet", [
      {"id": str(i), "url": f"https://en.wikipedia.org/?curid={i}", **{k: d[k] for k in ("title", "text")}}
      for i, d in enumerate(CORPUS)])

  def nq(i, row):
    golds = [str(a) for a in row.get("answers") or [row["answer"]]]
    return {"id": f"train_{i}", "question": row["question"], "golden_answers": golds,
            "data_source": "nq", "prompt": [{"role": "user", "content": "Answer ... " + row["question"]}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": golds}},
            "extra_info": {"split": "train", "index": i}}

  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, corpus_file=corpus,
                    train_file=parquet("nq_train.parquet", [nq(i, r) for i, r in enumerate(TRAIN)]),
                    eval_file=parquet("nq_dev.parquet", [nq(0, EVAL[0])]))
  assert [(d.id, d.title) for d in env.index.documents] == [
      ("0", "Ada Lovelace"), ("1", "Analytical Engine"), ("2", "Charles Babbage")]
  assert [ex.gold for ex in env.examples("train")] == [["Charles Babbage", "Babbage"], ["1791"]]
  assert env.examples("eval")[0].gold == ["London"]
  env = SearchQAEnv(data_dir=str(tmp_path), **{**SMALL, "sft_size": 0}, corpus_file=corpus,
                    train_file=str(tmp_path / "nq_train.parquet"), eval_file=str(tmp_path / "nq_dev.parquet"),
                    answer_key="reward_model.ground_truth.target")
  assert env.examples("eval")[0].gold == ["London"]


def test_sharded_corpus_and_question_files(tmp_path):
  # Hugging Face ships a split in shards: each setting a glob pattern, read in sorted order.
  write_jsonl(tmp_path / "wiki-00001.jsonl", CORPUS[2:])
  write_jsonl(tmp_path / "wiki-00000.jsonl", CORPUS[:2])
  write_jsonl(tmp_path / "train-00000.jsonl", TRAIN[:1])
  write_jsonl(tmp_path / "train-00001.jsonl", TRAIN[1:])
  env = SearchQAEnv(data_dir=str(tmp_path / "tfds"), **{**SMALL, "sft_size": 0},
                    corpus_file=str(tmp_path / "wiki-*.jsonl"),
                    train_file=str(tmp_path / "train-*.jsonl"),
                    eval_file=write_jsonl(tmp_path / "dev.jsonl", EVAL))
  assert [d.id for d in env.index.documents] == ["0", "1", "cb"]
  # Line 1 of each shard: the ids name the shard too.
  assert [(e.id, e.metadata["where"]) for e in env.examples("train")] == [
      ("train-file-0-1", "train-00000.jsonl line 1"), ("train-file-1-1", "train-00001.jsonl line 1")]
  assert [e.id for e in env.examples("eval")] == ["eval-file-1"]
  with pytest.raises(ValueError, match=r"SearchQAEnv\.corpus_file='.*kilt-\*\.jsonl': the glob "
                                       r"pattern matches no file"):
    SearchQAEnv(data_dir=str(tmp_path / "tfds"), **{**SMALL, "sft_size": 0},
                corpus_file=str(tmp_path / "kilt-*.jsonl"),
                train_file=str(tmp_path / "train-*.jsonl"), eval_file=str(tmp_path / "dev.jsonl"))
