"""Invariants of the rollout's token ledger and action mask, checked on randomised scenarios and
at the length boundaries (fake engine, fast), and on the real tiny model: the device's slot state
and cached K/V equal the ledger after every engine call, and a trajectory does not depend on what
shared the batch or used its slot before (slow).

The scripted tests of single behaviours (one budget, one error kind) are in rollout_test.py;
its fake engine checks the driver's side of the engine contract on every call.
"""
import importlib
import random

import jax
import numpy as np
import pytest

from jaxagent import models
from jaxagent.agent import (OBSERVATION, OBSERVATION_TEMPLATES, POLICY, PROMPT, STOP_REASONS,
                            CalculatorEnv, Example, JSONToolCallParser, RolloutConfig,
                            RolloutDriver, rollout, rollout_metrics)
from jaxagent.agent.trajectory import tool_call_key
from jaxagent.generate import Engine, EngineConfig, SamplingConfig
from tests.agent.rollout_test import (EOS, TOK, EchoEnv, FakeEngine, ScriptedCalcEnv,
                                      _script_from_texts, _ThinkingCalcEnv, check_ledger, nap, pair)

# Pieces of scripted turns: calls, answers, malformed and unbalanced tags, a tool that fails, a
# result too long for short limits, EOS inside a turn, think blocks, a configured stop string.
_PIECES = ["<calc>1+1</calc>", "<calc>2*", "3</calc>", "<answer>2</answer>", "</calc>",
           "<calc></calc>", "hello ", "x" * 7, "<pair>ab</pair>", chr(EOS), "<ans",
           "wer>5</answer>", "<nap>0.001</nap>", "STOP", "<calc>1/0</calc>", "<think>", "</think>",
           "<calc>99999999999*99999999999</calc>"]
_ENDS = ["<calc>1+2</calc>", "<answer>3</answer>", chr(EOS), "<nap>0.001</nap>", "", "<calc>5",
         "STOP"]
_STOPS = ["</calc>", "</answer>", "</pair>", "</nap>"]


def _scenario(seed):
  """A random rollout: prompts, samples, slots, budgets, limits and scripted turns from `seed`."""
  rng = random.Random(seed)
  n_prompts, g = rng.randint(1, 4), rng.randint(1, 3)
  texts = {rid: ["".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 3))) + rng.choice(_ENDS)
                 for _ in range(rng.randint(0, 6))]
           for rid in range(n_prompts * g)}
  max_len = rng.choice([48, 64, 100, 256])
  fake = FakeEngine(_script_from_texts(texts), slots=rng.randint(1, 5), max_len=max_len)
  think = rng.random() < 0.3
  env = _ThinkingCalcEnv() if think else ScriptedCalcEnv([nap, pair])
  cfg = RolloutConfig(max_turns=rng.randint(1, 5), max_tokens_per_turn=rng.randint(1, 40),
                      max_total_tokens=rng.choice([None, max_len, max_len - 7, 40]),
                      decode_steps=rng.randint(1, 9),
                      stop_strings=("STOP",) if rng.random() < 0.5 else ())
  examples = [Example(f"q{i}", f"Q{i}" + "?" * rng.randint(0, 30)) for i in range(n_prompts)]
  trajs = rollout(fake, None, env, examples, tokenizer=TOK, num_samples=g, cfg=cfg)
  fake.finalize()
  stops = (["</calc>", "</answer>"] if think else _STOPS) + list(cfg.stop_strings)
  return trajs, fake, cfg, stops, think, cfg.max_total_tokens or max_len


def _check_trajectory(t, fake, cfg, stops, think, limit):
  if t.stop_reason == "prompt_too_long":
    assert t.num_turns == 0 and len(t) == t.prompt_len and not t.loss_mask().any()
    return
  # The ledger is the engine's sequence; policy tokens and log-probs are what it sampled there;
  # the mask is 1 exactly on them.
  check_ledger(t, fake)
  assert len(t) <= limit
  assert set(t.role_ids[:t.prompt_len]) == {PROMPT} and set(t.turn_ids[:t.prompt_len]) == {-1}
  pos = t.prompt_len
  for k, turn in enumerate(t.turns):
    # Spans tile the ledger: prompt, then each turn's policy tokens and its observation.
    a, b = turn.policy_span
    assert a == pos < b
    toks = t.token_ids[a:b]
    assert set(t.role_ids[a:b]) == {POLICY} and set(t.turn_ids[a:b]) == {k}
    assert TOK.decode(toks) == turn.text
    assert b - a <= cfg.max_tokens_per_turn
    if turn.ended_by == "max_tokens_per_turn":
      assert b - a == cfg.max_tokens_per_turn
    if turn.ended_by == "length":
      assert len(t) == limit
    # A turn ends at the token that completes its first stop string, or at the first EOS.
    assert (turn.ended_by == "eos") == (toks[-1] == EOS)
    assert EOS not in toks[:-1]
    if not think:  # (a think block can refuse a stop string)
      assert not any(s in TOK.decode(toks[:-1]) for s in stops), turn.text
      if turn.ended_by == "stop":
        assert any(s in turn.text for s in stops)
      elif turn.ended_by != "eos":
        assert not any(s in turn.text for s in stops), turn.text
    pos = b
    if turn.observation_span is not None:  # every turn but the last is answered
      assert k < t.num_turns - 1
      oa, ob = turn.observation_span
      assert oa == b
      assert set(t.role_ids[oa:ob]) <= {OBSERVATION} and set(t.turn_ids[oa:ob]) <= {k}
      assert t.token_ids[oa:ob] == TOK.encode(turn.observation_text)
      pos = ob
    else:
      assert k == t.num_turns - 1
  assert pos == len(t)
  assert t.num_policy_tokens + t.num_observation_tokens + t.prompt_len == len(t)
  # The stop reason agrees with how the last turn ended and what it asked for.
  last, r = t.turns[-1], t.stop_reason
  if r == "answer":
    assert last.action == "answer" and t.final_answer == last.answer
  elif r == "eos":
    assert last.ended_by == "eos" and last.action != "answer"
  elif r == "no_tool_call":
    assert last.ended_by == "stop" and last.action == "text"
  elif r == "max_turns":
    assert t.num_turns == cfg.max_turns and last.action in ("tool_call", "malformed")
    assert last.outcome is None
  elif r == "max_tokens_per_turn":
    assert last.ended_by == "max_tokens_per_turn"
  elif r in ("max_total_tokens", "max_length"):
    assert r == ("max_total_tokens" if limit < fake.ecfg.max_len else "max_length")
    # Cut while decoding; a call that ended at the last position (not acted on); or a call
    # whose observation did not fit (run, never appended).
    assert (last.ended_by == "length"
            or (last.outcome is None and last.action in ("tool_call", "malformed") and len(t) == limit)
            or (last.outcome is not None and last.observation_text is not None
                and len(t) + len(TOK.encode(last.observation_text)) + 1 > limit))
  else:
    assert r == "tool_budget", r
  assert t.truncated == (r not in ("answer", "eos", "no_tool_call"))
  # Every call acted on has an outcome; every outcome but a dropped last one has an observation.
  assert t.num_tool_calls == sum(x.outcome is not None for x in t.turns)
  assert t.tool_errors == sum(not x.outcome.ok for x in t.turns if x.outcome is not None)
  assert t.valid_tool_calls == (t.num_tool_calls - t.malformed_calls - t.unknown_tool_calls
                                - t.bad_argument_calls) == sum(t.tool_calls.values())
  # The calls the tool bonus pays: distinct (tool, arguments) among the valid calls that ran.
  assert t.distinct_ok_tool_calls == len({tool_call_key(x.call.name, x.call.arguments) for x in t.turns
                                          if x.outcome is not None and x.outcome.ok})


@pytest.mark.parametrize("first", range(0, 400, 100))
def test_random_rollouts_keep_the_ledger_and_mask_invariants(first):
  """400 random rollouts (slots, decode steps, budgets, limits, stops, EOS, failing and slow
  tools, think blocks): each trajectory is exactly what the engine sampled, turn by turn, with
  its stop reason consistent with its last turn."""
  for seed in range(first, first + 100):
    trajs, fake, cfg, stops, think, limit = _scenario(seed)
    for t in trajs:
      try:
        _check_trajectory(t, fake, cfg, stops, think, limit)
      except AssertionError as e:
        raise AssertionError(f"scenario {seed}, request {t.request_id}: {e}\n"
                             f"{t.render(TOK)}") from e
    m = rollout_metrics(trajs)
    assert m["rollout/num_trajectories"] == len(trajs)
    assert sum(m[f"rollout/stop/{r}"] for r in STOP_REASONS) == pytest.approx(1.0)


def _prompt_len():
  return len(TOK.encode(Example("q0", "Q0: what is 0+1?").prompt))


@pytest.mark.parametrize("cap", ["max_total_tokens", "max_length"])
@pytest.mark.parametrize("room", [-1, 0, 1])
def test_an_observation_at_the_length_limit(cap, room):
  """The limit L counts prompt, policy and observation tokens. After a call whose stop token
  sits at position c (cached c tokens), the observation of n tokens goes in when the pending
  token, the observation and one new token fit (c + 1 + n + 1 <= L): then the next turn gets
  exactly L - (c + 1 + n) tokens and the ledger ends at L. One token less and the observation
  is dropped whole: the ledger ends at the call, the stop reason names the limit."""
  call, obs = "<calc>2+3</calc>", "<result>5</result>"
  cached = _prompt_len() + len(call) - 1
  limit = cached + 1 + len(obs) + 1 + room
  kw = dict(max_len=limit) if cap == "max_length" else dict(max_len=256)
  fake = FakeEngine(_script_from_texts({0: [call, "<answer>5</answer>"]}), slots=2, **kw)
  cfg = RolloutConfig(max_total_tokens=limit if cap == "max_total_tokens" else None,
                      max_tokens_per_turn=64, decode_steps=3)
  (t,) = rollout(fake, None, ScriptedCalcEnv([nap]), [Example("q0", "Q0: what is 0+1?")],
                 tokenizer=TOK, cfg=cfg)
  fake.finalize()
  check_ledger(t, fake)
  assert (t.stop_reason, t.truncated) == (cap, True)
  assert t.turns[0].outcome.ok and t.turns[0].observation_text == obs
  if room < 0:
    assert len(t) == cached + 1 and t.num_turns == 1 and t.turns[0].observation_span is None
    assert t.num_observation_tokens == 0
  else:
    assert len(t) == limit and t.num_turns == 2
    assert t.turns[0].observation_span == (cached + 1, cached + 1 + len(obs))
    a, b = t.turns[1].policy_span
    assert (b - a, t.turns[1].ended_by) == (1 + room, "length")
    assert t.turns[1].text == "<answer>5"[:1 + room]
  np.testing.assert_array_equal(t.loss_mask(), t.roles == POLICY)
  inp = t.to_reward_input(TOK, "5", policy_only=True)
  assert inp.truncated and inp.metadata["stop_reason"] == cap
  assert inp.metadata["final_answer"] is None


@pytest.mark.parametrize("last", ["<answer>5</answer>", "<calc>1+1</calc>"])
def test_a_turn_whose_stop_string_ends_on_the_last_position(last):
  """A closing tag on the ledger's last allowed position still ends the turn by its stop string:
  an answer there is a natural end ("answer", not truncated); a call there runs, but its
  observation cannot follow, so the trajectory ends at the limit."""
  limit = _prompt_len() + len(last)
  fake = FakeEngine(_script_from_texts({0: [last + " more"]}), slots=1, max_len=256)
  (t,) = rollout(fake, None, ScriptedCalcEnv([nap]), [Example("q0", "Q0: what is 0+1?")],
                 tokenizer=TOK, cfg=RolloutConfig(max_total_tokens=limit, decode_steps=4))
  fake.finalize()
  check_ledger(t, fake)
  assert len(t) == limit and t.turns[0].text == last and t.turns[0].ended_by == "stop"
  if last.startswith("<answer>"):
    assert (t.stop_reason, t.truncated, t.final_answer) == ("answer", False, "5")
  else:
    assert (t.stop_reason, t.truncated) == ("max_total_tokens", True)
    assert t.turns[0].observation_span is None and t.num_observation_tokens == 0


def test_rollout_stats_and_metrics_on_a_hand_counted_case():
  """`RolloutStats` and `rollout_metrics` of runs counted by hand, one slot, 4 tokens a decode
  call: prefill samples a turn's token 1, decode calls its tokens 2-5, 6-9, ... Request 0 says
  "<calc>1+1</calc>" (16 tokens) then "<answer>2</answer>" (18), request 1 "x" * 30 and then
  filler, request 2 "abcd" and EOS."""
  texts = {0: ["<calc>1+1</calc> and more", "<answer>2</answer>"], 1: ["x" * 30],
           2: ["abcd" + chr(EOS)]}
  fake = FakeEngine(_script_from_texts(texts), slots=1, max_len=256)
  examples = [Example(f"q{i}", "Q") for i in range(3)]
  # A 12-token turn budget: requests 0 and 1 end by it (prefill + 3 calls, no token past it),
  # request 2 at EOS (prefill + 1 call, EOS its last token).
  driver = RolloutDriver(fake, ScriptedCalcEnv([nap]), tokenizer=TOK,
                         cfg=RolloutConfig(decode_steps=4, max_tokens_per_turn=12))
  with driver:
    trajs = driver.run(None, examples)
  assert [t.stop_reason for t in trajs] == ["max_tokens_per_turn", "max_tokens_per_turn", "eos"]
  s = driver.stats
  assert (s.prefill_calls, s.generate_calls, s.append_calls, s.update_calls) == (3, 7, 0, 0)
  assert s.decoded_tokens == 12 + 12 + 5
  # A 64-token budget. Request 0: turn 1 is prefill + 4 calls (tokens 2-17; the stop at 16
  # discards 17 and rewinds the slot), turn 2 append + 5 calls (tokens 2-21; 19-21 discarded, a
  # rewind). Request 1: prefill + 16 calls (63 tokens, the last call's third ends the budget).
  driver = RolloutDriver(fake, ScriptedCalcEnv([nap]), tokenizer=TOK,
                         cfg=RolloutConfig(decode_steps=4, max_tokens_per_turn=64))
  with driver:
    trajs = driver.run(None, examples)
  assert [t.stop_reason for t in trajs] == ["answer", "max_tokens_per_turn", "eos"]
  s = driver.stats
  assert (s.prefill_calls, s.append_calls, s.update_calls) == (3, 1, 2)
  assert s.generate_calls == (4 + 5) + 16 + 1
  assert s.decoded_tokens == (1 + 16) + (1 + 20) + 64 + 5
  assert s.max_concurrent_tools == 1 and s.wall_s >= s.generate_s > 0
  lens = [len(t) for t in trajs]
  assert lens == [1 + 16 + len("<result>2</result>") + 18, 1 + 64, 1 + 5]
  m = rollout_metrics(trajs)
  assert m["rollout/num_trajectories"] == 3
  assert m["rollout/total_tokens"] == pytest.approx(np.mean(lens))
  assert (m["rollout/total_tokens_p50"], m["rollout/total_tokens_max"]) == (53, 65)
  assert m["rollout/policy_tokens"] == pytest.approx((34 + 64 + 5) / 3)
  assert (m["rollout/policy_tokens_p50"], m["rollout/policy_tokens_max"]) == (34, 64)
  assert (m["rollout/turns"], m["rollout/turns_max"]) == (pytest.approx(4 / 3), 2)
  assert (m["rollout/turns_frac/1"], m["rollout/turns_frac/2"]) == (pytest.approx(2 / 3),
                                                                    pytest.approx(1 / 3))
  for reason in ("answer", "eos", "max_tokens_per_turn"):
    assert m[f"rollout/stop/{reason}"] == pytest.approx(1 / 3)
  assert m["rollout/stop/no_tool_call"] == 0.0
  assert m["rollout/truncated"] == pytest.approx(1 / 3)
  assert m["rollout/num_tool_calls"] == m["rollout/valid_tool_calls"] == pytest.approx(1 / 3)
  assert m["rollout/tool/calculator"] == pytest.approx(1 / 3)
  assert m["rollout/tool_errors"] == m["rollout/tool_error_rate"] == 0.0



# Fragments of turns in a real byte-level BPE vocabulary: the JSON call convention, tags split
# anywhere, tokens that run past a closing tag (">\n", ">."), characters of several byte tokens
# and a non-ASCII stop string.
_BPE_FRAGMENTS = ["<tool_call>", '{"name": "calculator", "arguments": {"expression": "1+1"}}',
                  "</", "tool", "_call", ">", "\n\n", "</tool_call>", "é漢字🙂", "<answer>", "4",
                  "</answer>", "answer>", " ", "x", "</tool_call>.", ">\n", "終了", "終", "了",
                  "終了" * 4]


def test_turns_end_at_the_first_stop_string_with_a_real_bpe_tokenizer():
  """Byte-level BPE tokens (SmolLM2): whatever way a stop string is split over tokens, or shares
  its last token with text after it, a turn ends at the first token whose decoded prefix holds a
  stop string (or at EOS), never later; its tokens are those sampled; each observation is the
  env's encoding of its text. An 8-character stop string of 16 byte tokens is found too."""
  try:
    tok = models.load_tokenizer("smollm2-135m-instruct")
  except Exception as e:  # noqa: BLE001 - the GGUF ships in an optional pip package
    pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")

  class ChatCalc(CalculatorEnv):
    observation_template = OBSERVATION_TEMPLATES["chatml_tool"]

    def __init__(self):
      super().__init__()
      self.parser = JSONToolCallParser(answer_tag="answer")

  env, eos = ChatCalc(), sorted(tok.eos_ids)
  stops = ["</tool_call>", "</answer>", "終了" * 4]  # 8 characters, 16 tokens
  assert len(tok.encode(stops[-1])) == 16
  ex = Example("c", [{"role": "user", "content": "What is 6*7?"}], gold="42")
  for seed in range(60):
    rng = random.Random(seed)
    scripts = {}
    for rid in range(3):
      turns = []
      for _ in range(rng.randint(1, 4)):
        ids = []
        for _ in range(rng.randint(1, 8)):
          piece = rng.choice(_BPE_FRAGMENTS)
          # As the tokenizer splits it, or character by character (other token boundaries).
          ids += (tok.encode(piece) if rng.random() < 0.6
                  else [i for c in piece for i in tok.encode(c)])
        turns.append(ids + ([eos[-1]] if rng.random() < 0.2 else []))
      scripts[rid] = turns
    fake = FakeEngine(lambda rid, k, sc=scripts: sc[rid][k] if k < len(sc[rid]) else [],
                      slots=rng.randint(1, 3), max_len=512, eos_ids=tuple(eos),
                      filler=tok.encode("z")[0])
    cfg = RolloutConfig(max_turns=4, max_tokens_per_turn=rng.randint(4, 80),
                        decode_steps=rng.randint(1, 6), stop_strings=(stops[-1],))
    trajs = rollout(fake, None, env, [ex], tokenizer=tok, num_samples=3, cfg=cfg)
    fake.finalize()
    for t in trajs:
      check_ledger(t, fake, tok)
      for turn in t.turns:
        a, b = turn.policy_span
        toks = t.token_ids[a:b]
        first_stop = next((i for i in range(len(toks))
                           if any(s in tok.decode(toks[:i + 1]) for s in stops)), None)
        first_eos = next((i for i, x in enumerate(toks) if x in tok.eos_ids), None)
        end = min(i for i in (first_stop, first_eos, len(toks) - 1) if i is not None)
        assert end == len(toks) - 1, (seed, turn.text)
        assert (turn.ended_by == "stop") == (first_stop == end and first_eos != end), (
            seed, turn.ended_by, turn.text)
        if turn.observation_span is not None:
          oa, ob = turn.observation_span
          assert t.token_ids[oa:ob] == env.encode_observation(turn.observation_text, tok)


# --------------------------------------------------------------------------------------- real model

# The module (`jaxagent.agent.rollout` is also the name of the function).
_driver = importlib.import_module("jaxagent.agent.rollout")


@pytest.mark.slow  # 10-40 s each on 2 cores (compiles of the tiny model; Pallas in interpret mode)
@pytest.mark.parametrize("kernel", ["xla", "pallas", "pallas-merged"])
def test_real_engine_slots_hold_exactly_the_ledger(monkeypatch, kernel):
  """The real engine and the driver agree after every prefill, decode and append call: each live
  slot's cached length, pending token and activity are the ledger's (its last token pending,
  frozen unless its turn is decoding), and its cached K/V equal a fresh prefill of the ledger
  (so the next turn's context is the ledger, nothing sampled past a stop and nothing of the
  slot's earlier trajectory). Then every trajectory equals its run alone. With "pallas" the
  per-layer cache and the decode kernel reading shared prompt rows: the samples of a prompt
  share them while other groups take over finished slots; "pallas-merged" decodes as GPUs do by
  default, with the run's prepared weights (q|k|v and gate|up merged, norms folded, matrices
  chained, the raw q|k|v projection into the kernel) while prefill and append use the plain
  ones."""
  if kernel != "xla":
    monkeypatch.setenv("JAXAGENT_DECODE_KERNEL", "block_k=16")  # whole shared blocks
  cfg = models.get_config("tiny-llama")
  params = models.init_params(cfg, jax.random.key(0), std=0.2)
  layout = {} if kernel == "xla" else dict(decode_attention="pallas", cache_layout="per_layer")
  if kernel == "pallas-merged":
    layout.update(decode_merge_weights=True, decode_chain_weights=True)
  engine = Engine(cfg, EngineConfig(slots=3, max_len=96, eos_ids=(EOS,),
                                    sampling=SamplingConfig(temperature=1.0), **layout))
  if kernel == "pallas-merged":
    prepared = engine.prepare(params)
    assert engine.merges(4, prepared)
    if jax.default_backend() == "cpu":  # (on a GPU the kernel may not take this head size raw)
      assert engine.fold_norms and engine.chain_weights and engine.fuses_qkv(4, prepared)
  seen = {"checks": 0, "states": set(), "shared": 0, "on": True}

  def check(run):
    st = run.state
    lengths, tokens, active, share_len, k, v = jax.device_get(
        (st.lengths, st.tokens, st.active, st.share_len, st.k, st.v))
    k, v = (np.stack(x, 0) if isinstance(x, (tuple, list)) else np.asarray(x) for x in (k, v))
    seen["shared"] = max(seen["shared"], int(np.max(share_len)))
    for s, lv in run.live.items():
      seq = lv.traj.token_ids + lv.toks  # the ledger so far, the turn in progress included
      assert lengths[s] == lv.cached == len(seq) - 1 and tokens[s] == seq[-1]
      assert bool(active[s]) == (lv.phase == "decode")
      pre = engine.prefill(params, [seq[:-1]], [0])
      for cache, fresh in ((k, pre.k), (v, pre.v)):  # [L, S, KV, T, hd] vs [L, 1, T, KV, hd]
        got = cache[:, s, :, :lv.cached].transpose(0, 2, 1, 3)
        np.testing.assert_allclose(got, np.asarray(fresh)[:, 0, :lv.cached], atol=1e-4)
      seen["checks"] += 1
      seen["states"].add(lv.phase)

  for name in ("_admit", "_generate", "_append"):
    def wrapped(self, *a, _real=getattr(_driver._Run, name), **kw):
      out = _real(self, *a, **kw)
      if seen["on"]:
        check(self)
      return out
    monkeypatch.setattr(_driver._Run, name, wrapped)
  examples = [Example(f"e{i}", f"P{i}:" + "." * (13 + 9 * i)) for i in range(4)]
  rcfg = RolloutConfig(max_turns=4, max_tokens_per_turn=12, decode_steps=4)
  trajs = rollout(engine, params, EchoEnv(), examples, tokenizer=TOK, num_samples=2, cfg=rcfg,
                  seed=3)
  assert seen["checks"] >= 30 and seen["states"] == {"decode", "tool"}
  assert seen["shared"] >= (0 if kernel == "xla" else 16)
  assert sum(t.num_turns for t in trajs) >= 12  # several appends into live slots
  seen["on"] = False
  for t in trajs:  # alone in the engine, under its own request id
    (alone,) = rollout(engine, params, EchoEnv(), [examples[t.group_id]], tokenizer=TOK,
                       cfg=rcfg, seed=3, request_id_offset=t.request_id)
    assert (alone.token_ids, alone.role_ids, alone.stop_reason) == (t.token_ids, t.role_ids,
                                                                   t.stop_reason)
    np.testing.assert_allclose(alone.logprobs, t.logprobs, atol=1e-5)
