"""Math problems from a file of your own: one JSON object per problem, a question and its answer.

`MathToolEnv(train_file=..., eval_file=...)` reads a split here in place of its built-in source
(`jaxagent/envs/math_tool.py` turns each `Problem` into an `Example`). Two formats, picked by
the file's suffix:

* JSONL (`.jsonl`): one JSON object a line; blank lines are skipped, and a record is named by
  its line number (from 1).
* ArrayRecord (`.array_record`, `.arrayrecord`): each record is a JSON object as UTF-8 bytes,
  read with grain's `ArrayRecordDataSource`; a record is named by its index (from 0). Write one
  with `array_record`'s `ArrayRecordWriter(path, "group_size:1").write(json.dumps(obj).encode())`.

The question is text. The answer is a number, text, or a list of them (several accepted
answers); a GSM8K answer with worked steps ("... = 72 clips\\n#### 72") gives its final answer,
the text after the last `####`. No record is dropped: every bad one is an error that names the
file, the line or record, and what is wrong (the keys a record has when the key is missing); an
empty file is an error too.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import pathlib
import re
from typing import Any, Iterator

from jaxagent.rewards import extract_gsm8k

JSONL_SUFFIXES = (".jsonl",)
ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")
SUFFIXES = JSONL_SUFFIXES + ARRAY_RECORD_SUFFIXES
_MAX_LISTED = 5  # bad records spelt out in one error; the rest are counted


@dataclasses.dataclass(frozen=True)
class Problem:
  """One record: its question, its gold answer(s) as text, and where it is in the file."""

  question: str
  gold: str | tuple[str, ...]
  index: int  # JSONL: line number (from 1); ArrayRecord: record index (from 0)
  where: str  # "train.jsonl line 3", "test.array_record record 0"


def check_problem_file(path: Any, setting: str) -> pathlib.Path:
  """`path` ("~" expanded) as an existing local file of a known format, or a ValueError that
  names `setting` (e.g. "MathToolEnv.train_file")."""
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise ValueError(f"{setting} must be the path of a problem file, got {path!r}")
  text = os.fspath(path)
  if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:/", text):
    raise ValueError(f"{setting} must be a local file, got the URL {text!r}; copy the file to "
                     "a local disk first")
  p = pathlib.Path(text).expanduser()
  if not p.name.lower().endswith(SUFFIXES):
    raise ValueError(f"{setting}={text!r}: unknown file format (suffix {p.suffix!r}); a problem "
                     f"file is JSONL ({', '.join(JSONL_SUFFIXES)}: one JSON object a line) or "
                     f"ArrayRecord ({', '.join(ARRAY_RECORD_SUFFIXES)}: one JSON object a "
                     "record)")
  if not p.exists():
    raise ValueError(f"{setting}={text!r}: no such file")
  if not p.is_file():
    raise ValueError(f"{setting}={text!r} is not a file")
  return p


def read_problems(path: str | os.PathLike, *, question_key: str = "question",
                  answer_key: str = "answer", owner: str = "MathToolEnv",
                  setting: str = "train_file") -> list[Problem]:
  """The problems of a JSONL or ArrayRecord file, in file order.

  Args:
    question_key, answer_key: the record's keys of the question and of its answer.
    owner, setting: named in errors as `owner.setting` (and `owner.question_key`, ...), the
      settings a user would change.
  """
  p = check_problem_file(path, f"{owner}.{setting}")
  out: list[Problem] = []
  bad: list[str] = []
  for index, where, raw in _records(p, f"{owner}.{setting}"):
    try:
      out.append(_problem(raw, index, where, question_key, answer_key, owner))
    except ValueError as e:
      bad.append(str(e))
  if bad:
    listed = "\n  ".join(bad[:_MAX_LISTED])
    more = f"\n  ... and {len(bad) - _MAX_LISTED} more" if len(bad) > _MAX_LISTED else ""
    raise ValueError(f"{owner}.{setting}={os.fspath(path)!r}: {len(bad)} bad record"
                     f"{'s' if len(bad) > 1 else ''} (of {len(bad) + len(out)}); fix or remove "
                     f"them:\n  {listed}{more}")
  if not out:
    raise ValueError(f"{owner}.{setting}={os.fspath(path)!r}: the file holds no problems; give "
                     f"one JSON object per problem with a {question_key!r} and an "
                     f"{answer_key!r} key")
  return out


def _records(p: pathlib.Path, setting: str) -> Iterator[tuple[int, str, str | bytes]]:
  """(index, where, raw text) of each record of the file."""
  if p.name.lower().endswith(JSONL_SUFFIXES):
    try:
      # utf-8-sig: a byte-order mark (some editors write one) is not part of the first record.
      with open(p, encoding="utf-8-sig") as f:
        # Split at "\n" only: a JSON string may hold a raw U+2028, which splitlines() breaks at.
        lines = f.read().split("\n")
    except UnicodeDecodeError as e:
      raise ValueError(f"{setting}={os.fspath(p)!r}: not UTF-8 text ({e})") from e
    for n, line in enumerate(lines, 1):
      if line.strip():
        yield n, f"{p.name} line {n}", line
    return
  from grain.sources import ArrayRecordDataSource
  try:
    source = ArrayRecordDataSource(os.fspath(p))
    n = len(source)
  except Exception as e:  # noqa: BLE001 - a file that is not ArrayRecord fails inside the reader
    raise ValueError(f"{setting}={os.fspath(p)!r}: cannot read it as an ArrayRecord file "
                     f"({type(e).__name__}: {e})") from e
  for i in range(n):
    yield i, f"{p.name} record {i}", source[i]


def _problem(raw: str | bytes, index: int, where: str, question_key: str, answer_key: str,
             owner: str) -> Problem:
  if isinstance(raw, bytes):
    try:
      raw = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{where}: not UTF-8 JSON text ({e})") from e
  try:
    record = json.loads(raw)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: not JSON ({e.msg} at column {e.colno})") from e
  if not isinstance(record, dict):
    raise ValueError(f"{where}: a record must be a JSON object with {question_key!r} and "
                     f"{answer_key!r} keys, got {type(record).__name__}")
  for key, name in ((question_key, "question_key"), (answer_key, "answer_key")):
    if key not in record:
      keys = sorted(map(str, record))
      close = difflib.get_close_matches(key, keys, n=1)
      hint = (f"; did you mean {close[0]!r}? (set {owner}.{name}={close[0]!r})" if close
              else f"; set {owner}.{name} to the key that holds it")
      raise ValueError(f"{where}: no {key!r} key ({owner}.{name}); the record has {keys}{hint}")
  question = record[question_key]
  if not isinstance(question, str):
    raise ValueError(f"{where}: the question ({question_key!r}) must be text, got "
                     f"{type(question).__name__} {question!r:.60}")
  if not question.strip():
    raise ValueError(f"{where}: the question ({question_key!r}) is empty")
  answer = record[answer_key]
  answers = answer if isinstance(answer, list) else [answer]
  if not answers:
    raise ValueError(f"{where}: the answer ({answer_key!r}) is an empty list")
  golds = tuple(_gold(a, where, answer_key) for a in answers)
  return Problem(question=question.strip(), gold=golds if isinstance(answer, list) else golds[0],
                 index=index, where=where)


def _gold(answer: Any, where: str, answer_key: str) -> str:
  """An answer as the text math-verify compares: a number as written, a GSM8K worked answer as
  its final line after `####`."""
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
    raise ValueError(f"{where}: the answer ({answer_key!r}) must be a number, text or a list of "
                     f"them, got {type(answer).__name__} {answer!r:.60}")
  if isinstance(answer, float) and not math.isfinite(answer):
    raise ValueError(f"{where}: the answer ({answer_key!r}) is {answer}, not a finite number")
  if not isinstance(answer, str):
    return str(answer)
  if "####" in answer:
    final = extract_gsm8k(answer)
    if final is None:
      raise ValueError(f"{where}: the answer ({answer_key!r}) has a '####' marker with no final "
                       "answer after it")
    return final
  if not answer.strip():
    raise ValueError(f"{where}: the answer ({answer_key!r}) is empty")
  return answer.strip()
