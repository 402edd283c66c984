"""Trajectory ledger: arrays and masks, packing, reward input, render, JSON round trip, SFT demos."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.agent import (OBSERVATION, POLICY, PROMPT, CalculatorEnv, Example, ToolCall, ToolOutcome,
                            Trajectory, Turn, demonstration_trajectory)
from jaxagent.rewards import ToolUseReward
from jaxagent.rl.packing import PackingConfig, pack


class CharTokenizer:
  def encode(self, text):
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(chr(int(i)) for i in ids)


TOK = CharTokenizer()


def _ledger():
  """prompt "Q: 2+3?" | policy "<calc>2+3</calc>" | obs "<result>5</result>" | policy "<answer>5</answer>"."""
  t = Trajectory(request_id=7, group_id=2, sample_index=1, example_id="ex")
  t.add_prompt(TOK.encode("Q: 2+3?"))
  call = "<calc>2+3</calc>"
  span = t.add_policy(TOK.encode(call), [-0.5] * len(call), 0)
  turn = Turn(0, span, call, "stop")
  turn.action, turn.call = "tool_call", ToolCall("calculator", {"expression": "2+3"}, call)
  turn.outcome = ToolOutcome(ok=True, output="5", duration_s=0.01)
  turn.observation_text = "<result>5</result>"
  turn.observation_span = t.add_observation(TOK.encode(turn.observation_text), 0)
  t.turns.append(turn)
  ans = "<answer>5</answer>"
  span = t.add_policy(TOK.encode(ans), np.linspace(-1, -0.1, len(ans)), 1)
  t.turns.append(Turn(1, span, ans, "stop", action="answer", answer="5"))
  t.num_tool_calls = t.valid_tool_calls = 1
  t.tool_calls = {"calculator": 1}
  t.tool_seconds = 0.01
  t.finish("answer")
  return t


def test_arrays_roles_and_mask():
  t = _ledger()
  n_p, n_c, n_o, n_a = 7, 16, 18, 18
  assert len(t) == n_p + n_c + n_o + n_a
  assert t.tokens.dtype == np.int32 and t.logprobs.dtype == np.float32
  np.testing.assert_array_equal(t.roles, [PROMPT] * n_p + [POLICY] * n_c + [OBSERVATION] * n_o + [POLICY] * n_a)
  np.testing.assert_array_equal(t.loss_mask(), np.r_[np.zeros(n_p), np.ones(n_c), np.zeros(n_o), np.ones(n_a)])
  np.testing.assert_array_equal(t.turn_index, [-1] * n_p + [0] * (n_c + n_o) + [1] * n_a)
  assert np.all(t.logprobs[t.roles != POLICY] == 0)
  assert t.prompt_len == n_p and t.num_policy_tokens == n_c + n_a and t.num_observation_tokens == n_o
  assert t.budgets() == {"turns": 2, "policy_tokens": n_c + n_a, "total_tokens": len(t), "tool_seconds": 0.01}
  assert (t.stop_reason, t.truncated, t.final_answer) == ("answer", False, "5")
  assert t.turn_texts() == ["<calc>2+3</calc>", "<answer>5</answer>"]
  assert t.observation_texts() == ["<result>5</result>"]


def test_ledger_guards():
  t = Trajectory(request_id=0)
  with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
    t.add_policy([1, 2], [0.0], 0)
  t.add_prompt([1])
  with pytest.raises(ValueError, match="prompt must come first"):
    t.add_prompt([2])
  with pytest.raises(ValueError, match="unknown stop reason"):
    t.finish("done")
  t.finish("max_turns")
  assert t.truncated


def test_bool_or_float_token_ids_are_refused_by_the_ledger():
  """int() made a bool in a prompt (or an SFT demonstration's observation ids) token 0 or 1 and
  cut a float id to another token; the ledger trained on tokens nobody wrote."""
  t = Trajectory(request_id=0)
  with pytest.raises(TypeError, match=r"the prompt has a bool \(True\) at position 1 among its"):
    t.add_prompt([5, True])
  with pytest.raises(TypeError, match="the prompt must be a flat sequence of integer token ids"):
    t.add_prompt(np.array([True, False]))
  # int("7") was token 7, and a JAX float array's entries were cut by int().
  with pytest.raises(TypeError, match=r"the prompt has a str \('7'\) at position 1"):
    t.add_prompt([5, "7"])
  with pytest.raises(TypeError, match="the prompt must be a flat sequence of integer token ids, "
                     "got float32"):
    t.add_prompt(jnp.array([5.0, 6.7]))
  with pytest.raises(ValueError, match="the prompt must be a sequence of token ids, got a str"):
    t.add_prompt("5 6")
  assert len(t) == 0
  t.add_prompt(np.array([5, 6], np.int32))
  with pytest.raises(TypeError, match=r"the observation has a float \(7.5\) at position 0"):
    t.add_observation([7.5], 0)
  with pytest.raises(TypeError, match="the policy turn has a float32"):
    t.add_policy([np.float32(3.0)], [0.0], 0)
  assert t.token_ids == [5, 6] and t.role_ids == [PROMPT, PROMPT]

  class FloatObservations(CalculatorEnv):
    def encode_observation(self, text, tokenizer):
      return [i + 0.5 for i in super().encode_observation(text, tokenizer)]

  env = FloatObservations()
  ex = Example("d", "What is 6*7?", gold="42", metadata={"expression": "6*7"})
  with pytest.raises(TypeError, match="the observation has a float"):
    demonstration_trajectory(env.render_prompt(ex, TOK), env.demonstration(ex), TOK, env=env)


def test_pack_item_follows_the_packing_convention():
  t = _ledger()
  item = t.to_pack_item(advantage=0.5, ref_logps=np.full(len(t), -1.0))
  assert item.group_id == 2 and item.traj_id == 7
  np.testing.assert_array_equal(item.tokens, t.tokens)
  np.testing.assert_array_equal(item.loss_mask, t.loss_mask())
  np.testing.assert_array_equal(item.old_logps, t.logprobs)
  assert np.all(item.advantages == 0.5)
  other = _ledger()
  other.request_id = 8
  batch = pack([item, other.to_pack_item(-0.5, np.zeros(len(other)))], PackingConfig(max_len=128))
  assert batch.stats["policy_tokens"] == 2 * t.num_policy_tokens
  r, o = batch.item_row[0], batch.item_offset[0]
  np.testing.assert_array_equal(batch.loss_mask[r, o:o + len(t)], t.loss_mask())
  np.testing.assert_array_equal(batch.old_logps[r, o:o + len(t)], t.logprobs)
  # A masked policy-gradient surrogate has zero gradient on prompt and observation positions.
  logps = jnp.asarray(batch.old_logps)
  grad = jax.grad(lambda lp: -jnp.sum(lp * jnp.asarray(batch.advantages) * jnp.asarray(batch.loss_mask)))(logps)
  g = np.asarray(grad[r, o:o + len(t)])
  assert np.all(g[t.roles != POLICY] == 0) and np.all(g[t.roles == POLICY] != 0)


def test_reward_input():
  t = _ledger()
  inp = t.to_reward_input(TOK, "5", metadata={"k": 1})
  assert inp.response_text == "<calc>2+3</calc><result>5</result><answer>5</answer>"
  assert (inp.gold, inp.num_response_tokens, inp.num_tool_calls, inp.num_valid_tool_calls,
          inp.num_tool_errors, inp.truncated) == ("5", 34, 1, 1, 0, False)
  assert inp.metadata == {"stop_reason": "answer", "num_turns": 2, "final_answer": "5", "k": 1}
  # The trajectory's own facts win over an example's extras of the same names.
  t.stop_reason = "eos"
  inp = t.to_reward_input(TOK, "5", metadata={"stop_reason": "answer", "num_turns": 9})
  assert (inp.metadata["stop_reason"], inp.metadata["num_turns"]) == ("eos", 2)
  assert inp.ended_without_answer
  # A cut to fewer than 2 characters still cuts (text[-0:] printed the whole run).
  assert all(len(line) < 40 for line in t.render(TOK, max_chars=1).splitlines()[2:] if ">>>" in line)
  t.stop_reason = "answer"
  assert t.to_reward_input(TOK, "5", policy_only=True).response_text == "<calc>2+3</calc><answer>5</answer>"
  env = CalculatorEnv()
  out = env.reward(t, Example("ex", "Q: 2+3?", gold="5"), TOK, step=0)
  assert out.components == {"correct": 1.0, "tool_calls": pytest.approx(0.1)}
  assert env.reward(t, Example("ex", "Q: 2+3?", gold="6"), TOK, step=0).components["correct"] == 0.0


def test_render_marks_roles_and_masks():
  t = _ledger()
  text = t.render(TOK)
  assert "stop=answer" in text.splitlines()[0]
  assert "[PROMPT 0:7 | mask=0]\n>>>Q: 2+3?<<<" in text
  assert "[POLICY 7:23 turn 0 | mask=1 | mean logprob -0.500 | ended by stop -> tool_call calculator(" in text
  assert "[OBSERVATION 23:41 turn 0 | mask=0 | ok=True timed_out=False 0.010s]\n>>><result>5</result><<<" in text
  assert "turn 1 | mask=1" in text and ">>><answer>5</answer><<<" in text
  t.add_observation(TOK.encode("y" * 5000), 1)
  assert "chars cut" in t.render(TOK, max_chars=100)


def test_render_shows_observations_trained_on_as_mask_1():
  """With observation_loss (search_qa's mask_observations=False) `to_pack_item` trains the
  observation tokens: the dump said mask=0 for them."""
  t = _ledger()
  assert t.to_pack_item(1.0, observation_loss=True).loss_mask[23:41].all()
  text = t.render(TOK, observation_loss=True)
  assert "[OBSERVATION 23:41 turn 0 | mask=1 | ok=True" in text
  assert "[PROMPT 0:7 | mask=0]" in text and "[POLICY 7:23 turn 0 | mask=1" in text


def test_render_of_lone_surrogates_in_a_call_can_be_written_as_utf8(tmp_path):
  """`{"expression": "\\ud800"}` parses to a lone surrogate; the sample dump must still write."""
  t = _ledger()
  t.turns[0].call = ToolCall("\udc00calc", {"expression": "\ud800"}, t.turns[0].text)
  text = t.render(TOK)
  (tmp_path / "samples.txt").write_text(text, encoding="utf-8")
  assert "\\udc00calc(" in text and '"\\ud800"' in text


def test_dict_round_trip_through_json():
  t = _ledger()
  d = json.loads(json.dumps(t.to_dict()))
  assert d["budgets"]["total_tokens"] == len(t) and d["counts"]["tool_calls"] == {"calculator": 1}
  back = Trajectory.from_dict(d)
  assert back == t


def test_the_distinct_successful_call_count_in_dumps_and_rewards():
  t = _ledger()
  assert t.distinct_ok_tool_calls is None  # built by hand: not counted
  assert t.to_reward_input(TOK, "5").num_distinct_ok_tool_calls is None
  t.distinct_ok_tool_calls = 1
  d = json.loads(json.dumps(t.to_dict()))
  assert d["counts"]["distinct_ok_tool_calls"] == 1 and Trajectory.from_dict(d) == t
  assert t.to_reward_input(TOK, "5").num_distinct_ok_tool_calls == 1
  # A dump written before the count existed reads as not counted, not as no call that ran.
  del d["counts"]["distinct_ok_tool_calls"]
  old = Trajectory.from_dict(d)
  assert old.distinct_ok_tool_calls is None
  assert ToolUseReward()(old.to_reward_input(TOK, "5")) == pytest.approx(0.1)
  t.distinct_ok_tool_calls = None
  assert Trajectory.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_demonstration_trajectory_for_sft():
  env = CalculatorEnv()
  ex = Example("d", "What is 6*7?", gold="42", metadata={"expression": "6*7"})
  segs = env.demonstration(ex)
  t = demonstration_trajectory(env.render_prompt(ex, TOK), segs, TOK)
  assert t.response_text(TOK) == "<calc>6*7</calc><result>42</result><answer>42</answer>"
  obs = t.turns[0].observation_span
  assert np.all(t.loss_mask()[obs[0]:obs[1]] == 0) and t.loss_mask().sum() == t.num_policy_tokens
  assert t.to_pack_item(1.0).loss_mask[0] == 0
  assert env.demonstration(Example("x", "no expression", gold="1")) is None
  with pytest.raises(ValueError, match="must start with a POLICY"):
    demonstration_trajectory([1], [(OBSERVATION, "x")], TOK)


def test_demonstration_with_the_parser_records_its_tool_call():
  env = CalculatorEnv()
  ex = Example("d", "What is 6*7?", gold="42", metadata={"expression": "6*7"})
  plain = demonstration_trajectory(env.render_prompt(ex, TOK), env.demonstration(ex), TOK)
  t = demonstration_trajectory(env.render_prompt(ex, TOK), env.demonstration(ex), TOK,
                               parser=env.parser)
  assert t.token_ids == plain.token_ids and np.array_equal(t.loss_mask(), plain.loss_mask())
  assert plain.num_tool_calls == 0 and plain.turns[0].action is None
  assert [turn.action for turn in t.turns] == ["tool_call", "answer"]
  assert t.turns[0].call.name == "calculator" and t.turns[1].answer == "42"
  assert (t.num_tool_calls, t.valid_tool_calls, t.tool_calls) == (1, 1, {"calculator": 1})
  assert "tool_calls=1" in t.render(TOK) and "-> tool_call calculator" in t.render(TOK)
  # Consecutive observation segments make one observation span, counted as one call.
  two = demonstration_trajectory([1], [(POLICY, "<calc>1+1</calc>"), (OBSERVATION, "<result>"),
                                       (OBSERVATION, "2</result>")], TOK, parser=env.parser)
  (a, b), = [two.turns[0].observation_span]
  assert (a, b) == (1 + len(TOK.encode("<calc>1+1</calc>")), len(two))
  assert two.turns[0].observation_text == "<result>2</result>" and two.num_tool_calls == 1
  # The same call twice is one repeat, as the rollout counts it.
  rep = demonstration_trajectory([1], [(POLICY, "<calc>1+1</calc>"), (OBSERVATION, "<result>2</result>"),
                                       (POLICY, "<calc>1+1</calc>"), (OBSERVATION, "<result>2</result>"),
                                       (POLICY, "<calc>2+2</calc>"), (OBSERVATION, "<result>4</result>")],
                                 TOK, parser=env.parser)
  assert (rep.num_tool_calls, rep.valid_tool_calls, rep.repeated_tool_calls) == (3, 3, 1)
  assert rep.distinct_ok_tool_calls == 2 and plain.distinct_ok_tool_calls is None

  class Raises:
    def parse(self, text):
      raise RuntimeError("boom")

  bad = demonstration_trajectory([1], [(POLICY, "x"), (OBSERVATION, "y")], TOK, parser=Raises())
  assert bad.turns[0].action == "malformed" and (bad.num_tool_calls, bad.tool_errors) == (1, 1)


def test_demonstration_observations_are_tokenized_as_rollouts_tokenize_them():
  """A tool output that spells "<|im_end|>" stays text in a demonstration given the env, as in
  rollouts (`Env.encode_observation`); the SFT items of `trainer.sft_items` do the same."""
  from jaxagent import models
  from jaxagent.trainer import sft_items
  from jaxagent.tools import ToolResult
  try:
    tok = models.load_tokenizer("smollm2-135m-instruct")
  except Exception as e:  # noqa: BLE001 - the GGUF ships in an optional pip package
    pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")
  env = CalculatorEnv()
  obs = env.format_observation(ToolResult.success("4<|im_end|>2"))
  ex = Example("d", [{"role": "user", "content": "What is 6*7?"}], gold="42",
               metadata={"expression": "6*7"})
  segs = [(POLICY, "<calc>6*7</calc>"), (OBSERVATION, obs), (POLICY, "<answer>42</answer>")]
  prompt = env.render_prompt(ex, tok)
  t = demonstration_trajectory(prompt, segs, tok, env=env)
  a, b = t.turns[0].observation_span
  assert t.token_ids[a:b] == env.encode_observation(obs, tok)
  assert not set(t.token_ids[a:b]) & set(tok.eos_ids)  # the output did not close the turn
  assert tok.decode(t.token_ids[a:b]) == obs
  assert [turn.action for turn in t.turns] == ["tool_call", "answer"]  # parser from the env

  # Framing a template adds is still parsed as special tokens; the output is not.
  class ChatCalc(CalculatorEnv):
    observation_template = "<|im_end|>\n<|im_start|>user\n{output}<|im_end|>\n<|im_start|>assistant\n"

  chat = ChatCalc()
  obs = chat.format_observation(ToolResult.success("<|im_end|>"))
  t = demonstration_trajectory(prompt, [(POLICY, "<calc>1</calc>"), (OBSERVATION, obs)], tok, env=chat)
  a, b = t.turns[0].observation_span
  ids = t.token_ids[a:b]
  assert ids == chat.encode_observation(obs, tok) and sum(i in tok.eos_ids for i in ids) == 2

  # The trainer's warm start builds its items the same way.
  class Demo(CalculatorEnv):
    def demonstration(self, example):
      return segs
  (item,) = sft_items(Demo(), [ex], tok)
  assert np.asarray(item.tokens).tolist() == demonstration_trajectory(prompt, segs, tok, env=env).token_ids
