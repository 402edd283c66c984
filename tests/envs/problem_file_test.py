"""problem_file: JSONL, ArrayRecord and Parquet problem files read back, GSM8K answers, custom keys, and
every bad record named (file, line or record, what is wrong)."""
import gzip
import json
import re

import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from jaxagent.envs.problem_file import (check_problem_file, problem_files, read_documents,
                                        read_problems)

GSM8K = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
         "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
RECORDS = [
    {"question": "  How many clips?\n", "answer": GSM8K, "id": "gsm8k-0"},
    {"question": "What is 6 times 7?", "answer": 42},
    {"question": "Half of 7?", "answer": 3.5},
    {"question": "Name the root.", "answer": "\\sqrt{2}"},
    {"question": "Either sign?", "answer": ["-3", 3]},
    {"question": "Thousands?", "answer": "#### 1,000"},
]
GOLDS = ["72", "42", "3.5", "\\sqrt{2}", ("-3", "3"), "1,000"]


def write_jsonl(path, lines):
  path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
  return path


def write_array_record(path, records):
  writer = ArrayRecordWriter(str(path), "group_size:1")
  for rec in records:
    writer.write(rec if isinstance(rec, bytes) else json.dumps(rec).encode())
  writer.close()
  return path


def test_jsonl_round_trip_with_gsm8k_answers(tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", [RECORDS[0], "", *RECORDS[1:]])
  probs = read_problems(path)
  assert [p.gold for p in probs] == GOLDS
  assert probs[0].question == "How many clips?"
  # Line numbers from 1, the blank line 2 counted but not a record.
  assert [p.index for p in probs] == [1, 3, 4, 5, 6, 7]
  assert probs[1].where == "train.jsonl line 3"


def test_array_record_round_trip(tmp_path):
  for suffix in (".array_record", ".arrayrecord"):
    path = write_array_record(tmp_path / f"test{suffix}", RECORDS)
    probs = read_problems(path)
    assert [p.gold for p in probs] == GOLDS
    assert [p.index for p in probs] == list(range(len(RECORDS)))
    assert probs[2].where == f"test{suffix} record 2"


def test_custom_keys(tmp_path):
  path = write_jsonl(tmp_path / "p.jsonl", [{"problem": "1+1?", "solution": "#### 2"}])
  (p,) = read_problems(path, question_key="problem", answer_key="solution")
  assert (p.question, p.gold) == ("1+1?", "2")


@pytest.mark.parametrize("line, message", [
    ({"questoin": "Q?", "answer": 1},
     "p.jsonl line 2: no 'question' key (MathToolEnv.question_key); the record has ['answer', "
     "'questoin']; did you mean 'questoin'? (set MathToolEnv.question_key='questoin')"),
    ({"problem": "Q?", "answer": 1},
     "p.jsonl line 2: no 'question' key (MathToolEnv.question_key); the record has ['answer', "
     "'problem']; set MathToolEnv.question_key to the key that holds it"),
    ({"question": "Q?", "answers": "1"},
     "p.jsonl line 2: no 'answer' key (MathToolEnv.answer_key); the record has ['answers', "
     "'question']; did you mean 'answers'? (set MathToolEnv.answer_key='answers')"),
    ({"question": 5, "answer": 1}, "p.jsonl line 2: the question ('question') must be text, got int 5"),
    ({"question": ["Q?"], "answer": 1},
     "p.jsonl line 2: the question ('question') must be text, got list ['Q?']"),
    ({"question": " \n", "answer": 1}, "p.jsonl line 2: the question ('question') is empty"),
    ({"question": "Q?", "answer": ""}, "p.jsonl line 2: the answer ('answer') is empty"),
    ({"question": "Q?", "answer": []}, "p.jsonl line 2: the answer ('answer') is an empty list"),
    ({"question": "Q?", "answer": None},
     "p.jsonl line 2: the answer ('answer') must be a number, text or a list of them, got "
     "NoneType None"),
    ({"question": "Q?", "answer": True},
     "p.jsonl line 2: the answer ('answer') must be a number, text or a list of them, got bool"),
    ({"question": "Q?", "answer": {"value": 3}},
     "p.jsonl line 2: the answer ('answer') must be a number, text or a list of them, got dict"),
    ('{"question": "Q?", "answer": NaN}', "p.jsonl line 2: the answer ('answer') is nan, not a finite"),
    ({"question": "Q?", "answer": "He has 5.\n#### "},
     "p.jsonl line 2: the answer ('answer') has a '####' marker with no final answer after it"),
    ('{"question": "Q?", "answer": 1', "p.jsonl line 2: not JSON (Expecting ',' delimiter at column"),
    ('["Q?", 1]', "p.jsonl line 2: a record must be a JSON object with 'question' and 'answer' "
     "keys, got an array [\"Q?\", 1]"),
    ("null", "p.jsonl line 2: a record must be a JSON object with 'question' and 'answer' keys, "
     "got null"),
    ('"How many?"', "p.jsonl line 2: a record must be a JSON object with 'question' and 'answer' "
     "keys, got a string \"How many?\""),
])
def test_a_bad_record_is_named(tmp_path, line, message):
  path = write_jsonl(tmp_path / "p.jsonl", [{"question": "ok?", "answer": 1}, line])
  with pytest.raises(ValueError) as e:
    read_problems(path)
  assert f"MathToolEnv.train_file='{path}': 1 bad record (of 2); fix or remove them" in str(e.value)
  assert message in str(e.value), str(e.value)


def test_every_bad_record_is_counted_and_the_first_ones_listed(tmp_path):
  lines = [{"question": "ok?", "answer": 1}] + [{"question": f"Q{i}?"} for i in range(7)]
  with pytest.raises(ValueError) as e:
    read_problems(write_jsonl(tmp_path / "p.jsonl", lines), setting="eval_file")
  text = str(e.value)
  assert "MathToolEnv.eval_file=" in text and "7 bad records (of 8)" in text
  assert re.findall(r"line (\d+)", text) == ["2", "3", "4", "5", "6"]
  assert text.endswith("... and 2 more")


def test_a_bad_array_record_is_named_by_its_index(tmp_path):
  path = write_array_record(tmp_path / "t.array_record",
                            [{"question": "ok?", "answer": 1}, b"\xff\xfe", b"not json"])
  with pytest.raises(ValueError, match=r"(?s)2 bad records \(of 3\).*t\.array_record record 1: "
                     r"not UTF-8 JSON text.*t\.array_record record 2: not JSON"):
    read_problems(path)


@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", "", r"empty\.jsonl': the file holds no problems; give one JSON object per "
     r"problem with a 'question' and an 'answer' key"),
    ("blank.jsonl", "\n  \n", r"the file holds no problems"),
    ("p.json", "{}", r"MathToolEnv.train_file='.*p\.json': unknown file format \(suffix '\.json'\); "
     r"a problem file is JSONL \(\.jsonl, \.jsonl\.gz: .*ArrayRecord \(\.array_record, \.arrayrecord"
     r".*Parquet \(\.parquet: one row a record\)"),
    ("p.array_record", "not an array record", r"p\.array_record': cannot read it as an "
     r"ArrayRecord file \(RuntimeError"),
    ("latin1.jsonl", b"\xe9\n", r"latin1\.jsonl': not UTF-8 text"),
    ("p.parquet", "not a parquet file", r"p\.parquet': cannot read it as a Parquet file "
     r"\(ArrowInvalid"),
])
def test_a_bad_file_is_named(tmp_path, name, content, message):
  path = tmp_path / name
  (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
  with pytest.raises(ValueError, match=message):
    read_problems(path)


def _gzipped(n):
  return gzip.compress("".join(json.dumps({"question": f"q{i}?", "answer": i}) + "\n"
                               for i in range(n)).encode(), mtime=0)


@pytest.mark.parametrize("name, content, message", [
    # A damaged or cut gzip stream was a bare zlib.error, or called incomplete.
    ("cut.jsonl.gz", _gzipped(200)[:-300], r"cut\.jsonl\.gz': a damaged or incomplete gzip file "
     r"\(EOFError"),
    ("bad.jsonl.gz", _gzipped(200)[:400] + bytes(b ^ 0xFF for b in _gzipped(200)[400:410])
     + _gzipped(200)[410:], r"bad\.jsonl\.gz': a damaged or incomplete gzip file \((error|"
     r"BadGzipFile): .*compress or download it again"),
    ("plain.jsonl.gz", '{"question": "q?", "answer": 1}\n', r"plain\.jsonl\.gz': not a gzip "
     r"file .*; a \.jsonl\.gz file is gzip-compressed JSONL: name a plain JSONL file \.jsonl"),
    ("packed.jsonl", _gzipped(3), r"packed\.jsonl': not UTF-8 text .*; the file is "
     r"gzip-compressed: name it \.jsonl\.gz"),
    ("utf16.jsonl", '{"question": "q?", "answer": 1}\n'.encode("utf-16"), r"utf16\.jsonl': not "
     r"UTF-8 text .*; the file is UTF-16 text \(it starts with a UTF-16 byte-order mark\): save "
     r"it as UTF-8"),
    ("dump.jsonl", "\n" + json.dumps([{"question": "q?", "answer": 1}] * 2, indent=2),
     r"dump\.jsonl': line 2 is '\[' alone: the file is one JSON document over many lines \(an "
     r"indented array or object\), not JSONL"),
    ("dump1.jsonl", json.dumps([{"question": "q?", "answer": 1}] * 3), r"dump1\.jsonl line 1: a "
     r"record must be a JSON object with 'question' and 'answer' keys, got an array of 3 objects: "
     r"each object is a record of its own \(in JSONL, one a line\)"),
    ("e.array_record", b"", r"e\.array_record': the file is empty \(0 bytes\), with no "
     r"ArrayRecord data \(one JSON object a record\); write or copy it again"),
    ("e.parquet", b"", r"e\.parquet': the file is empty \(0 bytes\), with no Parquet data"),
])
def test_a_bad_file_says_what_it_is(tmp_path, name, content, message):
  path = tmp_path / name
  (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
  with pytest.raises(ValueError, match=message):
    read_problems(path)
  with pytest.raises(ValueError, match=message.replace("'question' and 'answer'",
                                                       "'title' and 'text'")):
    read_documents(path, owner="SearchQAEnv")


def test_a_damaged_array_record_chunk_names_the_records_it_holds(tmp_path, monkeypatch):
  from jaxagent.envs import record_files
  path = write_array_record(tmp_path / "t.array_record",
                            [{"question": f"q{i}?", "answer": i} for i in range(40)])
  data = bytearray(path.read_bytes())
  at = data.find(b"q20?")
  data[at:at + 4] = b"qXX?"  # the record's chunk no longer matches its hash
  path.write_bytes(bytes(data))
  monkeypatch.setattr(record_files, "_ARRAY_RECORD_BATCH", 8)
  with pytest.raises(ValueError, match=r"MathToolEnv\.train_file='.*t\.array_record': cannot read "
                                       r"records 16-23 of 40, the ArrayRecord file is damaged "
                                       r"\(RuntimeError: .*\); write it again"):
    read_problems(path)


def test_an_empty_array_record_file_is_an_error(tmp_path):
  with pytest.raises(ValueError, match=r"the file holds no problems"):
    read_problems(write_array_record(tmp_path / "e.array_record", []))


def test_a_missing_file_or_url_is_named(tmp_path):
  with pytest.raises(ValueError, match=r"MathToolEnv.eval_file='.*nope\.jsonl': no such file"):
    read_problems(tmp_path / "nope.jsonl", setting="eval_file")
  with pytest.raises(ValueError, match=r"must be a local file, got the URL 'gs://b/t\.jsonl'"):
    read_problems("gs://b/t.jsonl")
  (tmp_path / "d.jsonl").mkdir()
  with pytest.raises(ValueError, match=r"d\.jsonl' is not a file but a directory; give one file"):
    read_problems(tmp_path / "d.jsonl")
  (tmp_path / "spark.parquet").mkdir()  # Spark writes part files under a .parquet folder
  with pytest.raises(ValueError, match=r"spark\.parquet' is not a file but a directory; give one "
                                       r"file, or for a data set split into several files, such "
                                       r"as Parquet parts or shards, a glob pattern of its files "
                                       r"\('.*spark\.parquet/\*\.parquet'\)"):
    read_problems(tmp_path / "spark.parquet")


def test_a_missing_relative_path_names_the_directory_it_was_looked_up_in(tmp_path, monkeypatch):
  # A config file's relative path is read from the launcher's working directory: say which.
  monkeypatch.chdir(tmp_path)
  cwd = re.escape(repr(str(tmp_path)))
  with pytest.raises(ValueError, match=rf"'data/t\.jsonl': no such file \(a relative path, "
                                       rf"looked up in {cwd}\)"):
    read_problems("data/t.jsonl")
  with pytest.raises(ValueError, match=rf"matches no file \(a relative path, looked up in {cwd}\)"):
    read_problems("data/t-*.jsonl")
  with pytest.raises(ValueError, match=r"nope\.jsonl': no such file$"):
    read_problems(tmp_path / "nope.jsonl")  # an absolute path: no note


def test_record_keys_keep_only_what_the_task_reads(tmp_path):
  # A math set's rows carry sampled generations many times the problem's size: the problems
  # read keep the question, answer and asked-for keys only, not every row whole in memory.
  rows = [{"problem": "1+1?", "answer": "2", "solution": "1+1 = 2", "meta": {"q": "x"},
           "generations": ["long"] * 100},
          {"problem": "2+2?", "answer": "4", "meta": {"q": "y"}, "generations": ["long"] * 100}]
  first, second = read_problems(write_jsonl(tmp_path / "train.jsonl", rows),
                                question_key="problem", record_keys=("solution",))
  assert first.record == {"problem": "1+1?", "answer": "2", "solution": "1+1 = 2"}
  assert "generations" in second.record  # no 'solution': whole, for the caller's error
  path = write_parquet(tmp_path / "train.parquet", rows)
  (first, _) = read_problems(path, question_key="problem", answer_key="meta.q", record_keys=())
  assert first.record == {"problem": "1+1?", "meta": {"q": "x"}}
  assert "generations" in read_problems(path, question_key="problem")[0].record  # None: whole


def test_gzip_jsonl(tmp_path):
  path = tmp_path / "train.jsonl.gz"
  path.write_bytes(gzip.compress(("\n".join(json.dumps(r) for r in RECORDS) + "\n").encode()))
  probs = read_problems(path)
  assert [p.gold for p in probs] == GOLDS and probs[1].where == "train.jsonl.gz line 2"
  path.write_bytes(gzip.compress(b'{"question": "q", "answer": 1}\n')[:-6])
  with pytest.raises(ValueError, match=r"MathToolEnv.train_file=.*train.jsonl.gz': a damaged or "
                                       r"incomplete gzip file"):
    read_problems(path)


def test_a_jsonl_file_is_read_line_by_line(tmp_path):
  """A corpus may be larger than memory: records come before the whole file is read (a bad
  byte 1 MB in still fails the read, once reached)."""
  from jaxagent.envs.record_files import file_records
  path = tmp_path / "big.jsonl"
  line = json.dumps({"question": "q" * 40, "answer": 1}) + "\n"
  path.write_bytes(line.encode() * 20_000 + b'{"question": "\xe9", "answer": 1}\n')
  first = next(file_records(path, "S"))
  assert first[:2] == (1, "big.jsonl line 1") and json.loads(first[2])["answer"] == 1
  with pytest.raises(ValueError, match=r"MathToolEnv.train_file=.*big.jsonl': not UTF-8 text"):
    read_problems(path)


def write_parquet(path, rows, row_group_size=None):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=row_group_size)
  return path


def verl_row(i, answer):
  """A row as verl's gsm8k preprocessing writes it: the chat prompt with its instructions, the
  ground truth in a struct column, the plain question and worked answer in extra_info."""
  return {"data_source": "openai/gsm8k",
          "prompt": [{"role": "user", "content": f"Question {i}? Let's think step by step."}],
          "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(answer)},
          "extra_info": {"split": "train", "index": i, "question": f"Question {i}?",
                         "answer": f"{i} + {i} = {answer}\n#### {answer}"}}


def test_parquet_round_trip_batch_by_batch(tmp_path, monkeypatch):
  import pyarrow.parquet as pq

  from jaxagent.envs import record_files
  monkeypatch.setattr(record_files, "_PARQUET_BATCH_ROWS", 2)  # 7 rows: 4 batches, 3 row groups
  path = write_parquet(tmp_path / "train.parquet", [verl_row(i, 2 * i) for i in range(7)],
                       row_group_size=3)
  for answer_key in ("reward_model.ground_truth", "extra_info.answer"):
    probs = read_problems(path, question_key="extra_info.question", answer_key=answer_key)
    assert [p.gold for p in probs] == [str(2 * i) for i in range(7)]
    assert [p.question for p in probs] == [f"Question {i}?" for i in range(7)]
    assert [p.index for p in probs] == list(range(7))
    assert probs[4].where == "train.parquet record 4"
    assert probs[4].record["prompt"][0]["role"] == "user"
  # Batch by batch: the first record comes after one batch is read, not the whole file.
  pulled = []
  iter_batches = pq.ParquetFile.iter_batches

  def counted(self, **kw):
    for batch in iter_batches(self, **kw):
      pulled.append(batch.num_rows)
      yield batch
  monkeypatch.setattr(pq.ParquetFile, "iter_batches", counted)
  records = record_files.file_records(path, "S")
  assert next(records)[:2] == (0, "train.parquet record 0") and pulled == [2]
  assert len(list(records)) == 6 and sum(pulled) == 7
  # A list column of answers (Search-R1's golden_answers) is several accepted answers.
  path = write_parquet(tmp_path / "nq.parquet", [
      {"question": "who wrote it", "golden_answers": ["Ada", "Ada Lovelace"]}])
  assert read_problems(path, answer_key="golden_answers")[0].gold == ("Ada", "Ada Lovelace")


def test_a_bad_parquet_row_is_named(tmp_path):
  path = write_parquet(tmp_path / "train.parquet", [verl_row(0, 4), verl_row(1, 6)])
  # The chat prompt is not the question: the plain question's key is named.
  with pytest.raises(ValueError, match=re.escape(
      "train.parquet record 0: the question ('prompt') is a list of chat messages (a prompt with "
      "its dataset's instructions), not the question's text; set MathToolEnv.question_key to the "
      "key of the plain question, e.g. 'extra_info.question'")):
    read_problems(path, question_key="prompt", answer_key="reward_model.ground_truth")
  # A key no column holds is one error for the file: it lists the columns, and finds the key
  # inside a struct column.
  with pytest.raises(ValueError, match=re.escape(
      f"MathToolEnv.train_file={str(path)!r}: no record can have a 'question' key "
      "(MathToolEnv.question_key), the file has no such column: the file's columns are "
      "['ability', 'data_source', 'extra_info', 'prompt', 'reward_model']; did you mean "
      "'extra_info.question'? (set MathToolEnv.question_key='extra_info.question')")):
    read_problems(path, answer_key="reward_model.ground_truth")
  with pytest.raises(ValueError, match=re.escape(
      "no record can have a 'reward_model.truth' key (MathToolEnv.answer_key), the file has no "
      "such field: the file's 'reward_model' column has the fields ['ground_truth', 'style']")):
    read_problems(path, question_key="extra_info.question", answer_key="reward_model.truth")
  # A null cell is named, not skipped.
  path = write_parquet(tmp_path / "nulls.parquet", [{"question": "q?", "answer": "1"},
                                                     {"question": "r?", "answer": None}])
  with pytest.raises(ValueError, match=re.escape(
      "1 bad record (of 2); fix or remove them:\n  nulls.parquet record 1: the answer ('answer') "
      "must be a number, text or a list of them, got NoneType None")):
    read_problems(path)
  empty = tmp_path / "empty.parquet"
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"question": pa.array([], pa.string()),
                           "answer": pa.array([], pa.string())}), str(empty))
  with pytest.raises(ValueError, match=r"empty\.parquet': the file holds no problems"):
    read_problems(empty)


def test_parquet_problems_read_only_the_needed_columns(tmp_path, monkeypatch):
  """With record_keys (as the envs pass them), only the top-level columns of the question,
  answer and record keys are decoded: a math set's large generations column is not; the
  errors still list every column and find keys inside unread struct columns."""
  import pyarrow.parquet as pq
  rows = [{**verl_row(i, 2 * i), "generations": [f"sample {k} " * 50 for k in range(4)],
           "steps": f"{i} + {i} = {2 * i}"} for i in range(3)]
  path = write_parquet(tmp_path / "train.parquet", rows)
  read = []
  iter_batches = pq.ParquetFile.iter_batches

  def recorded(self, **kw):
    read.append(sorted(kw["columns"]))
    return iter_batches(self, **kw)
  monkeypatch.setattr(pq.ParquetFile, "iter_batches", recorded)
  probs = read_problems(path, question_key="extra_info.question",
                        answer_key="reward_model.ground_truth", record_keys=("steps",))
  assert read == [["extra_info", "reward_model", "steps"]]
  assert [p.gold for p in probs] == ["0", "2", "4"] and probs[2].question == "Question 2?"
  assert probs[1].record == {"extra_info": rows[1]["extra_info"],
                             "reward_model": rows[1]["reward_model"], "steps": "1 + 1 = 2"}
  # The hints of a bad setting are those of a whole read, from the file's schema.
  with pytest.raises(ValueError, match=re.escape(
      "record 0: the question ('prompt') is a list of chat messages (a prompt with "
      "its dataset's instructions), not the question's text; set MathToolEnv.question_key to the "
      "key of the plain question, e.g. 'extra_info.question'")):
    read_problems(path, question_key="prompt", answer_key="reward_model.ground_truth",
                  record_keys=())
  assert read[-1] == ["prompt", "reward_model"]
  reads = len(read)
  with pytest.raises(ValueError, match=re.escape(
      "no record can have a 'question' key (MathToolEnv.question_key), the file has no such "
      "column: the file's columns are ['ability', 'data_source', 'extra_info', 'generations', "
      "'prompt', 'reward_model', 'steps']; did you mean 'extra_info.question'? (set "
      "MathToolEnv.question_key='extra_info.question')")):
    read_problems(path, answer_key="reward_model.ground_truth", record_keys=())
  assert len(read) == reads  # from the schema: no row read
  # A record key no column holds: the record is kept whole (by name) for the caller's error.
  probs = read_problems(path, question_key="extra_info.question", answer_key="extra_info.answer",
                        record_keys=("worked",))
  assert read[-1] == ["extra_info"] and "generations" in probs[0].record


def test_a_parquet_corpus_reads_only_the_document_columns(tmp_path, monkeypatch):
  """A Wikipedia dump's extra columns (url, an embedding per passage) are ignored and not read."""
  import pyarrow.parquet as pq

  from jaxagent.envs.problem_file import read_documents
  from jaxagent.tools.search import Document
  rows = [{"id": "12", "url": "https://en.wikipedia.org/wiki/Ada", "title": "Ada",
           "text": "Ada wrote.", "wiki_id": 3, "emb": [0.5] * 8},
          {"id": "13", "url": "u", "title": "Bob", "text": "Bob read.", "wiki_id": 4,
           "emb": [0.0] * 8}]
  path = write_parquet(tmp_path / "wiki.parquet", rows)
  read = []
  iter_batches = pq.ParquetFile.iter_batches
  monkeypatch.setattr(pq.ParquetFile, "iter_batches",
                      lambda self, **kw: read.append(kw["columns"]) or iter_batches(self, **kw))
  docs = read_documents(path, owner="SearchQAEnv")
  assert docs == [Document("Ada", "Ada wrote.", "12"), Document("Bob", "Bob read.", "13")]
  assert read == [["id", "title", "text"]]
  # A misspelt text column is named with the file's columns; a misspelt title by row.
  path = write_parquet(tmp_path / "txt.parquet", [{"id": "1", "title": "A", "txt": "a"}])
  with pytest.raises(ValueError, match=re.escape(
      "SearchQAEnv.corpus_file=" + repr(str(path)) + ": no 'text' (or 'contents') column; the "
      "file's columns are ['id', 'title', 'txt']; 'txt' looks like a misspelt 'text': rename it")):
    read_documents(path, owner="SearchQAEnv")
  path = write_parquet(tmp_path / "titel.parquet", [{"titel": "A", "text": "a", "url": "u"}])
  with pytest.raises(ValueError, match=re.escape(
      "titel.parquet record 0: 'titel' looks like a misspelt 'title': rename it (fields: "
      "['text', 'titel']; fields other than title, text and id are ignored)")):
    read_documents(path, owner="SearchQAEnv")


def test_a_wide_parquet_corpus_looks_for_misspelt_columns_once(tmp_path, monkeypatch):
  """The columns to read are picked with one look for misspelt document fields over the file's
  columns (it was one look per column: quadratic in the columns of a wide file)."""
  from jaxagent.envs.problem_file import read_documents
  from jaxagent.tools import search
  row = {"id": "1", "titel": "Ada", "text": "Ada wrote.",
         **{f"extra_{k}": k for k in range(40)}}
  path = write_parquet(tmp_path / "wide.parquet", [row])
  looks = []
  misspelt_fields = search.misspelt_fields
  monkeypatch.setattr(search, "misspelt_fields", lambda keys: looks.append(
      keys) or misspelt_fields(keys))
  with pytest.raises(ValueError, match=re.escape("wide.parquet record 0: 'titel' looks like a "
                                                 "misspelt 'title'")):
    read_documents(path, owner="SearchQAEnv")  # the misspelt column is read, to be named
  assert [keys for keys in looks if isinstance(keys, list)] == [list(row)]


def test_a_glob_pattern_reads_a_sharded_split_in_sorted_order(tmp_path):
  # Written out of order: the shards are read sorted by name, each record named by its file.
  write_jsonl(tmp_path / "train-00001-of-00002.jsonl", [RECORDS[2], "", RECORDS[3]])
  write_jsonl(tmp_path / "train-00000-of-00002.jsonl", RECORDS[:2])
  write_jsonl(tmp_path / "test-00000-of-00001.jsonl", [RECORDS[4]])  # not matched
  probs = read_problems(str(tmp_path / "train-*.jsonl"))
  assert [p.gold for p in probs] == GOLDS[:4]
  assert [(p.where, p.key) for p in probs] == [
      ("train-00000-of-00002.jsonl line 1", "0-1"), ("train-00000-of-00002.jsonl line 2", "0-2"),
      ("train-00001-of-00002.jsonl line 1", "1-1"), ("train-00001-of-00002.jsonl line 3", "1-3")]
  assert problem_files(str(tmp_path / "train-*.jsonl"), "s") == (
      tmp_path / "train-00000-of-00002.jsonl", tmp_path / "train-00001-of-00002.jsonl")
  # A plain path reads as before: its records keyed by line alone.
  one = read_problems(tmp_path / "train-00001-of-00002.jsonl")
  assert [(p.key, p.file) for p in one] == [("1", None), ("3", None)]
  # A pattern of one file still keys by file, and a bad record names its shard.
  write_jsonl(tmp_path / "bad-00000.jsonl", [RECORDS[0], {"question": "q?"}])
  with pytest.raises(ValueError, match=r"MathToolEnv\.train_file='.*bad-\*\.jsonl': 1 bad record "
                                       r"\(of 2\).*\n  bad-00000\.jsonl line 2: no 'answer' key"):
    read_problems(str(tmp_path / "bad-*.jsonl"))
  assert [p.key for p in read_problems(str(tmp_path / "train-00000-*.jsonl"))] == ["0-1", "0-2"]


def test_parquet_shards_and_a_sharded_corpus(tmp_path):
  for k in range(3):
    write_parquet(tmp_path / f"train-0000{k}-of-00003.parquet",
                  [{"question": f"q{k}-{i}?", "answer": str(k * 10 + i)} for i in range(2)])
    write_parquet(tmp_path / f"wiki-{k}.parquet",
                  [{"title": f"T{k}{i}", "text": f"text {k}{i}", "url": "u"} for i in range(2)])
  probs = read_problems(str(tmp_path / "train-*-of-00003.parquet"))
  assert [p.gold for p in probs] == ["0", "1", "10", "11", "20", "21"]
  assert probs[3].where == "train-00001-of-00003.parquet record 1" and probs[3].key == "1-1"
  docs = read_documents(str(tmp_path / "wiki-*.parquet"), owner="SearchQAEnv")
  assert [(d.id, d.title) for d in docs] == [(str(i), f"T{i // 2}{i % 2}") for i in range(6)]


def test_a_bad_glob_pattern_is_named(tmp_path):
  with pytest.raises(ValueError, match=r"MathToolEnv\.train_file='.*train-\*\.parquet': the glob "
                                       r"pattern matches no file"):
    read_problems(str(tmp_path / "train-*.parquet"))
  with pytest.raises(ValueError, match=r"MathToolEnv\.train_file='.*nope/\*\.jsonl': the glob "
                                       r"pattern matches no file"):
    check_problem_file(str(tmp_path / "nope" / "*.jsonl"), "MathToolEnv.train_file")
  write_jsonl(tmp_path / "part-0.jsonl", RECORDS[:1])
  write_parquet(tmp_path / "part-1.parquet", [{"question": "q?", "answer": "1"}])
  with pytest.raises(ValueError, match=r"CodeEnv\.problem_file='.*part-\*': the pattern matches "
                                       r"files of 2 formats: JSONL \(part-0\.jsonl\), Parquet "
                                       r"\(part-1\.parquet\); all files of a pattern must be of "
                                       r"one format"):
    check_problem_file(str(tmp_path / "part-*"), "CodeEnv.problem_file")
  (tmp_path / "part-2.csv").write_text("q,a\n")
  with pytest.raises(ValueError, match=r"'.*part-\?\.\*' matches '.*part-2\.csv': unknown file "
                                       r"format \(suffix '\.csv'\)"):
    read_problems(str(tmp_path / "part-?.*"))
  # .jsonl and .jsonl.gz are one format; a name with glob characters that exists is a file.
  write_jsonl(tmp_path / "odd[1].jsonl", RECORDS[1:2])
  assert [p.key for p in read_problems(str(tmp_path / "odd[1].jsonl"))] == ["1"]


def test_duplicate_corpus_ids_name_both_places_in_file_order(tmp_path):
  """Duplicate ids are found with a set of ids (no location kept per document) and located by a
  second read: each names where the id was first, among the other bad records in file order."""
  path = tmp_path / "wiki.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in [
      {"id": "a", "text": "1"}, {"id": "b", "text": "2"}, {"id": "a", "text": "3"},
      {"title": "no text"}, {"id": "b", "text": "4"}, {"id": "a", "text": "5"},
      {"text": "6"}, {"id": "2", "text": "7"}]))
  with pytest.raises(ValueError) as e:
    read_documents(path, owner="SearchQAEnv")
  assert str(e.value).split("\n  ")[1:] == [
      "wiki.jsonl line 3: the id 'a' is the id of wiki.jsonl line 1 too; ids must be unique",
      "wiki.jsonl line 4: has no 'text' field (fields: ['title'])",
      "wiki.jsonl line 5: the id 'b' is the id of wiki.jsonl line 2 too; ids must be unique",
      "wiki.jsonl line 6: the id 'a' is the id of wiki.jsonl line 1 too; ids must be unique",
      # Line 7 has no id: its position among the documents (2) names it, not the line.
      "wiki.jsonl line 8: the id '2' is the id of wiki.jsonl line 7 too; ids must be unique"]


def test_an_array_record_file_is_read_a_batch_of_records_at_a_time(tmp_path, monkeypatch,
                                                                  batched_reads):
  """One record a read cost about 0.4 ms (72 s for a 200k-passage corpus); a batch a read is
  40 times faster. Records keep their order and indexes across batches."""
  from grain.sources import ArrayRecordDataSource

  from jaxagent.envs import record_files
  path = write_array_record(tmp_path / "t.array_record",
                            [{"question": f"q{i}?", "answer": i} for i in range(5)])
  monkeypatch.setattr(record_files, "_ARRAY_RECORD_BATCH", 2)
  reads = batched_reads(ArrayRecordDataSource)
  probs = read_problems(path)
  assert reads == [[0, 1], [2, 3], [4]]
  assert [(p.index, p.where, p.gold) for p in probs] == [
      (i, f"t.array_record record {i}", str(i)) for i in range(5)]


def test_an_env_expands_a_glob_pattern_and_checks_its_files_once(tmp_path, monkeypatch):
  """Each file setting is resolved once when the env is built (the pattern expanded, each file
  checked), and the files read are the ones resolved (a repeated setting, math_tool's sft_file
  as its train_file, once for both)."""
  from jaxagent.envs import record_files
  from jaxagent.envs.code import CodeEnv
  from jaxagent.envs.math_tool import MathToolEnv
  from jaxagent.envs.search_qa import SearchQAEnv

  for k in range(2):
    write_jsonl(tmp_path / f"train-{k}.jsonl", RECORDS[3 * k:3 * k + 3])
    write_jsonl(tmp_path / f"wiki-{k}.jsonl", [{"title": f"T{k}", "text": f"text {k}"}])
    write_jsonl(tmp_path / f"code-{k}.jsonl", [{
        "task_id": f"t/{k}", "prompt": f"def f{k}(x):\n  pass\n", "entry_point": f"f{k}",
        "test": "def check(candidate):\n  assert candidate(1) == 1\n"}])
  globs, checks = [], []
  real_glob, real_check = record_files.glob.glob, record_files._check_one_file
  monkeypatch.setattr(record_files.glob, "glob",
                      lambda *a, **kw: globs.append(a[0]) or real_glob(*a, **kw))
  monkeypatch.setattr(record_files, "_check_one_file",
                      lambda p, *a, **kw: checks.append(p.name) or real_check(p, *a, **kw))

  def pattern(stem):
    return str(tmp_path / f"{stem}-*.jsonl")
  env = MathToolEnv(train_file=pattern("train"), sft_file=pattern("train"), eval_size=1,
                    train_size=0)
  assert (len(globs), sorted(checks)) == (1, ["train-0.jsonl", "train-1.jsonl"])
  assert len(env.examples("train")) == 6 and len(globs) == 1  # read: the files resolved
  globs.clear(), checks.clear()
  CodeEnv(problem_file=pattern("code"), eval_size=1, sft_size=0)
  assert (len(globs), sorted(checks)) == (1, ["code-0.jsonl", "code-1.jsonl"])
  globs.clear(), checks.clear()
  env = SearchQAEnv(corpus_file=pattern("wiki"), train_file=pattern("train"),
                    eval_file=str(tmp_path / "train-0.jsonl"), sft_size=0,
                    data_dir=str(tmp_path / "tfds"))
  assert len(globs) == 2 and sorted(checks) == [
      "train-0.jsonl", "train-0.jsonl", "train-1.jsonl", "wiki-0.jsonl", "wiki-1.jsonl"]
  assert len(env.examples("train")) == 6 and len(globs) == 2


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz", "t.array_record", "t.parquet"])
def test_a_file_gone_after_its_setting_was_checked_is_named(tmp_path, name):
  """A split's file is read when the split is first asked for: gone by then, it was a bare
  FileNotFoundError."""
  from jaxagent.envs.math_tool import MathToolEnv
  path = tmp_path / name
  path.write_text("x")
  env = MathToolEnv(train_file=str(path), train_size=0, eval_size=0, sft_size=0)
  path.unlink()
  with pytest.raises(ValueError, match=r"MathToolEnv\.train_file='.*t\..*': cannot open the file "
                                       r"\(FileNotFoundError: No such file or directory\); it "
                                       r"was there when the setting was checked"):
    env.examples("train")


def test_a_parquet_file_without_a_key_column_is_one_error_before_any_row(tmp_path, monkeypatch):
  """A question (or answer) key that no column holds is one error from the file's schema,
  naming the key, the file and its columns: it was an error per row (4 s for 200k rows), and
  the same for every env that reads Parquet (CodeEnv's required keys: code_problem_file_test)."""
  import pyarrow.parquet as pq

  from jaxagent.envs.math_tool import MathToolEnv
  from jaxagent.envs.search_qa import SearchQAEnv
  read = []
  iter_batches = pq.ParquetFile.iter_batches
  monkeypatch.setattr(pq.ParquetFile, "iter_batches",
                      lambda self, **kw: read.append(kw["columns"]) or iter_batches(self, **kw))
  rows = [{"problem": f"What is {i} + {i}?", "answer": 2 * i, "level": "1"} for i in range(3000)]
  path = write_parquet(tmp_path / "math.parquet", rows, row_group_size=500)
  env = MathToolEnv(train_file=path, train_size=0, eval_size=0, sft_size=0)
  with pytest.raises(ValueError) as e:
    env.examples("train")
  assert str(e.value) == (
      f"MathToolEnv.train_file={str(path)!r}: no record can have a 'question' key "
      "(MathToolEnv.question_key), the file has no such column: the file's columns are "
      "['answer', 'level', 'problem']; set MathToolEnv.question_key to the key that holds it")
  assert read == []  # no row was read
  # A close key is suggested; every answer key of a tuple is named.
  with pytest.raises(ValueError, match=re.escape(
      "no record can have a 'answers' / 'golden_answers' key (SearchQAEnv.answer_key), the file "
      "has no such column: the file's columns are ['answer', 'level', 'problem']; did you mean "
      "'answer'? (set SearchQAEnv.answer_key='answer')")):
    read_problems(path, question_key="problem", answer_key=("answers", "golden_answers"),
                  owner="SearchQAEnv")
  # A glob pattern's shard without the column is named; the shards before it were read.
  write_parquet(tmp_path / "q-0.parquet", [{"question": "q?", "answer": "1"}])
  write_parquet(tmp_path / "q-1.parquet", [{"query": "r?", "answer": "2"}])
  corpus = tmp_path / "wiki.jsonl"
  corpus.write_text(json.dumps({"title": "T", "text": "t"}) + "\n")
  env = SearchQAEnv(corpus_file=str(corpus), train_file=str(tmp_path / "q-*.parquet"),
                    eval_file=str(tmp_path / "q-0.parquet"), train_size=0, eval_size=0,
                    sft_size=0)
  read.clear()
  with pytest.raises(ValueError, match=re.escape(
      f"SearchQAEnv.train_file={str(tmp_path / 'q-1.parquet')!r}: no record can have a "
      "'question' key (SearchQAEnv.question_key), the file has no such column: the file's "
      "columns are ['answer', 'query']")):
    env.examples("train")
  assert len(read) == 1
