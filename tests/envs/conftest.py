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
