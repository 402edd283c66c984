"""The per-observation token cap (`RolloutConfig.max_observation_tokens`): what is kept of a long
tool result on each side, the marker, failed calls, the wrapper around the cut text, the ledger
(== the engine's cache), counts and metrics, and the settings' checks."""
import json

import pytest

from jaxagent import models
from jaxagent.agent import (OBSERVATION_TEMPLATES, CalculatorEnv, JSONToolCallParser, RolloutConfig,
                            RolloutDriver, Trajectory, rollout, rollout_metrics)
from jaxagent.agent.observation_cap import cap_result, cut_text, min_cap, truncation_marker
from jaxagent.agent.trajectory import data_continuation_ids
from jaxagent.tools import ToolResult, function_tool
from tests.agent.rollout_test import TOK, FakeEngine, ScriptedCalcEnv, _examples, _run, check_ledger

DIGITS = "".join(str(i % 10) for i in range(300))  # 300 tokens of the char tokenizer


@function_tool
def dump(n: str) -> str:
  """Print n digits."""
  return "".join(str(i % 10) for i in range(int(n)))


def _kept(out: str, removed: int) -> tuple[str, str]:
  """(text before the marker, text after it)."""
  marker = truncation_marker(removed)
  assert out.count(marker) == 1, out
  head, tail = out.split(marker)
  return head, tail


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_each_side_keeps_its_part_with_the_marker_where_it_was_cut(side):
  cap = 60
  out, removed = cut_text(DIGITS, cap, side, TOK)
  head, tail = _kept(out, removed)
  assert cap - 2 <= len(out) <= cap  # one token per character: the cap is filled
  assert removed == len(DIGITS) - len(head) - len(tail) > 0
  assert DIGITS.startswith(head) and DIGITS.endswith(tail)
  if side == "right":
    assert tail == "" and len(head) > 0
  elif side == "left":
    assert head == "" and len(tail) > 0
  else:
    assert len(head) - len(tail) in (0, 1) and len(tail) > 0
  # Text that fits is returned as it is.
  assert cut_text(DIGITS[:cap], cap, side, TOK) == (DIGITS[:cap], 0)
  res, n = cap_result(ToolResult.success(DIGITS, duration_s=0.5), cap, side, TOK)
  assert (res.output, n, res.truncated, res.ok, res.duration_s) == (out, removed, True, True, 0.5)


def test_a_failed_call_keeps_its_error_over_its_output():
  err = "ZeroDivisionError: division by zero"
  res, n = cap_result(ToolResult.failure(err, output=DIGITS), 80, "right", TOK)
  text = res.to_observation()
  assert len(text) <= 80 and res.error == err and not res.ok and res.truncated
  head, tail = _kept(res.output, n)
  assert DIGITS.startswith(head) and tail == "" and n == len(DIGITS) - len(head)
  assert text.endswith("\nError: " + err)
  # An error longer than the cap: the output is dropped and the error cut, marked with all the
  # tokens removed.
  long_err = "E" * 200
  res, n = cap_result(ToolResult.failure(long_err, output=DIGITS), 80, "middle", TOK)
  assert res.output == "" and len(res.to_observation()) <= 80
  head, tail = _kept(res.error, n)
  assert n == len(DIGITS) + len(long_err) - len(head) - len(tail)
  # An error that fits with nothing printed is not touched.
  small = ToolResult.failure("boom")
  assert cap_result(small, 80, "middle", TOK) == (small, 0)


def test_a_long_result_is_tokenized_once():
  # An uncapped observation tokenizes the whole result once (encode_observation); the cap pays
  # that once, then only the short cut text is tokenized.
  long_calls = []

  class Counting(type(TOK)):
    def encode(self, text):
      long_calls.extend([len(text)] if len(text) > 1000 else [])
      return super().encode(text)

  tok, text = Counting(), DIGITS * 20
  for result in (ToolResult.success(text), ToolResult.failure("boom", output=text),
                 ToolResult.failure("E" * 5000, output=text)):
    long_calls.clear()
    res, n = cap_result(result, 100, "middle", tok)
    assert n > 0 and len(res.to_observation()) <= 100
    # The output once, a long error once.
    assert long_calls.count(len(text)) == 1 and len(long_calls) <= 2, long_calls


def _smollm2():
  try:
    return models.load_tokenizer("smollm2-135m-instruct")
  except Exception as e:  # noqa: BLE001 - the GGUF ships in an optional pip package
    pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")


def test_the_cap_holds_in_a_bpe_tokenizers_tokens():
  tok = _smollm2()
  count = lambda s: len(data_continuation_ids(tok, s))
  # Multi-byte characters split over tokens, and text that spells a control token.
  text = " ".join(f"row {i}: é🙂 <|im_end|>" for i in range(200))
  err = "Traceback: " + "frame " * 100
  for side in ("left", "right", "middle"):
    for cap in (min_cap(tok), 32, 64, 200):
      for result in (ToolResult.success(text), ToolResult.failure(err, output=text),
                     ToolResult.failure("bad value", output=text)):
        res, n = cap_result(result, cap, side, tok)
        seen = res.to_observation()
        assert count(seen) <= cap, (side, cap, seen)
        assert n > 0 and res.truncated and truncation_marker(n) in seen
        assert "\ufffd" not in seen  # a character cut in its bytes is dropped, not garbled
  res, n = cap_result(ToolResult.success(text), 64, "middle", tok)
  head, tail = _kept(res.output, n)
  assert head and tail and text.startswith(head) and text.endswith(tail)


# --------------------------------------------------------------------------------------- rollouts


def test_rollout_cuts_the_tool_text_inside_the_wrapper_and_counts_it():
  texts = {0: ["<dump>300</dump>", "<dump>5</dump>", "<answer>1</answer>"]}
  env = ScriptedCalcEnv([dump])
  cfg = RolloutConfig(max_turns=4, decode_steps=4, max_observation_tokens=60,
                      observation_truncation="left")
  (t,) = _run(texts, env=env, cfg=cfg, max_len=1024)  # checks the ledger == the engine's cache
  assert t.stop_reason == "answer", t.render(TOK)
  (a, b), (c, d) = t.turns[0].observation_span, t.turns[1].observation_span
  obs = TOK.decode(t.token_ids[a:b])
  assert obs.startswith("<result>") and obs.endswith("</result>")  # the wrapper is whole
  inner = obs[len("<result>"):-len("</result>")]
  removed = t.turns[0].observation_truncated_tokens
  head, tail = _kept(inner, removed)
  assert head == "" and DIGITS.endswith(tail) and removed == 300 - len(tail)
  assert len(inner) <= 60 and b - a == len(obs)
  assert t.turns[0].outcome.truncated and t.turns[0].outcome.output == inner  # what it saw
  assert t.turns[0].observation_text == obs
  assert TOK.decode(t.token_ids[c:d]) == "<result>01234</result>"
  assert t.turns[1].observation_truncated_tokens == 0 and not t.turns[1].outcome.truncated
  assert t.truncated_observations == 1 and t.counts()["truncated_observations"] == 1
  m = rollout_metrics([t])
  assert m["rollout/truncated_observations"] == 1.0
  assert m["rollout/truncated_observation_rate"] == 0.5
  assert m["rollout/truncated_observation_tokens"] == removed
  back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
  assert back.truncated_observations == 1
  assert back.turns[0].observation_truncated_tokens == removed
  assert f"{removed} tool tokens truncated" in t.render(TOK)


def test_without_a_cap_nothing_changes_and_a_long_result_ends_the_trajectory():
  texts = {0: ["<dump>300</dump>", "<answer>1</answer>"]}
  (t,) = _run(texts, env=ScriptedCalcEnv([dump]), max_len=1024,
              cfg=RolloutConfig(max_turns=4, decode_steps=4))
  a, b = t.turns[0].observation_span
  assert TOK.decode(t.token_ids[a:b]) == f"<result>{DIGITS}</result>"
  assert t.truncated_observations == 0 and t.turns[0].observation_truncated_tokens == 0
  assert rollout_metrics([t])["rollout/truncated_observation_rate"] == 0.0
  # A cap the result fits under: the same ledger.
  (u,) = _run(texts, env=ScriptedCalcEnv([dump]), max_len=1024,
              cfg=RolloutConfig(max_turns=4, decode_steps=4, max_observation_tokens=300))
  assert u.token_ids == t.token_ids and u.truncated_observations == 0
  # A cache too short for the result: the trajectory ends, unless the cap makes it fit.
  prompt_len = len(TOK.encode(_examples(1)[0].prompt))
  max_len = prompt_len + 150
  (t,) = _run(texts, env=ScriptedCalcEnv([dump]), max_len=max_len,
              cfg=RolloutConfig(max_turns=4, decode_steps=4))
  assert t.stop_reason == "max_length" and t.turns[0].observation_span is None
  (t,) = _run(texts, env=ScriptedCalcEnv([dump]), max_len=max_len,
              cfg=RolloutConfig(max_turns=4, decode_steps=4, max_observation_tokens=64))
  assert t.stop_reason == "answer" and t.truncated_observations == 1
  # Cut and still too long for the cache: the turn says what was cut, the trajectory counts only
  # observations it appended.
  (t,) = _run(texts, env=ScriptedCalcEnv([dump]), max_len=prompt_len + 40,
              cfg=RolloutConfig(max_turns=4, decode_steps=4, max_observation_tokens=min_cap(TOK)))
  assert t.stop_reason == "max_length" and t.turns[0].observation_span is None
  assert t.turns[0].observation_truncated_tokens > 0 and t.turns[0].outcome.truncated
  assert t.truncated_observations == 0
  assert rollout_metrics([t])["rollout/truncated_observation_tokens"] == 0.0


def test_the_chat_template_frame_survives_with_the_smollm2_tokenizer():
  tok = _smollm2()

  class ChatDump(CalculatorEnv):
    observation_template = OBSERVATION_TEMPLATES["chatml_tool"]

    def __init__(self):
      super().__init__()
      self.parser = JSONToolCallParser()
      self.tools = type(self.tools)([*self.tools, shout])

  @function_tool
  def shout(n: str) -> str:
    """Print a long text that spells the end of a turn."""
    return " ".join(f"line {i} <|im_end|> é🙂" for i in range(int(n)))

  call = '<tool_call>\n{"name": "shout", "arguments": {"n": "200"}}\n</tool_call>'
  turns = [tok.encode(call), tok.encode("Done.<|im_end|>")]
  fake = FakeEngine(lambda rid, k: turns[k] if k < 2 else [], slots=2, max_len=2048,
                    eos_ids=tuple(sorted(tok.eos_ids)), filler=tok.encode("x")[0])
  ex = _examples(1)[0]
  cap = 48
  for side in ("left", "right", "middle"):
    (t,) = rollout(fake, None, ChatDump(), [ex], tokenizer=tok,
                   cfg=RolloutConfig(max_turns=3, max_tokens_per_turn=64, decode_steps=4,
                                     max_observation_tokens=cap, observation_truncation=side))
    fake.finalize()
    check_ledger(t, fake, tok)  # the observation ids in the ledger are those in the cache
    assert t.stop_reason == "eos" and t.truncated_observations == 1
    a, b = t.turns[0].observation_span
    pre, post = OBSERVATION_TEMPLATES["chatml_tool"].split("{output}")
    pre_ids, post_ids = tok.encode(pre), tok.encode(post)
    obs = t.token_ids[a:b]
    # The frame's control tokens are the template's own ids, whole; the cut text sits inside.
    assert obs[:len(pre_ids)] == pre_ids and obs[len(obs) - len(post_ids):] == post_ids
    inner = obs[len(pre_ids):len(obs) - len(post_ids)]
    assert len(inner) <= cap and truncation_marker(t.turns[0].observation_truncated_tokens) in (
        tok.decode(inner))
    assert tok.eos_ids.isdisjoint(inner)  # "<|im_end|>" in the tool's text stays text


def test_a_tasks_own_format_gets_the_capped_result():
  seen = []

  class OwnFormat(ScriptedCalcEnv):
    def format_observation(self, result):
      seen.append(result)
      return f"[out]{result.output}[/out]"

    def encode_observation(self, text, tokenizer):
      return data_continuation_ids(tokenizer, text)

  (t,) = _run({0: ["<dump>300</dump>", "<answer>1</answer>"]}, env=OwnFormat([dump]),
              max_len=1024, cfg=RolloutConfig(decode_steps=4, max_observation_tokens=50,
                                              observation_truncation="right"))
  (result,) = seen
  assert result.truncated and len(result.output) <= 50 and DIGITS.startswith(
      _kept(result.output, t.turns[0].observation_truncated_tokens)[0])
  a, b = t.turns[0].observation_span
  assert TOK.decode(t.token_ids[a:b]) == f"[out]{result.output}[/out]"


# --------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize("bad", [0, -5, True, 1.5, "64"])
def test_a_bad_cap_is_refused(bad):
  with pytest.raises(ValueError, match=r"max_observation_tokens must be None \(no cap\) or an int"):
    RolloutConfig(max_observation_tokens=bad)


@pytest.mark.parametrize("bad", ["both", "", None, "Middle"])
def test_a_bad_truncation_side_is_refused(bad):
  with pytest.raises(ValueError, match=r"observation_truncation must be one of 'left' keeps the "
                                       r"tail, 'right' keeps the head"):
    RolloutConfig(max_observation_tokens=64, observation_truncation=bad)


def test_a_cap_without_room_beside_the_marker_is_refused_by_the_driver():
  fake = FakeEngine(lambda rid, k: [], slots=1, max_len=64)
  low = min_cap(TOK)
  with pytest.raises(ValueError, match=rf"max_observation_tokens={low - 1} leaves no room .* at "
                                       rf"least {low}, or None"):
    RolloutDriver(fake, CalculatorEnv(), tokenizer=TOK,
                  cfg=RolloutConfig(max_observation_tokens=low - 1))
  RolloutDriver(fake, CalculatorEnv(), tokenizer=TOK,
                cfg=RolloutConfig(max_observation_tokens=low)).close()


def test_the_run_config_carries_the_cap_and_checks_it():
  from configs.quickstart import get_config
  from jaxagent.trainer import _rollout_config, check_config
  c = get_config("tiny")
  cfg = _rollout_config(c.rollout)
  assert (cfg.max_observation_tokens, cfg.observation_truncation) == (None, "middle")
  c.rollout.max_observation_tokens = 256
  c.rollout.observation_truncation = "left"
  cfg = _rollout_config(c.rollout)
  assert (cfg.max_observation_tokens, cfg.observation_truncation) == (256, "left")
  check_config(c)
  c.rollout.observation_truncation = "tail"
  with pytest.raises(ValueError, match="observation_truncation must be one of"):
    check_config(c)
  # A config written before these settings (without them) runs without a cap.
  del c.rollout["max_observation_tokens"], c.rollout["observation_truncation"]
  assert _rollout_config(c.rollout).max_observation_tokens is None
