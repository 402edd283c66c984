"""The JetStream adapter: JetStream's orchestrator drives our engine and must reproduce `generate`.

A tiny random Llama with SmolLM2's real tokenizer (vocab 49152) keeps this on CPU in seconds.
"""
import asyncio
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import pytest

from jaxagent import models
from jaxagent.generate import generate

# Cache per slot: prompt + generated tokens. Two live-KV buckets (64, 128), so attention's read
# bound must grow with the slots; JetStream's max_prefill_length is then 64.
MAX_LEN = 128
EXTRA = 'pip install "jaxagent[jetstream]"'


@pytest.fixture(scope="module")
def js():
  pytest.importorskip("jetstream", reason=f"needs the jetstream extra: {EXTRA}")
  root = logging.getLogger()
  before = (root.level, list(root.handlers))
  from jaxagent.generate import jetstream
  # JetStream's orchestrator sets the root logger to DEBUG and adds a handler at import.
  assert (root.level, root.handlers) == before, "importing the adapter changed the root logger"
  assert callable(getattr(jax, "tree_map", None)), "JetStream 0.2.2 needs jax.tree_map"
  return jetstream


@pytest.fixture(scope="module")
def tok():
  return models.load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def cfg(tok):
  return models.get_config("tiny-llama", vocab_size=tok.vocab_size)


@pytest.fixture(scope="module")
def params(cfg):
  return models.init_params(cfg, jax.random.key(0), std=0.2)


TEXT = "The capital of France is"
MAX_TOKENS = [12, 7, 200, 30, MAX_LEN]  # request 2 runs into the cache length; 4 is used alone


def _token_prompts(cfg):
  rng = np.random.default_rng(0)
  # All prompts fit JetStream's and our engine's 16-token prefill bucket: one prefill compile.
  return [rng.integers(3, cfg.vocab_size, n).tolist() for n in (12, 5, 9, 5)]


@pytest.fixture(scope="module")
def reference(tok, cfg, params):
  """Our greedy `generate` output, and an extra EOS id that request 3 samples after 4+ tokens.

  Returns (extra EOS, expected token lists): each output cut before its first EOS, extra one
  included (JetStream never returns the stop token). Greedy tokens before a stop do not depend
  on which ids stop, so cutting the output is what decoding with the extra EOS gives.
  """
  prompts = [tok.encode(TEXT)] + _token_prompts(cfg)
  out = generate(params, cfg, prompts, MAX_TOKENS, max_len=MAX_LEN, eos_ids=sorted(tok.eos_ids),
                 slots=8)
  assert [o.stop_reason for o in out[1:4]] == ["max_new_tokens", "max_length", "max_new_tokens"]
  assert len(out[2].tokens) == MAX_LEN - len(prompts[2])
  toks = out[3].tokens
  stop = next(t for i, t in enumerate(toks) if i >= 4 and t not in toks[:i])
  eos = set(tok.eos_ids) | {stop}
  want = [next((o.tokens[:i] for i, t in enumerate(o.tokens) if t in eos), o.tokens) for o in out]
  assert len(want[3]) >= 4 and len(want[3]) < len(toks) and len(want[4]) > 6
  return stop, want


@pytest.fixture(scope="module")
def engine(js, tok, cfg, params, reference):
  """One engine (2 slots, the extra EOS on device) shared by the tests: compiled once."""
  stop, _ = reference
  return js.JetStreamEngine.create(params, cfg, tok, slots=2, max_len=MAX_LEN,
                                   eos_ids=sorted(set(tok.eos_ids) | {stop}))


def test_import_is_lazy_and_missing_extra_is_explained():
  code = textwrap.dedent("""
      import sys
      import jaxagent, jaxagent.generate, jaxagent.models
      heavy = [m for m in sys.modules if m.split(".")[0] in ("jetstream", "tensorflow", "seqio")]
      assert not heavy, heavy
      sys.modules["jetstream"] = None  # as if the extra were not installed
      try:
        import jaxagent.generate.jetstream
      except ImportError as e:
        assert 'pip install "jaxagent[jetstream]"' in str(e), str(e)
      else:
        raise AssertionError("no ImportError without jetstream")
      print("OK")
  """)
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-2000:]


@pytest.mark.jetstream
def test_create_refuses_eos_ids_that_are_not_vocabulary_ints(js, tok, cfg, params):
  """`create` cut a float id to an int (2.5 became 2, a token that then ended requests); an id
  outside the vocabulary is refused by the Engine, where the adapter also meets one built by
  the caller."""
  with pytest.raises(ValueError, match="eos_ids must be an int or a sequence of int token ids"):
    js.JetStreamEngine.create(params, cfg, tok, slots=1, max_len=MAX_LEN, eos_ids=[2.5])
  with pytest.raises(ValueError, match=rf"eos_ids \[{cfg.vocab_size}\] are outside"):
    js.JetStreamEngine.create(params, cfg, tok, slots=1, max_len=MAX_LEN,
                              eos_ids=[cfg.vocab_size])
  engine = js.JetStreamEngine.create(params, cfg, tok, slots=1, max_len=MAX_LEN)
  assert engine.engine.ecfg.eos_ids == tuple(sorted(tok.eos_ids))
  assert engine.jetstream_tokenizer.stop_tokens == set(tok.eos_ids)
  # A bool was served as token id 1, and max_tokens=True as 1.
  with pytest.raises(ValueError, match=r"the prompt has a bool \(True\) at position 0"):
    engine.check_request([True, 3], 4)
  with pytest.raises(ValueError, match=rf"the prompt has token id {cfg.vocab_size} outside"):
    engine.check_request([1, cfg.vocab_size], 4)
  with pytest.raises(ValueError, match="the prompt must be a flat sequence of integer token ids"):
    engine.check_request(np.array([1.0, 2.0]), 4)
  with pytest.raises(ValueError, match="max_tokens must be a positive int, got True"):
    engine.check_request([1, 3], True)
  engine.check_request([1, 3], np.int64(4))


@pytest.mark.jetstream
def test_a_text_prompt_with_ids_past_the_models_vocabulary_is_refused(js, tok, cfg):
  """A tokenizer with more ids than the model's vocabulary (added tokens the embedding was not
  resized for): a text prompt encoded to such an id passed `check_request`, prefill rejected
  it, and the client got an empty reply and no error. It is refused before it is queued, as a
  token-id prompt with that id is."""
  from jaxagent.generate import Engine, EngineConfig
  small = cfg.replace(vocab_size=1000)
  e = js.JetStreamEngine(Engine(small, EngineConfig(slots=1, max_len=MAX_LEN)),
                         models.init_params(small, jax.random.key(0)), tok)
  assert max(tok.encode(TEXT)) >= 1000
  with pytest.raises(ValueError, match=r"the text prompt's encoding by tokenizer "
                     r"'smollm2-135m-instruct' has token id \d+ outside the model's vocabulary "
                     r"\[0, 1000\)"):
    e.check_request(TEXT, 4)
  assert max(tok.encode("in the")) < 1000
  e.check_request("in the", 4)


@pytest.mark.jetstream
def test_driver_serves_concurrent_requests_like_generate(js, cfg, tok, engine, reference):
  _, want = reference
  ids = _token_prompts(cfg)[:3]
  # Token ids as a list, a NumPy array and a JAX array (a JAX array was refused: "prompt token
  # ids must be ints in [0, 49152); got [Array(...), ...]").
  prompts = [TEXT, ids[0], np.asarray(ids[1]), jax.numpy.asarray(ids[2])]
  assert engine.max_prefill_length == 64 and not engine.jetstream_tokenizer.add_bos
  # JetStream's Driver, with the same engine for prefill and generate; two slots for four
  # requests, so slots are refilled while others decode.
  driver = js.make_driver(engine)

  async def run():
    try:
      bad = [([cfg.vocab_size + 5, 1], 5, "outside the model.s vocabulary"), ([], 5, "empty"),
             (list(range(1, 70)), 5, "max_prefill_length"), (TEXT, 0, "max_tokens"),
             (TEXT.encode(), 5, "prompt is bytes")]  # was served as the bytes' values
      for prompt, max_tokens, why in bad:  # rejected in this thread; the Driver keeps running
        with pytest.raises(ValueError, match=why):
          js.submit(driver, prompt, max_tokens)
      reqs = [js.submit(driver, p, b) for p, b in zip(prompts, MAX_TOKENS)]
      return await asyncio.wait_for(asyncio.gather(*(js.collect(r) for r in reqs)), 120)
    finally:
      driver.stop()

  got = asyncio.run(run())
  assert not any(t.is_alive() for t in driver._all_threads)
  for i, ((tokens, _), expected) in enumerate(zip(got, want)):
    assert tokens == expected, f"request {i}: {tokens} != {expected}"
  assert got[0][1] == tok.decode(want[0])  # streamed text: whole characters, no bytes lost


@pytest.mark.jetstream
def test_multi_step_results_and_rejected_prefill(js, tok, cfg, params, engine, reference):
  """Engine calls without threads; JetStream's own `process_result_tokens` reads the results."""
  from jetstream.engine import token_utils
  prompt, want = _token_prompts(cfg)[3], reference[1][4]
  engine = js.JetStreamEngine(engine.engine, params, tok, decode_steps=3)  # same compiled engine
  jtok = engine.jetstream_tokenizer
  padded, n = jtok.encode("hi", is_bos=True, max_prefill_length=32, jax_padding=False)
  assert padded.shape == (16,) and padded[0] == -1 and n == 1 + len(tok.encode("hi"))
  with_bos = js.JetStreamTokenizer(tok, tok.eos_ids, add_bos=True)
  assert with_bos.encode("hi", jax_padding=False)[0][0] == tok.bos_id == with_bos.bos_id

  state = engine.init_decode_state()
  # As JetStream sends it: the no-BOS marker, the prompt, padding; `true_length` counts the marker.
  ok = engine.prefill(params=params, padded_tokens=np.array([-1] + prompt + [0] * 10),
                      true_length=1 + len(prompt))
  # Out-of-vocabulary ids must not raise (that would kill JetStream's thread and the process).
  bad = engine.prefill(params=params, padded_tokens=np.array([-1, cfg.vocab_size, 0]),
                       true_length=2)
  state = engine.insert(ok, state, slot=1)
  state = engine.insert(bad, state, slot=0)
  assert state.bounds == (-1, len(prompt))  # host bound on cached lengths; -1: cannot be active
  for max_tokens, expected in ((1000, want), (4, want[:6])):  # k=3: up to k-1 past max_tokens
    done = np.zeros((1,), bool)
    st = state if max_tokens == 1000 else engine.insert(ok, state, slot=1)
    tokens, rejected = [], None
    while not done.all():
      st, res = engine.generate(params, st)
      res = res.convert_to_numpy()
      if rejected is None:
        rejected, _ = token_utils.process_result_tokens(jtok, 0, 50, res, np.zeros((1,), bool),
                                                        is_client_side_tokenization=True)
      samples, done = token_utils.process_result_tokens(jtok, 1, max_tokens, res, done,
                                                        is_client_side_tokenization=True)
      tokens += samples[0].token_ids
    assert tokens == expected and rejected[0].token_ids == []
    if max_tokens == 1000:  # ran to the cache length: the slot can no longer be active
      assert st.bounds == (-1, -1)
    state = st


def test_a_slot_stopped_for_a_short_kv_len_is_an_error_not_a_short_completion(
    js, tok, cfg, params, engine, monkeypatch):
  """The adapter's live-KV bound comes from host upper bounds on the slots' lengths. Were it
  below a slot's cached length, the engine would stop the slot (STOP_KV_LEN) and its tokens
  turn invalid, which JetStream reads as the end of the request: a short completion and no
  error. Reading such a result (JetStream's detokenize thread does) now raises, naming the
  slot; the results before it read as without the fault. Forced: kv_len 1 (a bucket of 64)
  for a 62-token prompt, so the fourth step finds 65 cached tokens."""
  prompt = np.random.default_rng(5).integers(3, cfg.vocab_size, 62).tolist()

  def results():
    e = js.JetStreamEngine(engine.engine, params, tok)  # request ids from 0: the same samples
    pre = e.prefill(params=params, padded_tokens=np.array([-1] + prompt),
                    true_length=1 + len(prompt))
    state, out = e.insert(pre, e.init_decode_state(), 0), []
    for _ in range(4):
      state, res = e.generate(e.load_params(), state)
      out.append(res)
    return out

  want = [np.asarray(r.convert_to_numpy().data) for r in results()]
  assert all(w[0, 1] for w in want)  # slot 0 decodes in every call without the fault
  real = engine.engine.generate
  monkeypatch.setattr(engine.engine, "generate",
                      lambda p, st, steps, kv_len: real(p, st, steps=steps, kv_len=1))
  got = results()
  for w, r in zip(want[:3], got[:3]):
    np.testing.assert_array_equal(r.convert_to_numpy().data, w)
  with pytest.raises(RuntimeError, match=r"stopped slots \[0\] with STOP_KV_LEN: they held more "
                     r"cached tokens than the kv_len bound .* would end as short completions"):
    got[3].convert_to_numpy()


@pytest.mark.jetstream
def test_grpc_server_streams_tokens_and_rejects_bad_requests(js, cfg, engine, reference):
  import grpc
  from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
  with socket.socket() as sock:  # a free local port
    sock.bind(("localhost", 0))
    port = sock.getsockname()[1]
  server = js.serve(engine, port, threads=4)
  try:
    with grpc.insecure_channel(f"localhost:{port}") as channel:
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)

      def decode(token_ids, max_tokens):
        request = jetstream_pb2.DecodeRequest(
            token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=token_ids),
            max_tokens=max_tokens)
        return [t for r in stub.Decode(request, timeout=60)
                for t in r.stream_content.samples[0].token_ids]

      want = reference[1]
      assert decode(_token_prompts(cfg)[0], MAX_TOKENS[1]) == want[1]
      # It fails this call, not the server.
      with pytest.raises(grpc.RpcError, match="outside the model.s vocabulary") as e:
        decode([cfg.vocab_size + 1], 5)
      assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
      with pytest.raises(grpc.RpcError, match="needs text_content or token_content") as e:
        list(stub.Decode(jetstream_pb2.DecodeRequest(max_tokens=5), timeout=60))
      assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
      assert decode(_token_prompts(cfg)[1], 3) == want[2][:3]
  finally:
    server.stop()


@pytest.mark.jetstream
def test_serving_on_a_port_in_use_is_an_error_that_leaves_nothing_running(js, engine):
  """JetStream's server starts its (non-daemon) event-loop thread before it binds the port:
  on a port in use `serve` raised, but that thread and the driver's threads ran on, and the
  process hung at exit."""
  before = set(threading.enumerate())
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    sock.listen()
    port = sock.getsockname()[1]
    with pytest.raises(RuntimeError) as e:
      js.serve(engine, port, threads=2)
  # grpc.aio's completion-queue poller (a daemon) starts with the first server and stays.
  left = [t.name for t in set(threading.enumerate()) - before
          if t.is_alive() and "_poll_wrapper" not in t.name]
  assert left == []
  assert f"cannot serve on port {port} (is it in use?)" in str(e.value)


@pytest.mark.jetstream
def test_constructor_arguments_of_the_wrong_type_are_refused(js, tok, params, engine):
  """max_prefill_length=32.0 was accepted, and a 32-token prompt then killed the process
  (JetStream slices the padded prompt with it in its prefill thread); add_bos="no" meant True;
  a NumPy int of decode steps was refused as not an int."""
  with pytest.raises(ValueError, match=r"max_prefill_length must be one of .* got 32.0"):
    js.JetStreamEngine(engine.engine, params, tok, max_prefill_length=32.0)
  with pytest.raises(ValueError, match="add_bos must be True, False or None .* got 'no'"):
    js.JetStreamEngine(engine.engine, params, tok, add_bos="no")
  for steps in (True, 2.0, 0):
    with pytest.raises(ValueError, match="decode_steps must be a positive int"):
      js.JetStreamEngine(engine.engine, params, tok, decode_steps=steps)
  # Not a SamplingConfig: the first prefill, in a Driver thread, killed the process.
  for sampling in (0.7, {"temperature": 0.7}):
    with pytest.raises(TypeError, match="sampling must be a jaxagent.generate.SamplingConfig"):
      js.JetStreamEngine.create(params, engine.cfg, tok, slots=1, max_len=MAX_LEN,
                                sampling=sampling)
  e = js.JetStreamEngine(engine.engine, params, tok, decode_steps=np.int64(2),
                         max_prefill_length=np.int64(32), add_bos=np.bool_(False))
  assert (e._steps, e.max_prefill_length, e.jetstream_tokenizer.add_bos) == (2, 32, False)
  assert type(e.max_prefill_length) is int


@pytest.mark.jetstream
def test_params_of_another_model_are_refused_at_construction(js, tok, cfg, engine):
  """Params of another model, or None, were accepted; the first prefill, in a Driver thread,
  then killed the serving process."""
  deeper = models.init_params(cfg.replace(n_layers=3), jax.random.key(0))
  with pytest.raises(ValueError, match=r"JetStreamEngine: the params have \[3\] layers, the "
                                       r"model config 'tiny-llama' says n_layers = 2"):
    js.JetStreamEngine(engine.engine, deeper, tok)
  with pytest.raises(ValueError, match=r"JetStreamEngine: the params have \[3\] layers"):
    js.JetStreamEngine.create(deeper, cfg, tok, slots=2, max_len=MAX_LEN)
  with pytest.raises(ValueError, match="JetStreamEngine: params must be a model's params tree"):
    js.JetStreamEngine(engine.engine, None, tok)
  # Prepared params (as `load_params` returns them) are this engine's own.
  js.JetStreamEngine(engine.engine, engine.load_params(), tok)


@pytest.mark.jetstream
def test_a_prompt_that_starts_with_bos_gets_no_second_one(js, tok, cfg, params, engine):
  """With `add_bos` (a tokenizer that adds BOS, as Llama 3's does), JetStream prepends BOS
  to every prompt: a chat-templated prompt, whose text starts with the BOS token, reached the
  model as BOS BOS ..."""
  e = js.JetStreamEngine(engine.engine, params, tok, add_bos=True)
  text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
  ids = tok.encode(text)
  assert ids[0] == tok.bos_id == e.jetstream_tokenizer.bos_id
  first = generate(params, cfg, [ids], 1, max_len=MAX_LEN)[0].tokens[0]
  # As JetStream's prefill thread pads them: a text prompt that starts with BOS, and a token
  # prompt without it (JetStream's BOS is then the only one).
  for padded, n in (e.jetstream_tokenizer.encode(text, jax_padding=False),
                    js.token_utils.pad_tokens(np.asarray(ids[1:]), tok.bos_id, 0,
                                              jax_padding=False)):
    pre = e.prefill(params=params, padded_tokens=padded, true_length=n)
    assert int(pre.prompt_len) == len(ids) and bool(pre.ok)
    assert int(pre.prefix.tokens[0]) == first


@pytest.mark.jetstream
def test_bad_seed_is_refused_at_construction(js, tok, params, engine):
  """A seed prefill would refuse is an error here, in the caller's thread: in a Driver's prefill
  thread the same error would kill the process."""
  for seed in (-1, 2 ** 32, 1.5, True):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
      js.JetStreamEngine(engine.engine, params, tok, seed=seed)
  js.JetStreamEngine(engine.engine, params, tok, seed=2 ** 32 - 1)


@pytest.mark.jetstream
def test_sampled_streams_are_a_function_of_the_seed_and_the_request_count(js, tok, cfg, params):
  """Sampling draws from (seed, request number of this adapter, position): two adapters (two
  servers, or a server and its restart) with one seed sample the same tokens for their n-th
  requests, and a seed per server gives each its own streams (as the docstring and README say)."""
  from jaxagent.generate import SamplingConfig
  first = js.JetStreamEngine.create(params, cfg, tok, slots=1, max_len=MAX_LEN,
                                    sampling=SamplingConfig(temperature=1.0), seed=7)
  ids = tok.encode(TEXT)
  padded = np.asarray(ids, np.int32)

  def firsts(e, n=4):
    return [int(e.prefill(params=e.load_params(), padded_tokens=padded,
                          true_length=len(ids)).prefix.tokens[0]) for _ in range(n)]

  a = firsts(first)
  again = firsts(js.JetStreamEngine(first.engine, params, tok, seed=7))
  other = firsts(js.JetStreamEngine(first.engine, params, tok, seed=8))
  assert again == a
  assert len(set(a)) > 1  # each request of one adapter has its own stream
  assert other != a


def _byte_ids(tok, text):
  """One byte-level token per UTF-8 byte of `text` (GPT-2's byte-to-unicode map)."""
  bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  char = dict(zip(bs, map(chr, cs)))
  return [tok.token_to_id(char[b]) for b in text.encode()]


@pytest.mark.jetstream
def test_streamed_text_keeps_characters_split_across_tokens_whole(js, tok, params, engine):
  """Each streamed piece is whole characters: JetStream decodes token by token, which gave U+FFFD
  for every byte of a multi-byte character sent as one token per byte."""
  text = "héllo 世界😀!"
  script = _byte_ids(tok, text)
  assert None not in script and tok.decode(script) == text

  class Scripted(js.JetStreamEngine):  # the engine's results, with the script's tokens
    def generate(self, params, decode_state):
      st, res = super().generate(params, decode_state)
      data = np.array(res.data)
      data[:, 0] = script[min(self.step, len(script) - 1)]
      self.step += 1
      return st, dataclasses.replace(res, data=jax.numpy.asarray(data))

  scripted = Scripted(engine.engine, params, tok)
  scripted.step = 0
  driver = js.make_driver(scripted)

  async def run():
    try:
      request = js.submit(driver, "hi", len(script))
      return [(s[0].text, s[0].token_ids) async for s in request.return_channel]
    finally:
      driver.stop()

  got = asyncio.run(run())
  assert [t for _, ids in got for t in ids] == script
  pieces = [p for texts, _ in got for p in texts]
  assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces), pieces


@pytest.mark.jetstream
def test_grpc_text_that_spells_a_byte_token_reaches_the_client_as_written(js, tok, params, engine):
  """JetStream's servicer read a streamed piece spelled like a SentencePiece byte token as that
  byte: with 6 tokens per result, the reply "<0x41>" reached the client as "A", and "<0xZZ>"
  ended the stream with INVALID_ARGUMENT "invalid literal for int() with base 16"."""
  import grpc
  from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
  text = "<0x41><0xZZ>héllo"  # 6 + 6 + 6 bytes: one piece per result
  script = _byte_ids(tok, text)
  steps = 6

  class Scripted(js.JetStreamEngine):  # the engine's results, with the script's tokens
    def generate(self, params, decode_state):
      st, res = super().generate(params, decode_state)
      data = np.array(res.data)
      for j in range(steps):
        data[:, j] = script[min(self.step * steps + j, len(script) - 1)]
      self.step += 1
      return st, dataclasses.replace(res, data=jax.numpy.asarray(data))

  scripted = Scripted(engine.engine, params, tok, decode_steps=steps)
  scripted.step = 0
  with socket.socket() as sock:  # a free local port
    sock.bind(("localhost", 0))
    port = sock.getsockname()[1]
  server = js.serve(scripted, port, threads=4)
  try:
    with grpc.insecure_channel(f"localhost:{port}") as channel:
      request = jetstream_pb2.DecodeRequest(
          text_content=jetstream_pb2.DecodeRequest.TextContent(text="hi"), max_tokens=len(script))
      replies = [r.stream_content.samples[0]
                 for r in jetstream_pb2_grpc.OrchestratorStub(channel).Decode(request, timeout=60)]
  finally:
    server.stop()
  assert [t for r in replies for t in r.token_ids] == script
  assert "".join(r.text for r in replies) == text, [r.text for r in replies]


ABANDON = textwrap.dedent("""
    import asyncio, time
    import jax
    from jaxagent import models
    from jaxagent.generate import jetstream as js
    tok = models.load_tokenizer("smollm2-135m-instruct")
    cfg = models.get_config("tiny-llama", vocab_size=tok.vocab_size)
    params = models.init_params(cfg, jax.random.key(0), std=0.2)
    engine = js.JetStreamEngine.create(params, cfg, tok, slots=1, max_len=128)
    calls = [0]
    generate = engine.generate
    def counted(*a):
      calls[0] += 1
      return generate(*a)
    engine.generate = counted
    driver = js.make_driver(engine)

    async def first_result_only(request):
      async for _ in request.return_channel:
        return
    async def abandon():  # reads one result, then its event loop closes
      await first_result_only(js.submit(driver, "Hello", 100))
    asyncio.run(abandon())
    async def cancel():
      request = js.submit(driver, "Hello", 100)
      await first_result_only(request)
      request.return_channel.cancel()
      n = calls[0]
      ids, text = await asyncio.wait_for(js.collect(js.submit(driver, "Hi", 3)), 60)
      return len(ids), calls[0] - n
    n_ids, steps = asyncio.run(cancel())
    assert n_ids == 3 and steps < 60, (n_ids, steps)  # not ~100 steps for the cancelled request
    async def stop():
      requests = [js.submit(driver, "Hello", 100) for _ in range(3)]
      await asyncio.sleep(0.2)
      driver.stop()
      return await asyncio.wait_for(asyncio.gather(*(js.collect(r) for r in requests),
                                                   return_exceptions=True), 30)
    assert all(isinstance(r, RuntimeError) and "stopped" in str(r) for r in asyncio.run(stop()))
    print("OK")
""")


@pytest.mark.slow  # default-run time budget: a process of its own, 7-13 s
@pytest.mark.jetstream
def test_abandoned_cancelled_and_unfinished_requests(js):
  """A client whose event loop closed used to kill the process (JetStream's detokenize thread
  raised delivering to it); a cancelled request held its slot up to max_tokens; `stop` left
  requests in flight waiting forever. Run in a subprocess, since the first one is a SIGKILL."""
  r = subprocess.run([sys.executable, "-c", ABANDON], capture_output=True, text=True,
                     timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (r.returncode, r.stderr[-3000:])


@pytest.mark.jetstream
def test_a_freed_slot_stops_decoding(js, tok, cfg, params, engine):
  """JetStream frees a slot on the host only (a request's `max_tokens`, a stop token, a client
  gone): the slot used to go on decoding for nobody to the cache length, and every later
  `generate` read the live KV up to it. The freed slot is now inactive, the others unchanged."""
  rng = np.random.default_rng(3)
  short, long = rng.integers(3, cfg.vocab_size, 60).tolist(), _token_prompts(cfg)[1]
  eos = set(engine.engine.ecfg.eos_ids)
  ref = generate(params, cfg, [long], 40, max_len=MAX_LEN, eos_ids=sorted(eos), slots=8)[0]
  want = next((ref.tokens[:i] for i, t in enumerate(ref.tokens) if t in eos), ref.tokens)
  assert len(want) > 20

  class Recorded(js.JetStreamEngine):
    def generate(self, params, decode_state):
      st, res = super().generate(params, decode_state)
      self.calls.append((decode_state.bounds, np.asarray(st.decode.active).tolist()))
      return st, res

  recorded = Recorded(engine.engine, params, tok)
  recorded.calls = []
  driver = js.make_driver(recorded)

  async def run():
    try:
      first = js.submit(driver, short, 2)
      await asyncio.sleep(0)
      second = js.submit(driver, long, 40)
      return await asyncio.wait_for(asyncio.gather(js.collect(first), js.collect(second)), 120)
    finally:
      driver.stop()

  (a, _), (b, _) = asyncio.run(run())
  assert len(a) == 2 and b == want
  slot = next(s for bounds, _ in recorded.calls for s, n in enumerate(bounds) if n == 60)
  bounds, active = recorded.calls[-1]  # the long request's last call: it still runs
  assert bounds[slot] == -1 and not active[slot], recorded.calls
  # Freed after the few results JetStream's detokenize thread lags behind the decoding.
  assert max(bounds[slot] for bounds, _ in recorded.calls) < 60 + 12, recorded.calls

  # Two drivers on one engine: slots that one frees are not the other's (same indices).
  shared = js.JetStreamEngine(engine.engine, params, tok)
  one, two = js.make_driver(shared), js.make_driver(shared)

  async def run_both():
    try:
      second = js.submit(two, long, 40)
      firsts = [js.submit(one, p, 1) for p in _token_prompts(cfg)]
      return await asyncio.wait_for(
          asyncio.gather(js.collect(second), *(js.collect(r) for r in firsts)), 120)
    finally:
      one.stop()
      two.stop()

  assert asyncio.run(run_both())[0][0] == want

  # Without threads: a note of a freed slot deactivates it at the next call, unless a request
  # was inserted into the slot first (the driver frees a slot before it can be reused).
  prompt = _token_prompts(cfg)[3]
  pre = recorded.prefill(params=params, padded_tokens=np.array([-1] + prompt),
                         true_length=1 + len(prompt))
  state = recorded.insert(pre, recorded.insert(pre, recorded.init_decode_state(), 0), 1)
  recorded.slot_freed(1)
  recorded.slot_freed(0)
  recorded.slot_freed(0, thread=threading.Thread())  # another decode state's slot 0
  state = recorded.insert(pre, state, 0)
  state, res = recorded.generate(params, state)
  assert state.bounds == (len(prompt) + 1, -1)
  assert np.asarray(res.data)[:, 1].tolist() == [1, 0]  # valid column: slot 1's output dropped


EXIT = textwrap.dedent("""
    import asyncio, socket, time
    import jax
    from jaxagent import models
    from jaxagent.generate import jetstream as js
    tok = models.load_tokenizer("smollm2-135m-instruct")
    cfg = models.get_config("tiny-llama", vocab_size=tok.vocab_size)
    params = models.init_params(cfg, jax.random.key(0), std=0.2)
    engine = js.JetStreamEngine.create(params, cfg, tok, slots=2, max_len=128)
    with socket.socket() as sock:
      sock.bind(("localhost", 0))
      port = sock.getsockname()[1]
    server = js.serve(engine, port, threads=2)  # never stopped
    driver = js.make_driver(engine)  # never stopped, a request still in flight
    async def first_result():
      async for _ in js.submit(driver, "Hello", 100).return_channel:
        return
    asyncio.run(first_result())
    print("EXIT", time.time(), flush=True)
""")


@pytest.mark.slow  # default-run time budget: a process of its own, 7-14 s
@pytest.mark.jetstream
def test_process_exits_without_stop(js):
  """JetStream's detokenize thread and its gRPC server's event-loop thread were not daemons: a
  process that had not stopped its driver or server hung at exit. Now it exits promptly."""
  import time
  try:
    r = subprocess.run([sys.executable, "-c", EXIT], capture_output=True, text=True,
                       timeout=240, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  except subprocess.TimeoutExpired as e:
    raise AssertionError(f"the process did not exit: {(e.stdout or b'')[-500:]!r}") from None
  end = time.time()
  assert r.returncode == 0 and "EXIT" in r.stdout, (r.returncode, r.stderr[-3000:])
  took = end - float(r.stdout.split("EXIT")[-1].split()[0])
  assert took < 30, f"exit took {took:.1f} s"


KV_LEN_FAULT = textwrap.dedent("""
    import asyncio
    import jax
    import numpy as np
    from jaxagent import models
    from jaxagent.generate import jetstream as js
    tok = models.load_tokenizer("smollm2-135m-instruct")
    cfg = models.get_config("tiny-llama", vocab_size=tok.vocab_size)
    params = models.init_params(cfg, jax.random.key(0), std=0.2)
    engine = js.JetStreamEngine.create(params, cfg, tok, slots=2, max_len=128)
    real = engine.engine.generate
    engine.engine.generate = lambda p, st, steps, kv_len: real(p, st, steps=steps, kv_len=1)
    driver = js.make_driver(engine)
    prompt = np.random.default_rng(5).integers(3, cfg.vocab_size, 62).tolist()
    async def run():
      return await js.collect(js.submit(driver, prompt, 20))
    print("COMPLETION", asyncio.run(run()), flush=True)
""")


@pytest.mark.slow  # a process of its own, 10-20 s
@pytest.mark.jetstream
def test_a_short_kv_len_in_a_serving_driver_ends_the_process_with_the_reason(js):
  """Under JetStream's Driver, the error for a slot stopped by too low a live-KV bound
  (`ServingResult`) is raised in its detokenize thread, which ends the serving process with
  the reason printed; the request was a short completion of 4 tokens of 20, and no error."""
  r = subprocess.run([sys.executable, "-c", KV_LEN_FAULT], capture_output=True, text=True,
                     timeout=240, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert "COMPLETION" not in r.stdout, r.stdout[-2000:]
  assert r.returncode != 0 and "stopped slots [0] with STOP_KV_LEN" in r.stdout + r.stderr, (
      r.returncode, r.stdout[-2000:], r.stderr[-2000:])


@pytest.mark.jetstream
def test_full_length_prompt_is_not_reported_truncated(js, cfg, params, engine, caplog):
  """A prompt of exactly `max_prefill_length` tokens reaches prefill without JetStream's no-BOS
  marker only (it keeps the last tokens); that was logged as a truncated prompt."""
  prompt = np.random.default_rng(4).integers(3, cfg.vocab_size, 64).tolist()
  engine.check_request(prompt, 5)
  with caplog.at_level(logging.WARNING, logger="jaxagent.generate.jetstream"):
    pre = engine.prefill(params=params, padded_tokens=np.array(prompt), true_length=65)
    assert not caplog.records and int(pre.prompt_len) == 64 and bool(pre.ok)
    engine.prefill(params=params, padded_tokens=np.array(prompt), true_length=70)
  assert "truncated" in caplog.text  # a prompt that did lose tokens (a driver without checks)


@pytest.mark.jetstream
def test_a_full_length_prompt_that_starts_with_bos_is_served(js, tok, cfg, params, engine,
                                                             caplog):
  """With `add_bos`, a prompt that starts with BOS and has `max_prefill_length` tokens was
  refused by check_request (counted with JetStream's BOS: 65 > 64), although JetStream keeps
  its last 64 tokens, the prompt itself, and prefill serves it; reaching prefill, it was
  logged as truncated. A prompt of 64 without BOS does lose its BOS: refused, and logged."""
  e = js.JetStreamEngine(engine.engine, params, tok, add_bos=True)
  size, bos = e.max_prefill_length, tok.bos_id
  assert size == 64 and bos == e.jetstream_tokenizer.bos_id
  rest = np.random.default_rng(5).integers(3, cfg.vocab_size, size - 1).tolist()
  prompt = [bos] + rest
  e.check_request(prompt, 5)
  padded, n = js.token_utils.pad_tokens(np.asarray(prompt), bos, 0, max_prefill_length=size,
                                        jax_padding=False)
  assert n == size + 1 and padded.tolist() == prompt  # JetStream's BOS is what it cut
  with caplog.at_level(logging.WARNING, logger="jaxagent.generate.jetstream"):
    pre = e.prefill(params=params, padded_tokens=padded, true_length=n)
    ours = [r for r in caplog.records if r.name == "jaxagent.generate.jetstream"]
    assert not ours and int(pre.prompt_len) == size and bool(pre.ok)
    with pytest.raises(ValueError, match=rf"prompt of {size + 1} tokens exceeds max_prefill_length"):
      e.check_request(rest + [7], 5)
    padded, n = js.token_utils.pad_tokens(np.asarray(rest + [7]), bos, 0, max_prefill_length=size,
                                          jax_padding=False)
    e.prefill(params=params, padded_tokens=padded, true_length=n)
  assert f"prompt of {size + 1} tokens was truncated to its last {size}" in caplog.text


@pytest.mark.jetstream
def test_prefix_destination_splits_the_heads_over_tensor(js, tok, cfg, params):
  """JetStream's transfer thread puts each prefix where this says. A prefix's K/V are
  `[layers, 1, T, KV, hd]`, but the cache's spec `[layers, slots, KV, T, hd]` was used: the
  prompt's length T was split over "tensor" instead of the heads, and a prefill bucket that the
  tensor axis does not divide (13 tokens here) failed the transfer, which kills the process."""
  from jaxagent import sharding as shd
  from jaxagent.generate import Engine, EngineConfig
  mesh = shd.make_mesh(data=1, fsdp=1, tensor=2, devices=jax.devices()[:2])
  assert cfg.n_kv_heads % 2 == 0
  e = js.JetStreamEngine(Engine(cfg, EngineConfig(slots=2, max_len=MAX_LEN), mesh=mesh),
                         params, tok)
  dest = e.get_prefix_destination_sharding()
  for t in (16, 13):
    shape = (cfg.n_layers, 1, t, cfg.n_kv_heads, cfg.head_dim)
    assert dest.prefix.k.shard_shape(shape) == (cfg.n_layers, 1, t, cfg.n_kv_heads // 2,
                                                cfg.head_dim)
    assert dest.prefix.v.shard_shape(shape) == dest.prefix.k.shard_shape(shape)


@pytest.mark.jetstream
def test_a_token_drawn_from_nonfinite_logits_is_not_returned(js, tok, cfg, params, engine):
  """A request whose logits turn NaN stops on device (`STOP_NONFINITE`), but the token drawn
  from them was returned to the client as the completion's last token: with tied embeddings a
  NaN embedding row makes every logit row NaN, and that token was the NaN row's own id. Now the
  request ends before it, at prefill or in a decode call of one step or three."""
  import jax.numpy as jnp
  nan_row = params["embed"].value.at[5].set(jnp.nan)
  poisoned = dict(params, embed=params["embed"].replace_boxed(nan_row))
  prompt = _token_prompts(cfg)[1]
  padded = np.array([-1] + prompt)

  def returned(prefill_params, k):
    e = js.JetStreamEngine(engine.engine, poisoned, tok, decode_steps=k)
    pre = e.prefill(params=e.engine.prepare(prefill_params), padded_tokens=padded,
                    true_length=1 + len(prompt))
    state, got = e.insert(pre, e.init_decode_state(), 0), []
    for _ in range(3):
      state, res = e.generate(e.load_params(), state)
      data = np.asarray(res.data)[0]
      got += [int(t) for t, v in zip(data[:k], data[k:2 * k]) if v]
    return int(pre.prefix.tokens[0]), got

  assert returned(poisoned, 1)[1] == []  # NaN at prefill: nothing is returned
  for k in (1, 3):  # NaN at the first decode step: only the prefill's token is returned
    first, got = returned(params, k)
    assert got == [first]
