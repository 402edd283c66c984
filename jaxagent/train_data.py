"""The training data of a run: the RL prompt stream and the SFT warm start's examples.

`PromptStream` hands out the task's train examples in a reproducible shuffled order (its state
goes into checkpoints); `check_examples` tokenizes and checks a split's prompts up front;
`sft_items` / `sft_items_from_chat_jsonl` turn the task's demonstrations or a chat JSONL file
(`sft.data`) into packed-sequence items whose loss mask covers the assistant's tokens only.
`jaxagent.trainer` re-exports the public names.
"""
from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import types
from typing import Any, Sequence

import grain
import numpy as np

from jaxagent.agent.env import Env, Example
from jaxagent.agent.trajectory import demonstration_trajectory
from jaxagent.rl import packing

class PromptStream:
  """Training examples in a reproducible shuffled order (grain), a batch at a time.

  The iterator state (`get_state` / `set_state`) is what a checkpoint stores to resume the
  same data order.
  """

  def __init__(self, examples: Sequence[Example], seed: int):
    if not examples:
      raise ValueError("the task has no training examples")
    self.examples = list(examples)
    ds = grain.MapDataset.range(len(self.examples)).seed(seed).shuffle().repeat()
    self._it = iter(ds.to_iter_dataset())

  def next(self, n: int) -> list[Example]:
    return [self.examples[int(next(self._it))] for _ in range(n)]

  def get_state(self):
    return self._it.get_state()

  def set_state(self, state) -> None:
    self._it.set_state(state)


def _split_examples(env: Env, split: str) -> list[Example]:
  """`env.examples(split)` as a list, with what it raises (a task's data file that is missing,
  truncated or not JSON) named as coming from that task and split: it reached the launcher as
  the bare error ("bad config: Unterminated string starting at: line 1 column 7")."""
  try:
    return list(env.examples(split))
  except Exception as e:  # noqa: BLE001 - the task's own code and data
    raise ValueError(f"env {env.name!r} ({type(env).__name__}) cannot give its {split!r} "
                     f"examples: examples({split!r}) raised {type(e).__name__}: {e}") from e


def check_examples(env: Env, examples: Sequence[Any], tokenizer, split: str) -> list[tuple[int, ...]]:
  """The rendered prompt of each example of `split`, or a ValueError naming every bad record.

  Run once when the trainer starts: a record that is not an `Example`, or whose prompt does
  not render (a message without text content, invalid Unicode) or renders empty, would
  otherwise end the run at whichever RL step first draws it.
  """
  prompts, bad = [], []
  for i, ex in enumerate(examples):
    if not isinstance(ex, Example):
      bad.append(f"examples[{i}] is a {type(ex).__name__}, not a jaxagent.agent.Example")
      continue
    try:
      ids = tuple(int(t) for t in env.render_prompt(ex, tokenizer))
      if not ids:
        raise ValueError("the rendered prompt is empty")
    except Exception as e:  # noqa: BLE001 - collected: every bad record is named at once
      bad.append(f"example {ex.id!r} (examples[{i}]): {type(e).__name__}: {e}")
      continue
    prompts.append(ids)
  if bad:
    raise ValueError(
        f"{len(bad)} of the {len(examples)} {split!r} examples of env {env.name!r} cannot be "
        f"used; fix or drop them: " + "; ".join(bad[:5]) + ("; ..." if len(bad) > 5 else ""))
  return prompts


def _examples_fingerprint(examples: Sequence[Example], prompts: Sequence[Sequence[int]]) -> dict:
  """How many examples and a digest of their ids and prompt token ids, in order."""
  h = hashlib.sha256()
  for ex, ids in zip(examples, prompts):
    h.update(json.dumps([str(ex.id), list(ids)]).encode())
  return {"count": len(examples), "sha256": h.hexdigest()}


def _sft_batches(n: int, batch_size: int, steps: int, seed: int) -> list[np.ndarray]:
  """Item indices of each warm-start step: every item once per epoch, in a fresh order per
  epoch drawn from `seed`; a batch at an epoch's end continues into the next epoch."""
  rng = np.random.default_rng(seed)
  size = min(batch_size, n)
  stream, out = np.zeros(0, np.int64), []
  for _ in range(steps):
    while stream.size < size:
      stream = np.concatenate([stream, rng.permutation(n)])
    out.append(stream[:size])
    stream = stream[size:]
  return out


class SFTDataError(ValueError):
  """The SFT warm start's data cannot be used (a bad line of `sft.data`, a task without
  demonstrations, demonstrations of eval prompts, every sequence too long). `Trainer.run`
  reads that data only when a run starts from scratch, so it is named there, not when the
  trainer is built; `python -m jaxagent.launch` says it in one line, as a bad setting."""


def sft_items(env: Env, examples: Sequence[Example], tokenizer) -> list[packing.PackItem]:
  """SFT items from the task's demonstrations: loss only on the policy's own tokens."""
  items = []
  for i, ex in enumerate(examples):
    try:
      segs = env.demonstration(ex)
      if segs is None:
        continue
      prompt = list(env.render_prompt(ex, tokenizer))
      if not prompt:
        raise ValueError("the rendered prompt is empty")
      # The env that runs the example's rollouts (a mixture's task): its observations are
      # tokenized and its turns parsed as they are there.
      own = env.env_for(ex) if callable(getattr(env, "env_for", None)) else env
      traj = demonstration_trajectory(prompt, segs, tokenizer,
                                      parser=getattr(own, "parser", None), env=own)
      items.append(traj.to_pack_item(0.0))
    except Exception as e:  # the task's data is at fault: name the example among thousands
      raise ValueError(f"SFT warm start: example {getattr(ex, 'id', None)!r} (examples[{i}]) of "
                       f"env {env.name!r} gave no usable demonstration: {type(e).__name__}: {e}; "
                       "fix or drop this example") from e
  if not items:
    raise ValueError(f"task {env.name!r} gave no demonstrations for the SFT warm start; set "
                     "sft.steps=0 or use a task with `demonstration`")
  return items


def sft_items_from_chat_jsonl(path, tokenizer) -> list[packing.PackItem]:
  """SFT items from chat JSONL (`{"messages": [...]}` per line): assistant turns get loss.

  Each message is rendered with the chat template and tokenized on its own, in order (the
  prompt as the start of the input, each later piece as a continuation of the ids before it:
  `Tokenizer.encode_continuation`), so the token sequence is what the model will see (as in
  rollouts). The loss covers what the policy would sample: an assistant message's text up to
  and including its end-of-turn token.
  The template's framing around it (the newline after that token, the header that opens the
  next assistant turn) gets none, as in rollouts. As in `Tokenizer.encode_chat`, special-token
  text inside the messages ("<|im_end|>" in a user message) is encoded as text: only the
  template writes control tokens.
  """
  from jaxagent.agent.trajectory import OBSERVATION, POLICY
  eos_texts = [t for t in (tokenizer.id_to_token(i) for i in sorted(tokenizer.eos_ids)) if t]
  items = []
  # Lines end at "\n" only: `str.splitlines` also splits at U+2028, U+2029 and U+0085, which
  # JSON strings may hold unescaped (`json.dumps(..., ensure_ascii=False)` writes them so).
  raw = pathlib.Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM
  for n, line_bytes in enumerate(raw.split(b"\n"), 1):
    try:
      line = line_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}:{n}: not valid UTF-8 ({e}); re-encode the file as UTF-8") from None
    if not line.strip():
      continue
    try:
      msgs = json.loads(line)["messages"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{path}:{n}: expected a JSON object with a 'messages' list ({e})") from e
    if not isinstance(msgs, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
      raise ValueError(f"{path}:{n}: 'messages' must be a list of objects with a 'role' string")
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if first is None:
      raise ValueError(f"{path}:{n}: no assistant message to learn from")
    if first == 0:
      raise ValueError(f"{path}:{n}: the conversation starts with an assistant message; put the "
                       "prompt (a user or system message) before it")
    # The messages' special-token spellings are rendered as marks, so that the special tokens
    # of each rendered piece are the template's; `restore` puts the spellings back as text.
    written, restore = msgs, {}
    mark = getattr(tokenizer, "mark_special_text", None)
    if mark is not None:
      msgs, restore = mark(msgs, avoid="".join(tokenizer.chat_templates.values()))

    def render(k, gen_prompt):
      try:
        return tokenizer.apply_chat_template(msgs[:k], add_generation_prompt=gen_prompt)
      except Exception as e:  # noqa: BLE001 - the template's own errors name no line
        raise ValueError(f"{path}:{n}: the chat template cannot render messages 1-{k} "
                         f"({type(e).__name__}: {e})") from None

    def render_written():  # the whole conversation as written (no marks), or None
      try:
        return tokenizer.apply_chat_template(written, add_generation_prompt=False)
      except Exception:  # noqa: BLE001 - it rendered with the marks: a difference all the same
        return None

    prev = render(first, True)
    prompt = _encode_line(tokenizer, prev, path, n, restore)
    segs: list[tuple[int, str]] = []

    def add(role, text):  # consecutive pieces of one role form one segment
      if not text:
        return
      if segs and segs[-1][0] == role:
        segs[-1] = (role, segs[-1][1] + text)
      else:
        segs.append((role, text))

    for i in range(first, len(msgs)):
      gen = msgs[i]["role"] == "assistant"
      # Text of this message: the rendering up to and including it, minus what came before;
      # then the header of the next turn when an assistant message follows.
      cur = render(i + 1, False)
      nxt = render(i + 1, True) if i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant" else cur
      if not cur.startswith(prev) or not nxt.startswith(cur):
        raise ValueError(f"{path}:{n}: the chat template does not render incrementally")
      text = cur[len(prev):]
      if gen:
        cut = max((text.rfind(t) + len(t) for t in eos_texts if t in text), default=len(text))
        add(POLICY, text[:cut])
        add(OBSERVATION, text[cut:])
      else:
        add(OBSERVATION, text)
      add(OBSERVATION, nxt[len(cur):])
      prev = nxt
    if not segs or segs[0][0] != POLICY:
      raise ValueError(f"{path}:{n}: the first assistant message renders to no text")
    if restore and prev.translate(restore) != render_written():
      raise ValueError(f"{path}:{n}: the chat template changes the text of messages that spell "
                       f"special tokens ({', '.join(map(repr, restore.values()))}), so they cannot "
                       "be told apart from the template's control tokens; remove that text")
    # Each piece encoded with only the template's control tokens (the turns' texts keep the
    # marks: only the tokens and masks leave this function), as a continuation of the ids
    # before it: as in the encoding of the whole rendering, not as the start of an input
    # (which a Metaspace prepend_scheme="first" tokenizer marks with "▁"). Tokenizers without
    # `encode_continuation` encode each piece with `encode`.
    continues = callable(getattr(tokenizer, "encode_continuation", None))
    if restore:
      encoder = types.SimpleNamespace(encode=functools.partial(
          tokenizer.encode_marked, restore=restore, **({"continuation": True} if continues else {})))
    else:
      encoder = types.SimpleNamespace(
          encode=tokenizer.encode_continuation if continues else tokenizer.encode)
    # The line number as the item's id, so the warm start can name lines too long to train.
    try:
      traj = demonstration_trajectory(prompt, segs, encoder, request_id=n)
    except ValueError as e:  # the tokenizer's errors (invalid Unicode) name no line
      raise ValueError(f"{path}:{n}: {e}") from None
    items.append(traj.to_pack_item(0.0))
  if not items:  # else the warm start runs its steps on empty batches, loss 0
    raise ValueError(f"{path}: no conversations (one JSON object with a 'messages' list per "
                     "line); fix sft.data or set sft.steps=0")
  return items


def _encode_line(tokenizer, text: str, path, n: int, restore=None) -> list[int]:
  """`tokenizer.encode(text)` (of marked text, `encode_marked`) with its errors (a lone
  surrogate from a JSON escape) naming line `n` of `path`."""
  try:
    return tokenizer.encode_marked(text, restore) if restore else tokenizer.encode(text)
  except ValueError as e:
    raise ValueError(f"{path}:{n}: {e}") from None


