"""Local BM25 search over a document corpus: `BM25Index` and the `SearchTool` wrapper.

Where this sits: the multi-hop search QA task (`jaxagent.envs`, Search-R1-style) builds one
`BM25Index` over its knowledge base when the task is constructed and registers a `SearchTool`.
The rollout driver calls the tool through `jaxagent.tools.executors.ToolExecutor` (thread path)
and appends the formatted passages (`Doc 1 (Title: ...): text`) as an observation.

Indexing uses `bm25s` (Lucene BM25 variant: idf = ln(1 + (N - df + 0.5) / (df + 0.5)),
tf part = tf / (tf + k1 * (1 - b + b * |d| / avgdl))) over each document's title and text:
Unicode NFKC-normalised (so "café" typed as "e" + a combining accent finds "café"), lowercased,
split into `TOKEN_PATTERN` words, English stopwords removed. The index is built once; a query costs one sparse lookup over the
query's terms plus a top-k selection in NumPy, and is safe to run from many threads. Documents
sharing no term with the query are never returned, so a query with no known terms, an empty
query and an empty corpus (or one whose documents hold no term outside the stopwords) all give
an empty result rather than arbitrary documents.
"""

from __future__ import annotations

import array
import dataclasses
import difflib
import json
import os
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxagent.tools.base import ToolArgumentError, ToolResult, validate_arguments

TOKEN_PATTERN = r"(?u)\b\w+\b"  # keeps one-character tokens, so "7" or "X" can be searched


@dataclasses.dataclass(frozen=True, slots=True)
class Document:
    """One corpus entry; `id` defaults to the document's position in the corpus. Slots: a
    corpus holds millions (40 bytes a document less than with an attribute dict)."""

    title: str
    text: str
    id: str | None = None


@dataclasses.dataclass(frozen=True)
class Passage:
    """One search hit: 1-based `rank`, BM25 `score` and the document's fields."""

    rank: int
    score: float
    title: str
    text: str
    id: str


def misspelt_fields(keys: Iterable[str]) -> dict[str, str]:
    """{key: field} for each of `keys` that looks like a misspelling of a document field the keys
    lack ('txt' or 'Text' for 'text', 'titel' for 'title', 'ID' for 'id'). Other keys (a Wikipedia
    dump's 'url', 'wiki_id', ...) are not document fields and are ignored."""
    keys = [k for k in keys if isinstance(k, str)]
    out = {}
    for field in ("title", "text", "id"):
        if field in keys:
            continue
        for k in keys:
            if k not in _DOCUMENT_FIELDS and (k.lower() == field or (
                    field != "id" and difflib.SequenceMatcher(None, k.lower(), field).ratio() >= 0.8)):
                out[k] = field
                break
    return out


_DOCUMENT_FIELDS = ("title", "text", "id")


def _as_document(item: Document | Mapping[str, Any], position: int) -> Document:
    if isinstance(item, Document):
        if isinstance(item.id, str) and isinstance(item.title, str) and isinstance(item.text, str):
            return item  # as it is: a corpus's documents are not copied again
        doc = item
    elif isinstance(item, Mapping):
        # Keys besides title, text and id (a Wikipedia dump's url, wiki_id, ...) are ignored, but
        # one that reads as a misspelt field is named: a 'titel' left out would index every
        # document under an empty title, a 'txt' would be "no 'text' field" with no pointer.
        misspelt = misspelt_fields(item)
        hint = "; ".join(f"{k!r} looks like a misspelt {f!r}: rename it" for k, f in misspelt.items())
        if "text" not in item:
            raise ValueError(f"document {position} has no 'text' field (fields: {sorted(item)})"
                             + (f"; {hint}" if hint else ""))
        if misspelt:
            raise ValueError(f"document {position}: {hint} (fields: {sorted(item)}; fields other "
                             "than title, text and id are ignored)")
        doc = Document(title=item.get("title", ""), text=item["text"], id=item.get("id"))
    else:
        raise TypeError(f"document {position} must be a Document or a mapping, got {type(item).__name__}")
    if not isinstance(doc.title, str) or not isinstance(doc.text, str):
        raise TypeError(f"document {position}: title and text must be strings")
    return dataclasses.replace(doc, id=str(position) if doc.id is None else str(doc.id))


def load_documents(path: str | os.PathLike) -> list[Document]:
    """Reads a JSON Lines corpus, one `{"title", "text", "id"?}` object per line (other keys are
    ignored)."""
    documents = []
    # Bytes that are not UTF-8 are kept as lone surrogates, so the line that holds them is named;
    # a byte-order mark opening the file (some editors write one) is skipped.
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as e:
                bad = line[e.start:e.end].encode("utf-8", "surrogateescape")
                raise ValueError(f"{path}:{line_no}: not valid UTF-8 (byte(s) {bad!r} at character "
                                 f"{e.start + 1}); the corpus must be UTF-8 encoded") from None
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON: {e}") from None
            try:
                documents.append(_as_document(record, len(documents)))
            except (TypeError, ValueError) as e:  # name the line: blank lines shift the position
                raise type(e)(f"{path}:{line_no}: {e}") from None
    return documents


class BM25Index:
    """A BM25 index over `documents`, built once at construction.

    Args:
      documents: `Document`s or mappings with `title`, `text` and optional `id` (other keys are
        ignored; one that looks like a misspelt field, 'titel' or 'txt', is an error).
      k1, b: BM25 parameters.
      stopwords: "en" or a list of words to drop, or None to keep every token.
      stemmer: optional callable mapping a list of words to their stems (e.g. PyStemmer's
        `Stemmer("english").stemWords`), applied to documents and queries alike.
    """

    def __init__(self, documents: Iterable[Document | Mapping[str, Any]], *, k1: float = 1.5, b: float = 0.75,
                 stopwords: str | Sequence[str] | None = "en", stemmer: Callable[[list[str]], list[str]] | None = None):
        # A NaN or infinite k1 passed a `k1 < 0` check and scored every document 0 or NaN: every
        # search found nothing, and the tool answered "No results found" to every query.
        numbers = all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in (k1, b))
        if not numbers or not (0 <= k1 < float("inf") and 0 <= b <= 1):
            raise ValueError(f"BM25 needs a finite k1 >= 0 and 0 <= b <= 1, got k1={k1!r}, b={b!r}")
        self.documents: list[Document] = [_as_document(d, i) for i, d in enumerate(documents)]
        seen: set[str] = set()  # one pass (a count per id took hours on 10^6 documents)
        for position, d in enumerate(self.documents):
            if d.id in seen:
                first = next(i for i, e in enumerate(self.documents) if e.id == d.id)
                raise ValueError(f"document ids must be unique; {d.id!r} is the id of documents "
                                 f"{first} and {position} (0-based positions)")
            seen.add(d.id)
        del seen
        self._stopwords = stopwords if stopwords is not None else []
        self._stemmer = stemmer
        self._retriever = None
        if self.documents:
            ids, vocab = self._token_ids()
            if vocab:  # bm25s cannot index a corpus without a single term
                import bm25s  # deferred: importing it takes about a second

                self._retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
                self._retriever.index((ids, vocab), show_progress=False)

    def __len__(self) -> int:
        return len(self.documents)

    def _token_ids(self) -> tuple[list[array.array], dict[str, int]]:
        """Each document's title and text as term ids (a compact array a document), and the
        terms' ids: tokenized a chunk of documents at a time, so no second copy of the corpus's
        text (nor a list of every document's terms as strings) is ever whole in memory."""
        vocab: dict[str, int] = {}
        ids: list[array.array] = []
        for start in range(0, len(self.documents), _TOKENIZE_CHUNK):
            chunk = self.documents[start:start + _TOKENIZE_CHUNK]
            tokenized = self._tokenize([f"{d.title}\n{d.text}" for d in chunk], return_ids=True)
            # The chunk's own term ids (0, 1, ... in order) as the corpus's.
            remap = [0] * len(tokenized.vocab)
            for term, i in tokenized.vocab.items():
                remap[i] = vocab.setdefault(term, len(vocab))
            ids.extend(array.array("i", [remap[i] for i in doc]) for doc in tokenized.ids)
        return ids, vocab

    def _tokenize(self, texts: list[str], return_ids: bool = False):
        """The terms of each of `texts` (a list of lists of words), or with `return_ids` bm25s's
        `Tokenized` (term ids a text, and the ids of the terms)."""
        import bm25s

        # Case-folded, not only lowercased: "STRASSE" finds "Straße", as a reader expects.
        texts = [unicodedata.normalize("NFKC", t).casefold() for t in texts]
        return bm25s.tokenize(texts, stopwords=self._stopwords, stemmer=self._stemmer, return_ids=return_ids,
                              show_progress=False, token_pattern=TOKEN_PATTERN)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for `query` (zeros where no query term occurs)."""
        if self._retriever is None or not query.strip():
            return np.zeros(len(self.documents), dtype=np.float32)
        ids = self._retriever.get_tokens_ids(self._tokenize([query])[0])
        if not ids:
            return np.zeros(len(self.documents), dtype=np.float32)
        return np.asarray(self._retriever.get_scores_from_ids(ids))

    def search(self, query: str, k: int = 3) -> list[Passage]:
        """The top-`k` documents sharing a term with `query`, best first (ties: corpus order)."""
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}")
        _check_k("k", k)
        scores = self.scores(query)
        # Only matching documents, and of those only scores at least the k-th best, are sorted:
        # a sort of the whole corpus cost 1.5 s a search at 2*10^7 documents. `hits` stays in
        # corpus order, so the stable sort breaks ties by it.
        hits = np.flatnonzero(scores > 0)
        if len(hits) > k:
            kth = np.partition(scores[hits], len(hits) - k)[len(hits) - k]
            hits = hits[scores[hits] >= kth]
        order = hits[np.argsort(-scores[hits], kind="stable")[:k]]
        return [Passage(rank=r + 1, score=float(scores[i]), title=self.documents[i].title,
                        text=self.documents[i].text, id=self.documents[i].id)
                for r, i in enumerate(order)]


_TOKENIZE_CHUNK = 8192  # documents tokenized together while an index is built


def _check_k(name: str, k: Any) -> None:
    # A float k (3.0 from a config) passed a comparison and then failed every search as a slice index.
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {k!r} ({type(k).__name__})")
    if k < 1:
        raise ValueError(f"{name} must be >= 1, got {k}")


def format_passages(passages: Sequence[Passage], max_chars_per_passage: int | None = None) -> str:
    """`Doc 1 (Title: ...): text` lines, the form Search-R1-style prompts expect."""
    _check_max_chars(max_chars_per_passage)
    def one_line(text: str) -> str:  # white space collapsed, cut at max_chars_per_passage
        text = " ".join(text.split())
        if max_chars_per_passage is not None and len(text) > max_chars_per_passage:
            text = text[:max_chars_per_passage].rstrip() + " ..."
        return text

    # A title is one line too: a line break in it started a line that read as the text.
    return "\n".join(f"Doc {p.rank} (Title: {one_line(p.title)}): {one_line(p.text)}" for p in passages)


def _check_max_chars(max_chars_per_passage: int | None) -> None:
    # A slice bound of 0 or below would print every passage empty or drop its last characters.
    if max_chars_per_passage is not None and (isinstance(max_chars_per_passage, bool)
                                              or not isinstance(max_chars_per_passage, int)
                                              or max_chars_per_passage < 1):
        raise ValueError(f"max_chars_per_passage must be an int >= 1 or None (no cut), "
                         f"got {max_chars_per_passage!r}")


_ECHO_CHARS = 100  # how much of a query without results the observation quotes back


class SearchTool:
    """`BM25Index.search` as a `Tool` taking `{"query": ..., "k"?: ...}` and returning formatted passages."""

    execution = "thread"
    timeout_s = 10.0

    def __init__(self, index: BM25Index, *, k: int = 3, max_k: int = 10, max_chars_per_passage: int | None = 600,
                 name: str = "search", description: str | None = None):
        _check_k("SearchTool k", k)
        _check_k("SearchTool max_k", max_k)
        if not 1 <= k <= max_k:
            raise ValueError(f"SearchTool needs 1 <= k <= max_k, got k={k}, max_k={max_k}")
        _check_max_chars(max_chars_per_passage)
        self.index = index
        self.k = k
        self.max_k = max_k
        self.max_chars_per_passage = max_chars_per_passage
        self.name = name
        self.description = description or (
            f"Search the knowledge base and return the {k} most relevant passages with their titles.")
        self.parameters = {
            "type": "object", "additionalProperties": False, "required": ["query"],
            "properties": {"query": {"type": "string", "description": "What to search for."},
                           "k": {"type": "integer", "description": f"Number of passages (1 to {max_k}); default {k}."}}}

    def __call__(self, args: dict[str, Any]) -> ToolResult:
        try:
            checked = validate_arguments(self.parameters, args)
        except ToolArgumentError as e:
            return ToolResult.failure(str(e))
        query, k = checked["query"].strip(), checked.get("k", self.k)
        if not query:
            return ToolResult.failure("empty query: give some words to search for")
        if not 1 <= k <= self.max_k:
            return ToolResult.failure(f"k must be between 1 and {self.max_k}, got {k}")
        passages = self.index.search(query, k)
        if not passages:
            # A long query without results is quoted in part: the observation costs tokens.
            shown = query if len(query) <= _ECHO_CHARS else query[:_ECHO_CHARS] + "..."
            return ToolResult.success(f"No results found for {shown!r}.")
        return ToolResult.success(format_passages(passages, self.max_chars_per_passage))
