"""The scheduler's host-side logic: input checks before any work, stop reasons, slot reuse.

(The engine-level tests of `generate` and `run_requests` are in engine_test.py.)
"""
import re

import jax
import numpy as np
import pytest

from jaxagent import models
from jaxagent.generate import Completion, Engine, EngineConfig, generate, run_requests

CFG = models.get_config("tiny-qwen2")


@pytest.fixture(scope="module")
def params():
  return models.init_params(CFG, jax.random.key(0), std=0.2)


@pytest.fixture(scope="module")
def engine():
  return Engine(CFG, EngineConfig(slots=1, max_len=32))


@pytest.mark.parametrize("bad,match", [
    ([[1, 2], [3, 4], [5, CFG.vocab_size]], rf"prompt 2 has token id {CFG.vocab_size} outside"),
    ([[1, 2], [3, 4], []], "prompt 2 is empty"),
    ([[1, 2], [3, 4], [5, 1.5]], r"prompt 2 has a float \(1.5\) at position 1 among its token ids"),
])
def test_a_bad_prompt_in_the_queue_is_refused_before_anything_runs(params, engine, monkeypatch,
                                                                   bad, match):
  """With one slot, prompts 0 and 1 would be generated before prompt 2 is prefilled: its error
  must come first, and name its index among all prompts (not within its prefill batch)."""
  calls = []
  real = engine.prefill_insert
  monkeypatch.setattr(engine, "prefill_insert", lambda *a, **k: calls.append(1) or real(*a, **k))
  with pytest.raises(ValueError, match=match):
    run_requests(engine, params, bad, max_new_tokens=4, request_ids=[0, 1, 2])
  assert calls == []


def test_bad_request_ids_and_seed_are_refused_before_anything_runs(params, engine, monkeypatch):
  calls = []
  real = engine.prefill_insert
  monkeypatch.setattr(engine, "prefill_insert", lambda *a, **k: calls.append(1) or real(*a, **k))
  with pytest.raises(ValueError, match=r"request_ids must be integers in \[.*got \[2147483648\]"):
    run_requests(engine, params, [[1], [2], [3]], max_new_tokens=2, request_ids=[0, 1, 2 ** 31])
  for seed in (-1, 2 ** 32):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
      run_requests(engine, params, [[1], [2]], max_new_tokens=2, request_ids=[0, 1], seed=seed)
  for steps in (0, True, 2.5):  # (True ran as one step per call)
    with pytest.raises(ValueError, match=r"decode_steps must be a positive int, got"):
      run_requests(engine, params, [[1]], max_new_tokens=2, request_ids=[0], decode_steps=steps)
  assert calls == []


def test_a_bad_budget_in_the_queue_is_refused_before_anything_runs(params, engine, monkeypatch):
  """A budget prefill refuses (2**31 does not fit its int32), for a prompt waiting behind
  others, ended the run after prompts 0 and 1 were generated, in prefill's words."""
  calls = []
  real = engine.prefill_insert
  monkeypatch.setattr(engine, "prefill_insert", lambda *a, **k: calls.append(1) or real(*a, **k))
  for budgets, got in (([2, 2, 2 ** 31], r"\[2147483648\]"), ([2, 0, 2], r"\[0\]")):
    with pytest.raises(ValueError, match=r"run_requests: max_new_tokens must be integers >= 1 "
                       r"\(at most 2147483647\), got " + got):
      run_requests(engine, params, [[1], [2], [3]], max_new_tokens=budgets,
                   request_ids=[0, 1, 2])
  assert calls == []


def test_generate_checks_budgets_once_before_building_an_engine(params, monkeypatch):
  """`generate` refuses a wrong budget count itself, in its own name, before it builds (and
  caches) an engine sized from those budgets; the bad count is named before a bad value."""
  from jaxagent.generate import scheduler
  built = []
  monkeypatch.setattr(scheduler, "_engine", lambda *a: built.append(a))
  with pytest.raises(ValueError, match="2 budgets for 3 prompts"):
    generate(params, CFG, [[1], [2], [3]], [4, 4])
  with pytest.raises(ValueError, match="2 budgets for 1 prompts"):
    generate(params, CFG, [[1]], [4, -1])
  assert built == []


def test_numpy_and_jax_array_prompts(params, engine):
  """A `[B, T]` array is B prompts, a `[T]` array one prompt, as the same nested lists are."""
  batch = np.asarray([[1, 2, 3], [4, 5, 6]])
  want = [c.tokens for c in generate(params, CFG, batch.tolist(), 3)]
  assert [c.tokens for c in generate(params, CFG, batch, 3)] == want
  assert [c.tokens for c in generate(params, CFG, jax.numpy.asarray(batch), 3)] == want
  assert generate(params, CFG, batch[1], 3)[0].tokens == want[1]
  # A list of arrays (one per prompt): JAX ones failed with "unhashable type".
  for rows in ([np.asarray(r) for r in batch], [jax.numpy.asarray(r) for r in batch]):
    assert [c.tokens for c in generate(params, CFG, rows, 3)] == want
    assert [c.tokens for c in run_requests(engine, params, rows, max_new_tokens=3,
                                           request_ids=[0, 1])] == want


def test_bad_budgets_and_slots_are_clear_errors(params):
  for budget in (4.0, [2.7], True, "4"):
    with pytest.raises(ValueError, match="max_new_tokens must be an int or a sequence of one int"):
      generate(params, CFG, [[1, 2]], budget)
  with pytest.raises(ValueError, match="0 budgets for 1 prompts"):
    generate(params, CFG, [[1, 2]], [])
  # A budget below one is named as such (with -3 the default max_len came out as 1 and the
  # error was "EngineConfig.max_len must be > 1").
  for budget in (-3, 0, [2, -1]):
    with pytest.raises(ValueError, match=r"max_new_tokens must be integers >= 1"):
      generate(params, CFG, [[1, 2, 3], [4]][:np.size(budget)], budget)
  for slots in (0, None, 2.0, True):
    with pytest.raises(ValueError, match="slots must be a positive int"):
      generate(params, CFG, [[1, 2]], 2, slots=slots)
  assert (generate(params, CFG, [[1, 2]], 3, slots=np.int64(2))[0].tokens
          == generate(params, CFG, [[1, 2]], 3, slots=2)[0].tokens)


def test_an_empty_batch_still_refuses_bad_settings(params):
  # With no prompt, generate returned [] whatever the sampling settings and budget.
  assert generate(params, CFG, [], 4, temperature=0.7, top_p=0.9) == []
  for kw, match in ((dict(temperature=-1.0), "temperature must be >= 0"),
                    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
                    (dict(top_k=-2), "top_k must be >= 0"),
                    (dict(max_new_tokens=-5), "max_new_tokens must be integers >= 1"),
                    (dict(max_new_tokens=2.5), "max_new_tokens must be an int")):
    with pytest.raises(ValueError, match=match):
      generate(params, CFG, [], **kw)


def test_budgets_and_request_ids_as_numpy_or_jax_arrays(params, engine):
  """Arrays of budgets or request ids are the numbers they hold: a 0-d NumPy budget failed with
  TypeError "iteration over a 0-d array", JAX arrays of budgets or ids were refused as not
  integers, and NumPy ids came back as np.int64 `request_id`s."""
  jnp = jax.numpy
  prompts = [[1, 2], [3]]
  want = [(c.tokens, c.request_id) for c in generate(params, CFG, prompts, [3, 2],
                                                      request_ids=[4, 7])]
  for budgets in (np.asarray([3, 2]), jnp.asarray([3, 2])):
    for rids in (np.asarray([4, 7]), jnp.asarray([4, 7])):
      got = generate(params, CFG, prompts, budgets, request_ids=rids)
      assert [(c.tokens, c.request_id) for c in got] == want
      assert all(type(c.request_id) is int for c in got)
  one = [c.tokens for c in generate(params, CFG, prompts, 3)]
  for budget in (np.asarray(3), jnp.asarray(3)):
    assert [c.tokens for c in generate(params, CFG, prompts, budget)] == one
  ref = run_requests(engine, params, prompts, max_new_tokens=2, request_ids=[4, 7])
  got = run_requests(engine, params, prompts, max_new_tokens=jnp.asarray(2),
                     request_ids=jnp.asarray([4, 7]))
  assert [(c.tokens, c.request_id) for c in got] == [(c.tokens, c.request_id) for c in ref]
  for bad in (np.asarray(2.5), np.asarray(True), np.asarray([[3, 2]]), jnp.asarray([3.0, 2.0])):
    with pytest.raises(ValueError, match="max_new_tokens must be an int or a sequence of one"):
      generate(params, CFG, prompts, bad)


def test_run_requests_takes_a_stop_spec(params, engine):
  """`stop` as a spec (token-id sequences) is what the same `StopChecker` gives (a list
  failed with AttributeError after the first prefill)."""
  from jaxagent.generate import StopChecker
  ref = run_requests(engine, params, [[1, 2, 3]], max_new_tokens=12, request_ids=[0])[0].tokens
  spec = [ref[4:6]]
  got = run_requests(engine, params, [[1, 2, 3]], max_new_tokens=12, request_ids=[0],
                     stop=spec)[0]
  want = run_requests(engine, params, [[1, 2, 3]], max_new_tokens=12, request_ids=[0],
                      stop=StopChecker(spec))[0]
  assert got.tokens == want.tokens and got.stop_reason == "stop"
  assert got.tokens[-2:] == ref[4:6] and got.tokens == ref[:len(got.tokens)]
  with pytest.raises(ValueError, match="stop strings need a tokenizer"):
    run_requests(engine, params, [[1, 2, 3]], max_new_tokens=4, request_ids=[0], stop="</a>")


@pytest.mark.slow  # default-run time budget: 7-13 s on 2 cores
def test_which_stop_reason_wins_at_one_token(params):
  """The documented order at one token: "eos", then "stop", "max_new_tokens", "max_length";
  the token that ended the request is the last of `tokens` in every case. An EOS id that
  completes a stop sequence ends the request as "eos", as the rollout driver reports it."""
  prompt = [3, 1, 4, 1, 5]
  ref = generate(params, CFG, [prompt], 8, max_len=64)[0].tokens
  t = ref[3]
  assert t not in ref[:3]
  cases = [  # (kwargs, reason): each ends at token 3
      (dict(eos_ids=[t], stop=[[t]]), "eos"),
      (dict(eos_ids=[t], stop=[ref[2:4]], max_len=len(prompt) + 4), "eos"),
      (dict(stop=[ref[2:4]], budget=4, max_len=len(prompt) + 4), "stop"),
      (dict(eos_ids=[t]), "eos"),
      (dict(eos_ids=[t], max_len=len(prompt) + 4), "eos"),
      (dict(eos_ids=[t], budget=4), "eos"),
      (dict(budget=4, max_len=len(prompt) + 4), "max_new_tokens"),
      (dict(max_len=len(prompt) + 4), "max_length"),
  ]
  for kw, reason in cases:
    budget = kw.pop("budget", 8)
    for steps in (1, 3):
      out = generate(params, CFG, [prompt], budget, decode_steps=steps,
                     **{"max_len": 64, **kw})[0]
      assert (out.stop_reason, out.tokens) == (reason, ref[:4]), (kw, steps)


def test_an_engine_stop_for_a_short_kv_len_is_a_clear_error(params, monkeypatch):
  """A slot the engine stops because the kv_len bound was below its cached length
  (STOP_KV_LEN: engine and scheduler disagree about its length) ends the run with an error
  naming the slot, not a KeyError on the unknown code or a request cut short."""
  eng = Engine(CFG, EngineConfig(slots=1, max_len=32, kv_page=8))
  real = eng.generate
  monkeypatch.setattr(eng, "generate", lambda p, st, steps, kv_len: real(p, st, steps, kv_len=1))
  with pytest.raises(RuntimeError, match=r"stopped slots \[0\] \(STOP_KV_LEN\).* lengths \[12\]"):
    run_requests(eng, params, [list(range(1, 13))], max_new_tokens=4, request_ids=[0])


def test_an_unknown_engine_stop_code_is_a_clear_error(params, monkeypatch):
  """A stop code the scheduler does not know (an engine of another version, say) ends the run
  with an error naming it, the slot and the request: after prefill, a token that also
  completed a stop string was reported as a "stop" completion; after a decode call it was a
  KeyError on the code."""
  eng = Engine(CFG, EngineConfig(slots=2, max_len=32))
  prompt = list(range(1, 9))
  first = run_requests(eng, params, [prompt], max_new_tokens=4, request_ids=[5])[0].tokens[0]
  real_prefill, real_generate = eng.prefill_insert, eng.generate

  def prefill_insert(*a, **k):
    state, (toks, lps, done) = real_prefill(*a, **k)
    return state, (toks, lps, np.where(np.arange(len(done)) == 0, 9, done))

  with monkeypatch.context() as m:
    m.setattr(eng, "prefill_insert", prefill_insert)
    with pytest.raises(RuntimeError, match=r"engine's prefill reported stop codes \[9\] for "
                       r"slots \[0\] \(requests \[5\]\), neither RUNNING"):
      run_requests(eng, params, [prompt], max_new_tokens=4, request_ids=[5], stop=[[first]])
  monkeypatch.setattr(eng, "generate", lambda *a, **k: (
      lambda st, out: (st, out.replace(done=out.done.at[0].set(9))))(*real_generate(*a, **k)))
  with pytest.raises(RuntimeError, match=r"engine's decode call reported stop codes \[9\] for "
                     r"slots \[0\] \(requests \[5\]\)"):
    run_requests(eng, params, [prompt], max_new_tokens=4, request_ids=[5])


def test_stop_im_end_with_the_smollm2_tokenizer_ends_by_eos(params):
  """generate(stop=["<|im_end|>"]) with SmolLM2's tokenizer, whose EOS ids include <|im_end|>
  (id 2): a sampled <|im_end|> ends the request as "eos", as the rollout driver reports such a
  turn (it was "stop")."""
  try:
    tok = models.load_tokenizer("smollm2-135m-instruct")
  except Exception as e:  # noqa: BLE001 - the GGUF ships in an optional pip package
    pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")
  from jaxagent.models import param_tree
  im_end = 2
  assert tok.encode("<|im_end|>") == [im_end] and im_end in tok.eos_ids
  prompt = [3, 1, 4, 1, 5]
  ref = generate(params, CFG, [prompt], 4, eos_ids=[], max_len=64)[0].tokens
  assert ref[3] not in ref[:3] and not set(tok.eos_ids) & set(ref), ref  # the test's premise
  # The same model with <|im_end|>'s (tied) embedding a hair above that of ref[3]: it samples
  # ref[:3], then <|im_end|> where it sampled ref[3].
  p = param_tree.unbox(params)
  p = dict(p, embed=p["embed"].at[im_end].set(p["embed"][ref[3]] * 1.001))
  out = generate(p, CFG, [prompt], 4, tokenizer=tok, stop=["<|im_end|>"], max_len=64)[0]
  assert (out.tokens, out.stop_reason, out.stop_match) == (ref[:3] + [im_end], "eos", None)


def test_eos_ids_one_int_or_ids_in_the_vocabulary(params):
  """One int is one EOS id (it failed with "'int' object is not iterable"); a float or a string
  was cut by int() to another token's id, and an id outside the vocabulary (a tokenizer that
  does not match the model) silently never ended a request: both are clear errors."""
  ref = generate(params, CFG, [[1, 2, 3]], 8)[0].tokens
  eos = ref[2]
  assert eos not in ref[:2]
  for spec in (eos, np.int64(eos), [eos], (eos,), np.asarray([eos])):
    out = generate(params, CFG, [[1, 2, 3]], 8, eos_ids=spec)[0]
    assert (out.stop_reason, out.tokens) == ("eos", ref[:3]), spec
  for spec in ([eos + 0.5], [str(eos)], "2", 2.0, [True], {"a": 1}):
    with pytest.raises(ValueError, match="eos_ids must be an int or a sequence of int token"):
      generate(params, CFG, [[1, 2, 3]], 8, eos_ids=spec)
  for spec, got in (([CFG.vocab_size + eos], CFG.vocab_size + eos), ([eos, -1], -1)):
    with pytest.raises(ValueError, match=rf"eos_ids \[{got}\] are outside the model's vocab"):
      generate(params, CFG, [[1, 2, 3]], 8, eos_ids=spec)


def test_prompts_that_are_not_text_or_token_ids_are_clear_errors(params):
  """A bytes prompt was read as token ids (list(b"hi") is [104, 105]) and generated from
  silently; a prompt that is not a sequence failed with "'NoneType' object is not iterable"."""
  for prompts in (b"hi", [b"hi"], [[1, 2], bytearray(b"hi")]):
    with pytest.raises(ValueError, match=r"prompt \d is bytes .*pass text as a str"):
      generate(params, CFG, prompts, 2)
  for prompts, got in (([[1, 2], None], "prompt 1 .* got NoneType"),
                       ([1.5, 2.5], "prompt 0 .* got float"), (None, "prompts must be a list")):
    with pytest.raises(ValueError, match=got):
      generate(params, CFG, prompts, 2)
  # A generator of prompts is a list of prompts.
  want = [c.tokens for c in generate(params, CFG, [[1, 2], [3]], 2)]
  assert [c.tokens for c in generate(params, CFG, (p for p in [[1, 2], [3]]), 2)] == want


def test_a_config_or_mesh_of_the_wrong_type_is_a_clear_error(params):
  """A preset name for `cfg` (as `models.load` takes one) failed with "'str' object has no
  attribute 'eos_token_ids'", a mesh that is not a `Mesh` with "... no attribute 'shape'", and
  a dict of engine settings with "... no attribute 'max_len'"."""
  for call in (lambda: generate(params, "tiny-qwen2", [[1, 2]], 2),
               lambda: Engine("tiny-qwen2", EngineConfig(slots=1, max_len=32)),
               lambda: Engine(CFG.__dict__, EngineConfig(slots=1, max_len=32))):
    with pytest.raises(TypeError, match=r"cfg must be a jaxagent.models.ModelConfig .*"
                                        r"models.get_config\(name\).*got (str|dict)"):
      call()
  with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh .*got str"):
    generate(params, CFG, [[1, 2]], 2, mesh="data")
  with pytest.raises(TypeError, match=r"ecfg must be an EngineConfig \(or pass its settings as "
                                      r"keywords: .*got dict"):
    Engine(CFG, {"slots": 2, "max_len": 32})


def test_a_prompt_too_long_for_the_model_is_not_told_to_raise_max_len(params):
  """At the model's max_seq_len (generate's default for a long prompt) the error still said
  "raise max_len, up to the model's max_seq_len", which was no way out."""
  with pytest.raises(ValueError, match=re.escape(
      f"prompt 0 has {CFG.max_seq_len} tokens; the engine's max_len is {CFG.max_seq_len} "
      "(prompt plus at least one new token must fit: shorten the prompt)")):
    generate(params, CFG, [[1] * CFG.max_seq_len], 2)
  with pytest.raises(ValueError, match=re.escape(
      f"must fit: raise max_len, up to the model's max_seq_len {CFG.max_seq_len}, or shorten")):
    generate(params, CFG, [[1] * 40], 2, max_len=32)


def test_a_tokenizer_given_by_its_path_or_preset_name(params, tmp_path):
  """`generate(tokenizer=...)` with the path or preset `models.load` was given (as
  `JetStreamEngine` takes it) failed with "'str' object has no attribute 'decode'"."""
  tok = models.load_tokenizer("smollm2-135m-instruct")
  path = tok.save(tmp_path / "tok")
  kw = dict(stop=[" "], eos_ids=list(CFG.eos_token_ids))  # the other tests' compiled engine
  want = generate(params, CFG, [[1, 2, 3]], 4, tokenizer=tok, **kw)
  for given in ("smollm2-135m-instruct", path):
    got = generate(params, CFG, [[1, 2, 3]], 4, tokenizer=given, **kw)
    assert [(c.tokens, c.text, c.stop_reason) for c in got] == [
        (c.tokens, c.text, c.stop_reason) for c in want]
  assert want[0].text == tok.decode(want[0].tokens, skip_special_tokens=True)


def test_repeated_request_ids_are_refused(params, engine):
  """The rng derives from (seed, request id, position): two samples of one prompt under one id
  were the same sample, silently (a GRPO group with no variance)."""
  with pytest.raises(ValueError, match=r"request_ids \[5\] repeat"):
    generate(params, CFG, [[1, 2], [1, 2], [3]], 3, temperature=1.0, request_ids=[5, 5, 6])
  with pytest.raises(ValueError, match=r"request_ids \[0\] repeat"):
    run_requests(engine, params, [[1], [2]], max_new_tokens=2, request_ids=[0, np.int64(0)])
  a, b = generate(params, CFG, [[1, 2], [1, 2]], 6, temperature=1.0, request_ids=[5, 6])
  assert a.tokens != b.tokens


def test_stop_token_ids_outside_the_vocabulary_are_refused(params, engine):
  """Such a stop could never match, so the request ran on to its budget without a word."""
  for seq in ([CFG.vocab_size], [3, -1]):
    with pytest.raises(ValueError, match=re.escape(f"stop token-id sequence {seq} has ids")):
      generate(params, CFG, [[1, 2]], 3, stop=[[1], seq])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
      run_requests(engine, params, [[1, 2]], max_new_tokens=3, request_ids=[0], stop=[seq])


def test_text_prompts_start_with_the_bos_the_tokenizer_adds(bos_tokenizer, monkeypatch):
  """A tokenizer whose own encoding adds BOS (Llama 3's post-processor): a text prompt reached
  the model without it; a text that already starts with it (a chat-templated prompt) gets no
  second one; a tokenizer that adds none (SmolLM2's) is encoded as before."""
  from jaxagent.generate import scheduler
  tok, bos_tok = models.load_tokenizer("smollm2-135m-instruct"), bos_tokenizer
  seen = []
  real = scheduler.run_requests
  monkeypatch.setattr(scheduler, "run_requests",
                      lambda eng, p, prompts, **kw: seen.append(prompts) or real(eng, p, prompts, **kw))
  cfg = models.get_config("tiny-llama", vocab_size=tok.vocab_size)
  params = models.init_params(cfg, jax.random.key(0))
  texts = ["The capital of France is", "<|endoftext|>Hi"]
  generate(params, cfg, texts, 1, tokenizer=bos_tok, max_len=32)
  assert seen[-1] == [[0] + tok.encode(texts[0]), [0] + tok.encode("Hi")]
  generate(params, cfg, texts, 1, tokenizer=tok, max_len=32)
  assert seen[-1] == [tok.encode(t) for t in texts]


def test_completion_text_leaves_out_special_tokens_and_keeps_the_ids(params, monkeypatch):
  """`Completion.text` held the EOS that ended the request ("... <|im_end|>"), where HF's and
  vLLM's decoding leave special tokens out; the ids keep it, and the option keeps the old text."""
  import tokenizers

  from jaxagent.generate import scheduler
  from jaxagent.models.tokenizer import Tokenizer
  vocab = {f"w{i}": i for i in range(CFG.vocab_size - 1)} | {"<|im_end|>": CFG.vocab_size - 1}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "w0"))
  backend.add_special_tokens(["<|im_end|>"])
  tok = Tokenizer(backend, eos_token="<|im_end|>")
  ids = [7, 3, CFG.vocab_size - 1]  # what the engine returned (decoding is not under test)
  seen = []

  def engine_output(engine, p, prompts, **kw):
    seen.append(engine.ecfg.eos_ids)
    return [Completion(0, list(ids), [-1.0] * 3, "eos")]
  monkeypatch.setattr(scheduler, "run_requests", engine_output)
  out = generate(params, CFG, [[3, 1, 4]], 6, tokenizer=tok)[0]
  assert seen == [(CFG.vocab_size - 1,)]  # the tokenizer's EOS ended requests
  assert (out.tokens, out.text) == (ids, "w7 w3")
  kept = generate(params, CFG, [[3, 1, 4]], 6, tokenizer=tok, skip_special_tokens=False)[0]
  assert (kept.tokens, kept.text) == (ids, "w7 w3 <|im_end|>")
  with pytest.raises(ValueError, match="skip_special_tokens must be a bool"):
    generate(params, CFG, [[3, 1, 4]], 6, tokenizer=tok, skip_special_tokens="no")
  # A tokenizer whose decode takes no such argument failed with a TypeError after every
  # request had run (their tokens lost); now before any runs. One with **kwargs is fine.
  seen.clear()

  class Plain:
    eos_ids = {CFG.vocab_size - 1}

    def decode(self, ids):
      return tok.decode(ids)

  with pytest.raises(ValueError, match="Plain.decode takes no skip_special_tokens argument"):
    generate(params, CFG, [[3, 1, 4]], 6, tokenizer=Plain())
  assert seen == []

  class Kwargs(Plain):
    def decode(self, ids, **kw):
      return tok.decode(ids, **kw)

  assert generate(params, CFG, [[3, 1, 4]], 6, tokenizer=Kwargs())[0].text == "w7 w3"


def test_host_stops_and_slot_reuse_leave_each_request_as_if_alone(params, engine):
  """Requests through one slot with host-side stops (stop token ids picked from their unstopped
  outputs: a first token, tokens inside a decode call): the device decodes past a stop within
  its call, the host frees the slot and the next request reuses it over the stale cache rows.
  Each request is its unstopped output cut at its first stop token (the same tokens and
  log-probs, nothing after the stop), and equals its run alone."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(6, CFG.vocab_size, rng.integers(1, 13)).tolist() for _ in range(6)]
  ids = list(range(len(prompts)))
  ref = run_requests(engine, params, prompts, max_new_tokens=16, request_ids=ids,
                     decode_steps=4)
  stop_ids = {ref[0].tokens[0], ref[1].tokens[2], ref[2].tokens[5], ref[3].tokens[10]}
  stops = [[t] for t in sorted(stop_ids)]
  outs = run_requests(engine, params, prompts, max_new_tokens=16, request_ids=ids, stop=stops,
                      decode_steps=4)
  for i, (o, r) in enumerate(zip(outs, ref)):
    cut = next((k for k, t in enumerate(r.tokens) if t in stop_ids), None)
    want = r.tokens if cut is None else r.tokens[:cut + 1]
    assert (o.tokens, o.stop_reason) == (want, "max_new_tokens" if cut is None else "stop"), i
    np.testing.assert_allclose(o.logprobs, r.logprobs[:len(want)], atol=1e-5)
    (alone,) = run_requests(engine, params, [prompts[i]], max_new_tokens=16, request_ids=[i],
                            stop=stops, decode_steps=4)
    assert (alone.tokens, alone.stop_reason) == (o.tokens, o.stop_reason), i
  assert {o.stop_reason for o in outs} == {"stop", "max_new_tokens"} and len(outs[0].tokens) == 1
