"""`python -m jaxagent.generate`: flags reach the sampler; bad input is a one-line error and a
nonzero exit, never a traceback. A tiny random Llama (SmolLM2's vocabulary and chat template, 64
positions) stands in for the shipped model."""
import re

import jax
import pytest

from jaxagent import models
from jaxagent.generate.__main__ import main

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  try:
    tok = models.load_tokenizer("smollm2-135m-instruct")
  except FileNotFoundError as e:
    pytest.skip(f"no embedded SmolLM2 tokenizer: {e}")
  cfg = models.get_config("tiny-llama", vocab_size=tok.vocab_size, max_seq_len=64,
                          bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
  params = models.init_params(cfg, jax.random.key(0))
  return str(models.save_hf(tmp_path_factory.mktemp("tiny") / "m", cfg, params, tokenizer=tok))


def test_reply_is_printed_with_its_token_count(model_dir, capsys):
  main(["Hi", "--model", model_dir, "--max-new-tokens", "3"])
  out = capsys.readouterr().out
  assert out.startswith("user: Hi\nassistant: ") and "[3 tokens, stop: max_new_tokens]" in out


def _reply(out: str) -> str:
  return out.split("assistant: ", 1)[1].rsplit("\n[", 1)[0]


@pytest.mark.slow  # tens of seconds on a 2-core CPU (the default run's time budget)
def test_sampling_flags_and_stop_strings_reach_the_sampler(model_dir, capsys):
  sample = ["Hi", "--model", model_dir, "--max-new-tokens", "8", "--temperature", "1", "--seed", "0"]
  main(sample)
  reply = _reply(capsys.readouterr().out)
  main(sample + ["--top-k", "1"])  # top-k 1 is greedy whatever the temperature
  main(["Hi", "--model", model_dir, "--max-new-tokens", "8"])
  top1, greedy = (_reply(o) for o in capsys.readouterr().out.split("user: ")[1:])
  assert top1 == greedy != reply
  main(sample + ["--top-p", "1e-6"])  # so is a tiny nucleus
  assert _reply(capsys.readouterr().out) == greedy
  # A word from the middle of the sampled reply, as a stop string: the reply ends with it.
  word = max(reply.split()[1:-1], key=len)
  main(sample + ["--stop", "@@never@@", "--stop", word])
  out = capsys.readouterr().out
  assert "stop: stop]" in out and _reply(out).endswith(word) and len(_reply(out)) < len(reply)


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--max-new-tokens", "-2"], "--max-new-tokens must be >= 1"),
    (["--max-new-tokens", str(2 ** 31)], r"--max-new-tokens must be >= 1 and below 2\*\*31"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0"),
    (["--temperature", "1e-39"], "--temperature 1e-39 is below 1e-06"),
    (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    (["--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
    (["--top-p", "nan"], r"--top-p must be in \(0, 1\]"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--stop", ""], "--stop strings must be non-empty"),
    (["--seed", "-1"], r"--seed must be in \[0, 2\*\*32\)"),
    (["--seed", str(2 ** 32)], r"--seed must be in \[0, 2\*\*32\)"),
    (["\udcff"], "not valid UTF-8"),
])
def test_bad_flags_are_usage_errors(flags, message, capsys):
  with pytest.raises(SystemExit) as e:
    main(flags + ["--model", "never-loaded"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "usage:" in err and "Traceback" not in err
  assert re.search(message, err), err


def test_unknown_model_is_a_one_line_error():
  with pytest.raises(SystemExit) as e:
    main(["Hi", "--model", "no-such-model"])
  assert str(e.value.code).startswith("generate failed: no checkpoint at 'no-such-model'")
  assert "smollm2-135m-instruct" in str(e.value.code)  # names what it accepts


def test_prompt_longer_than_the_model_is_a_one_line_error(model_dir):
  with pytest.raises(SystemExit) as e:
    main(["word " * 100, "--model", model_dir])
  assert "generate failed: the prompt is" in str(e.value.code)
  assert "takes at most 64" in str(e.value.code) and "shorten it" in str(e.value.code)


def test_a_tokenizer_that_does_not_match_the_model_is_a_one_line_error(tmp_path):
  """A directory whose tokenizer has more ids than the weights' vocabulary (files of two
  models mixed): the error was the engine's "run_requests: prompt 0 has token id 34519 outside
  the model's vocabulary [0, 512)", which named neither the tokenizer nor the cause."""
  tok = models.load_tokenizer("smollm2-135m-instruct")
  cfg = models.get_config("tiny-llama", max_seq_len=64)  # 512 ids
  path = models.save_hf(tmp_path / "m", cfg, models.init_params(cfg, jax.random.key(0)), tok)
  with pytest.raises(SystemExit) as e:
    main(["Hi", "--model", str(path)])
  msg = str(e.value.code)
  assert msg.startswith(f"generate failed: the tokenizer of {path} ({tok.vocab_size} ids)")
  assert "outside the model's vocabulary of 512" in msg and "do not belong" in msg


def test_help_documents_every_flag(capsys):
  with pytest.raises(SystemExit) as e:
    main(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  for flag in ("--model", "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--stop",
               "--seed"):
    assert flag in out
