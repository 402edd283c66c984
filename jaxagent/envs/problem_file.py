"""Problems and documents from files of your own: one JSON object per problem (a question and its
answer) or per document (a title and a text).

`MathToolEnv(train_file=..., eval_file=...)` reads a split here in place of its built-in source
(`jaxagent/envs/math_tool.py` turns each `Problem` into an `Example`); `SearchQAEnv` reads its
question files with `read_problems` and its corpus with `read_documents`. Three formats, picked
by the file's suffix (read in `jaxagent/envs/record_files.py`):

* JSONL (`.jsonl`, or gzip-compressed `.jsonl.gz`): one JSON object a line; blank lines are
  skipped, and a record is named by its line number (from 1).
* ArrayRecord (`.array_record`, `.arrayrecord`): each record is a JSON object as UTF-8 bytes,
  read with grain's `ArrayRecordDataSource` a batch of records at a time; a record is named by
  its index (from 0). Write one
  with `array_record`'s `ArrayRecordWriter(path, "group_size:1").write(json.dumps(obj).encode())`.
* Parquet (`.parquet`): each row is a record, its columns the keys (a struct column is an object,
  so `reward_model.ground_truth` reads inside it; a list column is a list); read with pyarrow one
  record batch at a time, the envs' problems only in the columns their keys name (a corpus in its
  document columns), and a record is named by its row index (from 0).

The question is text. The answer is a number, text, or a list of them (several accepted
answers); a GSM8K answer with worked steps ("... = 72 clips\\n#### 72") gives its final answer,
the text after the last `####` (unless `gsm8k_answers=False`, for answers that are plain text).
A document is `{"title": ..., "text": ..., "id"?: ...}` (`jaxagent.tools.search.Document`);
other keys are ignored, but one that looks like a misspelt field ("txt", "titel") is an error.
Every file setting also takes a glob pattern (`/data/nq/train-*.parquet`: a split sharded into
several files, as Hugging Face ships them): its matching files are read one after another in
sorted order, their records named by file and line or record; a pattern that matches nothing,
or files of different formats, is an error (`problem_files`).
No record is dropped: every bad one is an error that names the file, the line or record, and what
is wrong (the keys a record has when the key is missing); an empty file is an error too, and so is
a Parquet file with no column for a key every record needs (the question's, the answer's): one
error naming the key and the file's columns, before a row is read.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import pathlib
import re
from typing import Any, Callable, Iterator, Mapping, Sequence

# The file formats (which files a setting names, their records one at a time) live in
# record_files; their public names are importable from here too, as they always were.
from jaxagent.envs.record_files import (ARRAY_RECORD_SUFFIXES, JSONL_SUFFIXES, PARQUET_SUFFIXES,
                                        SUFFIXES, ColumnPicker, check_problem_file, json_object,
                                        problem_files, read_records, resolve_problem_file)
from jaxagent.rewards import extract_gsm8k
from jaxagent.tools.search import Document

__all__ = ["ARRAY_RECORD_SUFFIXES", "JSONL_SUFFIXES", "MISSING", "PARQUET_SUFFIXES", "SUFFIXES",
           "Problem", "check_problem_file", "lookup", "missing_key", "problem_files",
           "raise_bad_records", "read_documents", "read_objects", "read_problems",
           "resolve_problem_file"]

_MAX_LISTED = 5  # bad records spelt out in one error; the rest are counted


@dataclasses.dataclass(frozen=True)
class Problem:
  """One record: its question, its gold answer(s) as text, and where it is in the file."""

  question: str
  gold: str | tuple[str, ...]
  index: int  # JSONL: line number (from 1); ArrayRecord, Parquet: record index (from 0)
  where: str  # "train.jsonl line 3", "test.array_record record 0", "train.parquet record 0"
  record: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # as read
  file: int | None = None  # a glob pattern's files: which one (from 0, sorted); None: one path

  @property
  def key(self) -> str:
    """The record's name, unique among the records of one file setting: its index ("3"), or
    for a glob pattern's files the file's position and the index ("1-3")."""
    return str(self.index) if self.file is None else f"{self.file}-{self.index}"


def read_problems(path: str | os.PathLike, *, question_key: str = "question",
                  answer_key: str | tuple[str, ...] = "answer", owner: str = "MathToolEnv",
                  setting: str = "train_file", gsm8k_answers: bool = True,
                  files: Sequence[pathlib.Path] | None = None,
                  record_keys: Sequence[str] | None = None,
                  required_keys: Mapping[str, str] | None = None) -> list[Problem]:
  """The problems of a JSONL, ArrayRecord or Parquet file, in file order.

  Args:
    question_key, answer_key: the record's keys of the question and of its answer; a tuple of
      answer keys takes the first one a record has (`("answers", "answer")`); a dotted key
      reads inside an object (`"answers.text"` for SQuAD, `"answer.aliases"` for TriviaQA,
      `"reward_model.ground_truth"` for a verl Parquet file). A question that is a list of chat
      messages (verl's `prompt` column: the dataset's instructions around the question) is an
      error naming the record's plain question key (`"extra_info.question"`).
    owner, setting: named in errors as `owner.setting` (and `owner.question_key`, ...), the
      settings a user would change.
    gsm8k_answers: a text answer with a `####` marker gives the text after it (False: every
      answer is kept as written, stripped).
    files: the files `path` names, as `resolve_problem_file` gave them earlier (an env resolves a
      glob pattern once, at construction, and reads and hides exactly those files); None:
      resolved here.
    record_keys: the keys each `Problem.record` keeps besides the question and answer keys (a
      solution key, a titles key); a record without one of them is kept whole, for its error.
      A Parquet file is then read only in the columns these keys are in (a dotted key's
      top-level column): a math set's large `generations` column is never decoded; the other
      columns are in each record by name only (placeholder values), so an error still lists
      them and finds a key inside an object (`extra_info.question`). None keeps every record
      whole, every column read: a file with large other columns is then held in memory whole
      until the caller drops the problems.
    required_keys: {key: the setting that names it} of the `record_keys` every record must have
      (SearchQAEnv's `{titles_key: "titles_key"}`): a Parquet file with no column for one is a
      single error before any row is read, as for the question and answer keys (a JSONL or
      ArrayRecord record without one is the caller's error, per record).
  """
  out: list[Problem] = []
  bad: list[str] = []
  answer_keys = (answer_key,) if isinstance(answer_key, str) else tuple(answer_key)
  needed = None if record_keys is None else (question_key, *answer_keys, *record_keys)

  wanted = [((question_key,), "question_key"), (answer_keys, "answer_key"),
            *(((k,), name) for k, name in (required_keys or {}).items())]

  def check(schema: dict, what: str) -> None:
    """A Parquet file without the question's column (or any answer's, or a required key's) is
    one error up front, not one per row."""
    missing = _missing_key(schema, wanted, owner, what, columns=True)
    if missing is not None:
      raise missing
  columns = _columns_of(needed, check)
  for file, index, where, raw in read_records(path, f"{owner}.{setting}", columns, files,
                                              name_unread=True):
    try:
      problem = _problem(raw, index, where, question_key, answer_key, owner, gsm8k_answers)
      out.append(dataclasses.replace(problem, file=file, record=problem.record
                                     if record_keys is None else _trimmed(
                                         problem.record, question_key, answer_key, record_keys)))
    except ValueError as e:
      bad.append(str(e))
  raise_bad_records(bad, len(bad) + len(out), f"{owner}.{setting}={os.fspath(path)!r}")
  if not out:
    raise ValueError(f"{owner}.{setting}={os.fspath(path)!r}: the file holds no problems; give "
                     f"one JSON object per problem with a {question_key!r} and an "
                     f"{answer_key!r} key")
  return out


def _columns_of(keys: Sequence[str] | None,
                check: Callable[[dict, str], None] | None = None) -> ColumnPicker | None:
  """The Parquet columns to read for records of which only `keys` are read: a key's column,
  or a dotted key's top-level column (`reward_model` for `reward_model.ground_truth`); every
  column when `keys` is None. `check(schema, what)` first raises for a file without a column
  every record needs (see `ColumnPicker`). None (every column, nothing checked) when both are
  None."""
  if keys is None and check is None:
    return None

  def columns(schema: dict, what: str) -> list[str]:
    if check is not None:
      check(schema, what)
    if keys is None:
      return list(schema)
    tops = {k if k in schema else k.split(".", 1)[0] for k in keys}
    return [n for n in schema if n in tops]
  return columns


def _trimmed(record: dict, question_key: str, answer_key: str | Sequence[str],
             record_keys: Sequence[str]) -> dict:
  """`record` with only the top-level entries that hold the question, answer and `record_keys`
  keys (a dotted key keeps its outer object); whole when one of `record_keys` is missing."""
  if any(lookup(record, k) is MISSING for k in record_keys):
    return record
  answer_keys = (answer_key,) if isinstance(answer_key, str) else tuple(answer_key)
  tops = {k if k in record else k.split(".", 1)[0]
          for k in (question_key, *answer_keys, *record_keys)}
  return {k: v for k, v in record.items() if k in tops}


def raise_bad_records(bad: list[str], total: int, what: str, noun: str = "record") -> None:
  """A ValueError listing the first few of `bad` (one message per bad record) out of `total`,
  headed by `what` ("MathToolEnv.train_file='t.jsonl'"); nothing when `bad` is empty."""
  if not bad:
    return
  listed = "\n  ".join(bad[:_MAX_LISTED])
  more = f"\n  ... and {len(bad) - _MAX_LISTED} more" if len(bad) > _MAX_LISTED else ""
  raise ValueError(f"{what}: {len(bad)} bad {noun}{'s' if len(bad) > 1 else ''} (of {total}); "
                   f"fix or remove them:\n  {listed}{more}")


def read_objects(path: str | os.PathLike, parse: Callable[[dict, int, str], Any], *,
                 owner: str, setting: str, expected: str,
                 files: Sequence[pathlib.Path] | None = None,
                 keys: Sequence[str] | None = None, required: Sequence[str] = ()) -> list:
  """`parse(record, index, where)` of each JSON object record of a JSONL or ArrayRecord file (or
  each row of a Parquet file, as a dict of its columns), in file order. A record that is not a
  JSON object, or that `parse` refuses with a ValueError, is named with its message in one error;
  an empty file is an error too.

  Args:
    expected: what a record holds, for the errors ("with 'task_id', 'prompt' ... keys").
    files: the files `path` names, resolved earlier (see `read_problems`); None: resolved here.
    keys: the only keys `parse` reads (a dotted key reads inside an object): a Parquet file is
      then read only in their columns (a dotted key's top-level column), and its other columns
      are in each row by name only, with placeholder values ("" for text, None otherwise), so a
      missing key's error still lists every column the file has. None: every column is read.
    required: the keys every record must have (`parse` names a record without one): a Parquet
      file without the column of one is a single error up front, naming the key and the file's
      columns, not one error per row.
  """
  out, bad, total = [], [], 0

  def check(schema: dict, what: str) -> None:
    for key in required:
      if lookup(schema, key) is MISSING:
        raise missing_key(schema, key, what, f"a record is a JSON object {expected}",
                          columns=True)
  columns = _columns_of(keys, check if required else None)
  for _, index, where, raw in read_records(path, f"{owner}.{setting}", columns, files,
                                           name_unread=True):
    total += 1
    try:
      out.append(parse(json_object(raw, where, expected), index, where))
    except ValueError as e:
      bad.append(str(e))
  raise_bad_records(bad, total, f"{owner}.{setting}={os.fspath(path)!r}")
  if not out:
    raise ValueError(f"{owner}.{setting}={os.fspath(path)!r}: the file holds no records; give "
                     f"one JSON object a record, {expected}")
  return out


def missing_key(record: dict, key: str, where: str, hint: str, columns: bool = False
                ) -> ValueError:
  """The error for a record without `key`: the keys it has, and a close one if any (`hint`:
  what to do otherwise). `columns`: `record` is a Parquet file's columns, and the error says
  that the file has no such column."""
  keys = sorted(map(str, record))
  close = difflib.get_close_matches(key, keys, n=1)
  has = (f"no record can have a {key!r} key, the file has no such column: its columns are "
         f"{keys}" if columns else f"no {key!r} key; the record has {keys}")
  return ValueError(f"{where}: {has}" + (f"; did you mean {close[0]!r}?" if close
                                          else f"; {hint}"))


def read_documents(path: str | os.PathLike, *, owner: str, setting: str = "corpus_file",
                   files: Sequence[pathlib.Path] | None = None) -> list[Document]:
  """The documents of a JSONL, ArrayRecord or Parquet corpus, in file order: each record a JSON
  object (a Parquet row) `{"title": ..., "text": ..., "id"?: ...}` (title optional; a record
  without "id" gets its position among the documents), or `{"id"?: ..., "contents": ...}` as
  Search-R1's and FlashRAG's corpora hold them, whose first line is the title (its surrounding
  double quotes dropped) and the rest the text. Other keys (a Wikipedia dump's "url",
  "wiki_id", ...) are ignored; a Parquet file's other columns are not read. A bad record (not
  JSON, no "text", a key that looks like a misspelt field such as "txt" or "titel", a title or
  text that is not text, an id another record has) is named by file and line or record index.
  `files`: the files `path` names, resolved earlier (see `read_problems`); None: resolved here."""
  from jaxagent.tools.search import _as_document, misspelt_fields

  def columns(schema: dict, what: str) -> list[str]:
    """A Parquet corpus's columns to read: the document's and any misspelt one (named below)."""
    names = list(schema)
    misspelt = misspelt_fields(names)  # once: it compares every column with every field
    if "text" not in names and "contents" not in names:
      hint = "".join(f"; {k!r} looks like a misspelt {f!r}: rename it"
                     for k, f in misspelt.items() if f == "text")
      raise ValueError(f"{what}: no 'text' (or 'contents') column; the file's columns are "
                       f"{names}{hint}")
    return [n for n in names if n in ("title", "text", "id", "contents") or n in misspelt]

  def parsed() -> Iterator[tuple[str, Document | None, str | None]]:
    """(where, document, what is wrong or None) of each record; "duplicate" for a document
    whose id an earlier one has. Ids are kept in a set only (no location per document); where
    the first of a duplicate id was is found by a second read, on a duplicate only."""
    seen: set[str] = set()
    for _, _, where, raw in read_records(path, f"{owner}.{setting}", columns, files):
      try:
        record = json_object(raw, where, "with 'title' and 'text' keys")
        if "contents" in record and not {"title", "text"} & set(record):
          record = _from_contents(record, where)
        try:
          doc = _as_document(record, len(seen))
        except (TypeError, ValueError) as e:  # "document 3 has no 'text' field (fields: [...])"
          raise ValueError(f"{where}: {re.sub(r'^document [0-9]+:? ?', '', str(e))}") from None
      except ValueError as e:
        yield where, None, str(e)
        continue
      if doc.id in seen:
        yield where, doc, "duplicate"
        continue
      seen.add(doc.id)
      yield where, doc, None

  docs: list[Document] = []
  bad: list[str] = []
  duplicates: list[tuple[int, str, str]] = []  # (place in bad, id, where)
  total = 0
  for where, doc, wrong in parsed():
    total += 1
    if wrong == "duplicate":
      duplicates.append((len(bad), doc.id, where))
      bad.append("")
    elif wrong is not None:
      bad.append(wrong)
    else:
      docs.append(doc)
  if duplicates:
    firsts: dict[str, str] = {}
    wanted = {d for _, d, _ in duplicates}
    for where, doc, wrong in parsed():
      if wrong is None and doc.id in wanted and doc.id not in firsts:
        firsts[doc.id] = where
        if len(firsts) == len(wanted):
          break
    for place, doc_id, where in duplicates:
      bad[place] = (f"{where}: the id {doc_id!r} is the id of {firsts[doc_id]} too; ids must "
                    "be unique")
  raise_bad_records(bad, total, f"{owner}.{setting}={os.fspath(path)!r}")
  if not docs:
    raise ValueError(f"{owner}.{setting}={os.fspath(path)!r}: the file holds no documents; give "
                     "one JSON object per document with a 'title' and a 'text' key")
  return docs


def _from_contents(record: dict, where: str) -> dict:
  """A `{"id"?, "contents": "\"Title\"\nText"}` record as `{"id"?, "title", "text"}`."""
  contents = record["contents"]
  if not isinstance(contents, str):
    raise ValueError(f"{where}: 'contents' must be text, got {type(contents).__name__}")
  title, _, text = contents.partition("\n")
  title = title.strip()
  if len(title) >= 2 and title[0] == title[-1] == '"':
    title = title[1:-1]
  return {**{k: v for k, v in record.items() if k != "contents"}, "title": title, "text": text}


def _problem(raw: str | bytes | dict, index: int, where: str, question_key: str,
             answer_key: str | tuple[str, ...], owner: str, gsm8k_answers: bool = True
             ) -> Problem:
  answer_keys = (answer_key,) if isinstance(answer_key, str) else tuple(answer_key)
  shown = answer_keys[0] if len(answer_keys) == 1 else " or ".join(map(repr, answer_keys))
  record = json_object(raw, where, f"with {question_key!r} and {shown!r} keys"
                        if len(answer_keys) == 1 else f"with {question_key!r} and {shown} keys")
  present = [k for k in answer_keys if lookup(record, k) is not MISSING]
  missing = _missing_key(record, (((question_key,), "question_key"),
                                  (answer_keys, "answer_key")), owner, where)
  if missing is not None:
    raise missing
  answer_key = present[0]
  question = lookup(record, question_key)
  if (isinstance(question, list) and question
      and all(isinstance(m, dict) and "content" in m for m in question)):
    # verl / Search-R1 parquet files: "prompt" is the chat sent to the model, with the dataset's
    # own instructions around the question; the task writes its own prompt.
    plain = [k for k in _text_keys(record) if k.rsplit(".", 1)[-1] in ("question", "problem")]
    raise ValueError(f"{where}: the question ({question_key!r}) is a list of chat messages "
                     "(a prompt with its dataset's instructions), not the question's text; set "
                     f"{owner}.question_key to the key of the plain question"
                     + (f", e.g. {plain[0]!r}" if plain else
                        f" (the record has {sorted(map(str, record))})"))
  if not isinstance(question, str):
    raise ValueError(f"{where}: the question ({question_key!r}) must be text, got "
                     f"{type(question).__name__} {question!r:.60}")
  if not question.strip():
    raise ValueError(f"{where}: the question ({question_key!r}) is empty")
  answer = lookup(record, answer_key)
  if isinstance(answer, dict):  # SQuAD's {"text": [...], ...}, TriviaQA's {"aliases": [...]}
    inside = [f"{answer_key}.{k}" for k, v in answer.items() if isinstance(v, (str, list))]
    raise ValueError(f"{where}: the answer ({answer_key!r}) must be a number, text or a list "
                     f"of them, got dict with keys {sorted(map(str, answer))}; a dotted "
                     f"{owner}.answer_key reads inside it"
                     + (f", e.g. {inside[0]!r}" if inside else ""))
  answers = answer if isinstance(answer, list) else [answer]
  if not answers:
    raise ValueError(f"{where}: the answer ({answer_key!r}) is an empty list")
  golds = tuple(_gold(a, where, answer_key, gsm8k_answers) for a in answers)
  return Problem(question=question.strip(), gold=golds if isinstance(answer, list) else golds[0],
                 index=index, where=where, record=record)


def _missing_key(record: dict, wanted: Sequence[tuple[tuple[str, ...], str]], owner: str,
                 where: str, columns: bool = False) -> ValueError | None:
  """The error for a record without any key of one of `wanted`'s (keys, setting name) pairs
  (the question key; the answer keys, the first one present read): the keys it has and a close
  one if any; None when it has them all. `columns`: `record` is a Parquet file's columns
  (placeholder values), and the error speaks of the file's columns."""
  for keys_wanted, name in wanted:
    if all(lookup(record, k) is MISSING for k in keys_wanted):
      # A dotted key ("answers.text") whose outer part is there: the keys inside it.
      prefix, inner = "", record
      if len(keys_wanted) == 1 and "." in keys_wanted[0] and keys_wanted[0] not in record:
        *outer, _ = keys_wanted[0].split(".")
        node = lookup(record, ".".join(outer))
        if isinstance(node, dict):
          prefix, inner = ".".join(outer) + ".", node
      keys = sorted(map(str, inner))
      close = [prefix + c for k in keys_wanted
               for c in difflib.get_close_matches(k[len(prefix):], keys, n=1)][:1]
      if not close and not prefix:  # verl's extra_info.question: the key inside an object
        close = [k for k in _leaf_keys(record) if k.rsplit(".", 1)[-1] in keys_wanted][:1]
      hint = (f"; did you mean {close[0]!r}? (set {owner}.{name}={close[0]!r})" if close
              else f"; set {owner}.{name} to the key that holds it")
      wanted = " / ".join(map(repr, keys_wanted))
      if columns:
        has = (f"no such field: the file's {prefix[:-1]!r} column has the fields" if prefix
               else "no such column: the file's columns are")
        return ValueError(f"{where}: no record can have a {wanted} key ({owner}.{name}), the "
                          f"file has {has} {keys}{hint}")
      has = f"the record's {prefix[:-1]!r} has" if prefix else "the record has"
      return ValueError(f"{where}: no {wanted} key ({owner}.{name}); {has} {keys}{hint}")
  return None


MISSING = object()  # what `lookup` returns for a key a record does not have


def _leaf_keys(record: dict, prefix: str = "") -> Iterator[str]:
  """The (dotted) keys of `record`'s values that are not objects, objects inside it included."""
  for k, v in record.items():
    if isinstance(v, dict):
      yield from _leaf_keys(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}"


def _text_keys(record: dict) -> Iterator[str]:
  """The (dotted) keys of `record`'s text values, objects inside it included."""
  return (k for k in _leaf_keys(record) if isinstance(lookup(record, k), str))


def lookup(record: dict, key: str) -> Any:
  """`record[key]`, or for a dotted key the nested value (`"answers.text"`: SQuAD's
  `{"answers": {"text": [...]}}`); `MISSING` when absent."""
  if key in record:
    return record[key]
  node: Any = record
  for part in key.split("."):
    if not isinstance(node, dict) or part not in node:
      return MISSING
    node = node[part]
  return node


def _gold(answer: Any, where: str, answer_key: str, gsm8k_answers: bool = True) -> str:
  """An answer as the text math-verify compares: a number as written, a GSM8K worked answer as
  its final line after `####`."""
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
    raise ValueError(f"{where}: the answer ({answer_key!r}) must be a number, text or a list of "
                     f"them, got {type(answer).__name__} {answer!r:.60}")
  if isinstance(answer, float) and not math.isfinite(answer):
    raise ValueError(f"{where}: the answer ({answer_key!r}) is {answer}, not a finite number")
  if not isinstance(answer, str):
    return str(answer)
  if gsm8k_answers and "####" in answer:
    final = extract_gsm8k(answer)
    if final is None:
      raise ValueError(f"{where}: the answer ({answer_key!r}) has a '####' marker with no final "
                       "answer after it")
    return final
  if not answer.strip():
    raise ValueError(f"{where}: the answer ({answer_key!r}) is empty")
  return answer.strip()
