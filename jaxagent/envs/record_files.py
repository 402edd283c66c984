"""The file formats of problem and document files: which files a file setting names (a path
or a glob pattern of shards), and their records one at a time, as text or a Parquet row.

`jaxagent/envs/problem_file.py` turns these records into problems and documents (the envs
import both through it); this module knows only the formats, picked by the file's suffix:

* JSONL (`.jsonl`, or gzip-compressed `.jsonl.gz`): one JSON object a line, read line by line;
  blank lines are skipped, and a record is named by its line number (from 1).
* ArrayRecord (`.array_record`, `.arrayrecord`): each record a JSON object as UTF-8 bytes, read
  with grain's `ArrayRecordDataSource` a batch of records at a time; named by its index (from 0).
* Parquet (`.parquet`): each row a record (a dict of its columns), read with pyarrow one record
  batch at a time and only in the columns asked for; named by its row index (from 0).

A file that cannot be read as its format says (a damaged gzip stream, UTF-16 text, an indented
JSON document in a .jsonl file, an empty or damaged ArrayRecord or Parquet file) is a ValueError
that names the setting and the file.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import pathlib
import re
import zlib
from typing import Any, Callable, Iterator, Sequence

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")
PARQUET_SUFFIXES = (".parquet",)
SUFFIXES = JSONL_SUFFIXES + ARRAY_RECORD_SUFFIXES + PARQUET_SUFFIXES


def check_problem_file(path: Any, setting: str) -> pathlib.Path:
  """`path` ("~" expanded) as an existing local file of a known format, or a ValueError that
  names `setting` (e.g. "MathToolEnv.train_file").

  A glob pattern (`/data/nq/train-*.parquet`: a split sharded into several files) comes back as
  the pattern, once it matches at least one file and all its files are of one format; read its
  files with `problem_files`. A path that names an existing file is that file, even with glob
  characters in its name."""
  return resolve_problem_file(path, setting)[0]


def problem_files(path: Any, setting: str) -> tuple[pathlib.Path, ...]:
  """The files `path` names, in the order they are read: the file itself, or a glob pattern's
  matching files sorted by path (`train-00000-of-00004.parquet`, `train-00001-...`). A pattern
  that matches nothing, matches files of different formats (JSONL with Parquet) or a directory,
  is a ValueError naming `setting` and the pattern."""
  return resolve_problem_file(path, setting)[1]


def resolve_problem_file(path: Any, setting: str
                         ) -> tuple[pathlib.Path, tuple[pathlib.Path, ...]]:
  """(`check_problem_file(path)`, `problem_files(path)`) with a glob pattern expanded, and each
  of its files checked, once: what an env keeps when it is built, to read and hide exactly
  those files later."""
  text = _check_path_text(path, setting)
  p = pathlib.Path(text).expanduser()
  if not _is_pattern(text) or p.exists():
    one = _check_one_file(p, text, setting)
    return one, (one,)
  matches = sorted(glob.glob(os.fspath(p), recursive=True))
  if not matches:
    raise ValueError(f"{setting}={text!r}: the glob pattern matches no file{_relative(p)}; "
                     "check the directory and the pattern (shards of a split: 'train-*.parquet')")
  files = tuple(_check_one_file(pathlib.Path(m), f"{text!r} matches {m!r}", setting, shown=True)
                for m in matches)
  formats = {}
  for f in files:
    formats.setdefault(_format(f), f.name)
  if len(formats) > 1:
    listed = ", ".join(f"{fmt} ({name})" for fmt, name in formats.items())
    raise ValueError(f"{setting}={text!r}: the pattern matches files of {len(formats)} formats: "
                     f"{listed}; all files of a pattern must be of one format: narrow the "
                     "pattern to one suffix (e.g. '*.parquet')")
  return p, files


def _check_path_text(path: Any, setting: str) -> str:
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise ValueError(f"{setting} must be the path of a problem file, got {path!r}")
  text = os.fspath(path)
  if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:/", text):
    raise ValueError(f"{setting} must be a local file, got the URL {text!r}; copy the file to "
                     "a local disk first")
  return text


def _relative(p: pathlib.Path) -> str:
  """For a relative path, the directory it was looked up in (the process's working directory,
  not the config file's), as a note for a not-found error."""
  return "" if p.is_absolute() else f" (a relative path, looked up in {os.getcwd()!r})"


def _is_pattern(text: str) -> bool:
  return any(c in text for c in "*?[")


def _suffix(name: str) -> str:
  return next(s for s in SUFFIXES if name.lower().endswith(s))


def _format(p: pathlib.Path) -> str:
  name = p.name.lower()
  return ("JSONL" if name.endswith(JSONL_SUFFIXES) else
          "ArrayRecord" if name.endswith(ARRAY_RECORD_SUFFIXES) else "Parquet")


def _check_one_file(p: pathlib.Path, text: str, setting: str, shown: bool = False
                    ) -> pathlib.Path:
  """`p` as an existing file of a known format; errors say `setting={text!r}` (`shown`: `text`
  is already written as the errors should show it)."""
  what = f"{setting}={text}" if shown else f"{setting}={text!r}"
  if not p.name.lower().endswith(SUFFIXES):
    raise ValueError(f"{what}: unknown file format (suffix {p.suffix!r}); a problem "
                     f"file is JSONL ({', '.join(JSONL_SUFFIXES)}: one JSON object a line), "
                     f"ArrayRecord ({', '.join(ARRAY_RECORD_SUFFIXES)}: one JSON object a "
                     f"record) or Parquet ({', '.join(PARQUET_SUFFIXES)}: one row a record)")
  if not p.exists():
    raise ValueError(f"{what}: no such file{_relative(p)}")
  if p.is_dir():  # a Parquet data set written in parts (Spark, Dask) has a .parquet folder
    raise ValueError(f"{what} is not a file but a directory; give one file, or for a data "
                     "set split into several files, such as Parquet parts or shards, a glob "
                     f"pattern of its files ({os.path.join(p, '*' + _suffix(p.name))!r})")
  if not p.is_file():
    raise ValueError(f"{what} is not a file")
  return p


# Picks the columns of a Parquet file to read, before any row is read: called with the file's
# columns as one row of placeholder values (`_placeholder`: an object column holds its fields,
# so a dotted key can be looked up in it) and the file as its errors name it
# ("MathToolEnv.train_file='/d/train.parquet'"); returns the names of the columns to read, or
# raises a ValueError for a file that lacks a column every record needs (one error for the
# file, not one per row).
ColumnPicker = Callable[[dict, str], Sequence[str]]


def json_object(raw: str | bytes | dict, where: str, expected: str) -> dict:
  """A record's text parsed as a JSON object, or a ValueError naming `where`."""
  if isinstance(raw, dict):  # a Parquet row
    return raw
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
    if isinstance(record, list) and record and all(isinstance(r, dict) for r in record):
      got = (f"an array of {len(record)} objects: each object is a record of its own (in JSONL, "
             "one a line)")
    else:  # in JSON's words, as the file has it: null, not NoneType
      text = json.dumps(record)
      got = (f"{_JSON_KINDS.get(type(record), 'a')} "
             f"{text if len(text) <= 60 else text[:57] + '...'}").lstrip()
    raise ValueError(f"{where}: a record must be a JSON object {expected}, got {got}")
  return record


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "", type(None): ""}  # true, false and null say what they are


def read_records(path: Any, setting: str,
                 columns: ColumnPicker | None = None,
                 files: Sequence[pathlib.Path] | None = None, name_unread: bool = False
                 ) -> Iterator[tuple[int | None, int, str, str | bytes | dict]]:
  """(file, index, where, raw) of each record of the file `path` names, or of each file of a
  glob pattern one after another (`file`: its position among them; None for a plain path);
  `files`: those files as resolved earlier (None: `problem_files` here); `name_unread`: see
  `_parquet_records`."""
  files = problem_files(path, setting) if files is None else tuple(files)
  single = len(files) == 1 and not (_is_pattern(os.fspath(path))
                                    and not pathlib.Path(os.fspath(path)).expanduser().exists())
  for k, p in enumerate(files):
    for index, where, raw in file_records(p, setting, columns, name_unread):
      yield (None if single else k), index, where, raw


def file_records(p: pathlib.Path, setting: str,
                 columns: ColumnPicker | None = None,
                 name_unread: bool = False) -> Iterator[tuple[int, str, str | bytes | dict]]:
  """(index, where, raw text) of each record of the file; a Parquet row comes as a dict of its
  columns (only those `columns` picks, when given: see `ColumnPicker`)."""
  name = p.name.lower()
  try:
    size = p.stat().st_size
  except OSError as e:
    raise _cannot_open(p, setting, e) from e
  if not name.endswith(JSONL_SUFFIXES) and size == 0:
    raise ValueError(f"{setting}={os.fspath(p)!r}: the file is empty (0 bytes), with no "
                     f"{_format(p)} data ({_FORMAT_RECORDS[_format(p)]}); write or copy it again")
  if name.endswith(PARQUET_SUFFIXES):
    yield from _parquet_records(p, setting, columns, name_unread)
    return
  if name.endswith(JSONL_SUFFIXES):
    yield from _jsonl_records(p, setting)
    return
  from grain.sources import ArrayRecordDataSource
  try:
    source = ArrayRecordDataSource(os.fspath(p))
    n = len(source)
  except Exception as e:  # noqa: BLE001 - a file that is not ArrayRecord fails inside the reader
    raise ValueError(f"{setting}={os.fspath(p)!r}: cannot read it as an ArrayRecord file "
                     f"({type(e).__name__}: {e})") from e
  # A batch of records a read: one record a read took 72 s for 200k records (1.7 s batched).
  read = getattr(source, "__getitems__", None) or (lambda keys: [source[k] for k in keys])
  for start in range(0, n, _ARRAY_RECORD_BATCH):
    stop = min(start + _ARRAY_RECORD_BATCH, n)
    try:
      batch = read(list(range(start, stop)))
    except Exception as e:  # noqa: BLE001 - a damaged chunk fails inside the reader
      raise ValueError(f"{setting}={os.fspath(p)!r}: cannot read records {start}-{stop - 1} of "
                       f"{n}, the ArrayRecord file is damaged ({type(e).__name__}: {e}); write "
                       "it again") from e
    for i, raw in enumerate(batch, start):
      yield i, f"{p.name} record {i}", raw


_ARRAY_RECORD_BATCH = 1024
_FORMAT_RECORDS = {"JSONL": "one JSON object a line", "ArrayRecord": "one JSON object a record",
                   "Parquet": "one row a record"}


def _jsonl_records(p: pathlib.Path, setting: str) -> Iterator[tuple[int, str, str]]:
  """(line number, where, line) of each non-blank line of a JSONL or gzip-compressed JSONL file;
  a file that cannot be read as such is a ValueError saying what it looks like instead."""
  gz = p.name.lower().endswith(".gz")
  opener = gzip.open if gz else open
  what = f"{setting}={os.fspath(p)!r}"
  # Line by line (a corpus can be larger than memory twice over), split at "\n" only: a JSON
  # string may hold a raw U+2028, which splitlines() breaks at. utf-8-sig: a byte-order mark
  # (some editors write one) is not part of the first record.
  try:
    f = opener(p, "rt", encoding="utf-8-sig", newline="\n")
  except OSError as e:
    raise _cannot_open(p, setting, e) from e
  with f:
    n, seen = 0, False  # seen: a non-blank line
    while True:
      try:
        line = f.readline()
      except UnicodeDecodeError as e:
        hint = {"gzip": "; the file is gzip-compressed: name it .jsonl.gz",
                "UTF-16": "; the file is UTF-16 text (it starts with a UTF-16 byte-order mark): "
                          "save it as UTF-8"}.get("" if gz else _first_bytes_kind(p), "")
        raise ValueError(f"{what}: not UTF-8 text ({e}){hint}") from e
      except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        if _first_bytes_kind(p) != "gzip":
          raise ValueError(f"{what}: not a gzip file ({e}); a .jsonl.gz file is gzip-compressed "
                           "JSONL: name a plain JSONL file .jsonl") from e
        raise ValueError(f"{what}: a damaged or incomplete gzip file ({type(e).__name__}: {e}); "
                         "compress or download it again") from e
      if not line:
        return
      n += 1
      text = line.strip()
      if text in ("[", "{") and not seen:
        # Never a JSON value alone: the file is one indented JSON document, whose every line
        # would be a bad record of its own.
        raise ValueError(f"{what}: line {n} is {text!r} alone: the file is one JSON document "
                         "over many lines (an indented array or object), not JSONL; write each "
                         "record as one JSON object on a line of its own")
      if text:
        seen = True
        yield n, f"{p.name} line {n}", line


def _cannot_open(p: pathlib.Path, setting: str, e: OSError) -> ValueError:
  """The error for a file, found when its setting was checked, that cannot be opened now."""
  gone = ("; it was there when the setting was checked: was it moved or deleted since?"
          if isinstance(e, FileNotFoundError) else "")
  return ValueError(f"{setting}={os.fspath(p)!r}: cannot open the file ({type(e).__name__}: "
                    f"{e.strerror or e}){gone}")


def _first_bytes_kind(p: pathlib.Path) -> str:
  """What the first bytes of a file say it is: "gzip", "UTF-16" (a byte-order mark) or ""; read
  only for the error of a file that failed to decode."""
  with open(p, "rb") as f:
    head = f.read(2)
  return ("gzip" if head == b"\x1f\x8b" else
          "UTF-16" if head in (b"\xff\xfe", b"\xfe\xff") else "")


def _parquet_records(p: pathlib.Path, setting: str,
                     columns: ColumnPicker | None,
                     name_unread: bool = False) -> Iterator[tuple[int, str, dict]]:
  """(row index, where, row as a dict) of each row of a Parquet file, read one record batch at a
  time: a large file is never whole in memory as Python objects. `name_unread`: the columns
  `columns` leaves out are in each row too, with placeholder values (`_placeholder`)."""
  import pyarrow.parquet as pq

  def unreadable(e: Exception) -> ValueError:
    return ValueError(f"{setting}={os.fspath(p)!r}: cannot read it as a Parquet file "
                      f"({type(e).__name__}: {e})")

  try:
    f = pq.ParquetFile(p)
    names = f.schema_arrow.names
  except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... on a bad file
    raise unreadable(e) from e
  # Every column as a row of placeholder values (an object column's fields inside it): what
  # `columns` checks the file's keys against, before a single row is read.
  schema = {field.name: _placeholder(field.type) for field in f.schema_arrow}
  wanted = list(names if columns is None else columns(schema, f"{setting}={os.fspath(p)!r}"))
  # The columns not read are in every row by name, with their placeholders, so a record's error
  # lists them all and finds keys inside objects.
  read = set(wanted)
  unread = {k: v for k, v in schema.items() if k not in read} if name_unread else {}
  batches = f.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=wanted)
  i = 0
  while True:
    try:
      batch = next(batches, None)
    except Exception as e:  # noqa: BLE001 - a corrupt page fails when its batch is read
      raise unreadable(e) from e
    if batch is None:
      return
    for row in batch.to_pylist():
      yield i, f"{p.name} record {i}", {**unread, **row} if unread else row
      i += 1


_PARQUET_BATCH_ROWS = 1024


def _placeholder(arrow_type: Any) -> Any:
  """An unread Parquet column's value in a row: an object of its fields' placeholders for a
  struct column, "" for a text column (so it reads as a text key), None otherwise."""
  import pyarrow as pa

  if pa.types.is_struct(arrow_type):
    return {arrow_type.field(k).name: _placeholder(arrow_type.field(k).type)
            for k in range(arrow_type.num_fields)}
  return "" if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) else None
