"""Shared fixtures of the task tests: tokenizers and hand-built trajectories."""
import pytest

from jaxagent.agent.trajectory import demonstration_trajectory


class CharTokenizer:
  """One token per character: exact and instant, for reward tests on hand-written text."""

  def encode(self, text, parse_special=True):
    del parse_special
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(chr(int(i)) for i in ids)


@pytest.fixture(scope="session")
def char_tok():
  return CharTokenizer()


@pytest.fixture(scope="session")
def smol_tok():
  from jaxagent import models
  return models.load_tokenizer("smollm2-135m-instruct")


@pytest.fixture
def make_traj(char_tok):
  """`make_traj(segments, stop="answer")`: a finished trajectory after the prompt "Q".

  `segments` are (role, text) pairs, role POLICY or OBSERVATION (as `Env.demonstration` gives).
  """

  def make(segments, stop="answer"):
    traj = demonstration_trajectory(char_tok.encode("Q"), segments, char_tok)
    traj.finish(stop)
    return traj

  return make


@pytest.fixture
def batched_reads(monkeypatch):
  """`watch(source_type)`: the key lists of every `__getitems__` call on `source_type` from now
  on (appended to the returned list); a one-record `__getitem__` read fails the test."""
  def watch(source_type):
    reads = []
    getitems = source_type.__getitems__

    def batched(self, keys):
      reads.append(list(keys))
      return getitems(self, keys)

    def single(self, key):
      raise AssertionError("read one record at a time")
    monkeypatch.setattr(source_type, "__getitems__", batched)
    monkeypatch.setattr(source_type, "__getitem__", single)
    return reads
  return watch
