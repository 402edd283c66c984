"""`benchmarks/decode_profile.py`: a CPU run of the engine's decode program at fixed lengths."""
import json
import sys

import numpy as np
import pytest

from benchmarks import decode_profile
from jaxagent import models


@pytest.mark.slow  # tens of seconds on a 2-core CPU (the default run's time budget)
def test_trace_only_run_reports_the_engine_step(monkeypatch, capsys, tmp_path):
  monkeypatch.setattr(sys, "argv", [
      "decode_profile.py", "--model", "tiny-qwen2", "--batch", "4", "--cached", "16",
      "--max-len", "64", "--trace", str(tmp_path / "trace"), "--trace-only"])
  decode_profile.main()
  out = capsys.readouterr().out
  rows = [json.loads(line[len("RESULT "):]) for line in out.splitlines()
          if line.startswith("RESULT ")]
  assert [r["bench"] for r in rows] == ["decode_profile"]
  assert rows[0]["cached"] == 16 and rows[0]["full_step_ms"] > 0
  assert "trace written to" in out and any((tmp_path / "trace").rglob("*.pb*"))


def _rows(out):
  return [json.loads(line[len("RESULT "):]) for line in out.splitlines()
          if line.startswith("RESULT ")]


@pytest.mark.slow  # a script run of tens of seconds on a 2-core CPU (the default run's time budget)
def test_ablations_and_split_report_their_step_times(monkeypatch, capsys, tmp_path):
  monkeypatch.setattr(sys, "argv", [
      "decode_profile.py", "--model", "tiny-qwen2", "--batch", "4", "--cached", "16",
      "--max-len", "64", "--attention", "pallas", "--layout", "per_layer",
      "--ablate", "attention,norms", "--split", "2", "--trace", str(tmp_path / "t"),
      "--trace-only"])
  decode_profile.main()
  (row,) = _rows(capsys.readouterr().out)
  for key in ("no_attention_step_ms", "no_norms_step_ms", "split1_step_ms", "split2_step_ms",
              "split2_concurrent_step_ms"):
    assert row[key] > 0, key
  assert row["attention_ms"] == row["full_step_ms"] - row["no_attention_step_ms"]


@pytest.mark.slow  # default-run time budget: builds and compiles the engine before the second refusal, 5-9 s
def test_ablation_needs_the_pallas_step_and_a_known_piece(monkeypatch):
  base = ["decode_profile.py", "--model", "tiny-qwen2", "--batch", "2", "--cached", "8",
          "--max-len", "32"]
  monkeypatch.setattr(sys, "argv", base + ["--ablate", "mlp"])
  with pytest.raises(SystemExit, match="unknown piece 'mlp'"):
    decode_profile.main()
  monkeypatch.setattr(sys, "argv", base + ["--attention", "xla", "--ablate", "attention"])
  with pytest.raises(SystemExit, match="does not call what this ablation replaces"):
    decode_profile.main()


def test_attention_stand_ins_keep_the_caches_and_the_output_shape():
  import jax
  import jax.numpy as jnp
  from unittest import mock

  from jaxagent import models
  from jaxagent.models import decoder
  cfg = models.get_config("tiny-qwen2", param_dtype="float32", dtype="float32")
  params = decoder.merge_decode_weights(models.init_params(cfg, jax.random.key(0)), cfg)
  shape = (2, cfg.n_kv_heads, 16, cfg.head_dim)
  ck = tuple(jax.random.normal(jax.random.key(i), shape) for i in range(cfg.n_layers))
  cv = tuple(jax.random.normal(jax.random.key(9 + i), shape) for i in range(cfg.n_layers))
  tok, lens = jnp.array([3, 4], jnp.int32), jnp.array([5, 7], jnp.int32)
  for fused in (True, False):
    patches, calls = decode_profile.ablation("attention")
    with mock.patch.multiple(decoder, **patches):
      logits, k2, v2 = decoder.decode_in_place(params, ck, cv, tok, lens, cfg=cfg,
                                               fused_qkv=fused)
    assert len(calls) == cfg.n_layers and logits.shape == (2, cfg.vocab_size)
    assert all((a == b).all() for a, b in zip(k2 + v2, ck + cv))


def test_decode_switches_one_run_per_combination_and_clear_errors():
  import argparse

  from benchmarks import common
  ap = argparse.ArgumentParser()
  common.add_decode_switches(ap)
  runs = common.decode_switch_runs(ap.parse_args(["--fold-norms", "on,off",
                                                  "--chain-weights", "auto,off"]))
  assert [(r["decode_fold_norms"], r["decode_chain_weights"]) for r in runs] == [
      (True, None), (True, False), (False, None), (False, False)]
  assert all(r["decode_merge_weights"] is None and r["decode_fused_qkv"] for r in runs)
  with pytest.raises(SystemExit, match="--fused-qkv: unknown value"):
    common.decode_switch_runs(ap.parse_args(["--fused-qkv", "yes"]))
  assert common.decode_switch_run(ap.parse_args(["--merge-weights", "off"]))[
      "decode_merge_weights"] is False
  with pytest.raises(SystemExit, match="one value of each"):
    common.decode_switch_run(ap.parse_args(["--fold-norms", "on,off"]))


def test_profile_takes_one_value_of_each_switch(monkeypatch):
  monkeypatch.setattr(sys, "argv", ["decode_profile.py", "--model", "tiny-qwen2", "--batch",
                                    "2", "--cached", "8", "--chain-weights", "on,off"])
  with pytest.raises(SystemExit, match="one value of each"):
    decode_profile.main()


def test_the_roofline_counts_the_keys_the_held_steps_hold(monkeypatch, capsys, tmp_path,
                                                          generate_calls):
  # Every call starts each slot at --cached keys, and its steps advance them one at a time;
  # the roofline used to count --cached keys for every step.
  monkeypatch.setattr(decode_profile, "peaks", lambda: {"bf16_flops": 1e12, "hbm_bytes_s": 1e12})
  calls = generate_calls(decode_profile)
  monkeypatch.setattr(sys, "argv", [
      "decode_profile.py", "--model", "tiny-qwen2", "--batch", "4", "--cached", "16",
      "--max-len", "64", "--steps", "8", "--trace", str(tmp_path / "trace"), "--trace-only"])
  decode_profile.main()
  [row] = _rows(capsys.readouterr().out)
  keys = [lens + i + 1 for lens, steps in calls for i in range(steps)]
  mean_keys = float(np.mean(keys))
  assert mean_keys == 16 + 4.5  # the same in every call: the lengths are reset to 16
  cfg = models.get_config("tiny-qwen2")
  kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2
  assert row["roofline_step_ms"] == pytest.approx(
      (cfg.num_params() * 2 + 4 * mean_keys * kv) / 1e12 * 1e3)
