"""LoRA runs end to end on the tiny config: only the adapter trains, checkpoints hold it,
a resume needs the same adapter shape and base weights, exports hold the merged model."""
import json

import jax
import numpy as np
import pytest
import safetensors.numpy

from jaxagent import checkpoint, models
from jaxagent.models import lora, param_tree
from jaxagent.trainer import Trainer, load_model
from tests.trainer_test import _tiny


def _lora_tiny(tmp_path, **overrides):
  kw = {"lora.rank": 4, "lora.alpha": 8.0, "loss.kl_coef": 0.01, "checkpoint_every": 1}
  kw.update(overrides)
  return _tiny(tmp_path, **kw)


def _plain(tree):
  return jax.device_get(param_tree.unbox(tree))


def test_a_lora_run_trains_the_adapter_only_checkpoints_it_and_exports_the_merged_model(
    tmp_path):
  c = _lora_tiny(tmp_path)
  base_cfg, base, _ = load_model(c.model)
  t = Trainer(c)
  try:
    fresh = _plain(t.state.params)
    t.run()
    adapter = _plain(t.state.params)
    assert set(adapter["layers"]) == set(lora.INPUT_AXES)
    # The update moved the adapter (B starts at 0) and left the base as loaded.
    assert any(np.abs(adapter["layers"][k]["b"]).max() > 0 for k in adapter["layers"])
    assert not any(np.any(fresh["layers"][k]["b"]) for k in fresh["layers"])
    for a, b in zip(jax.tree.leaves(_plain(base)), jax.tree.leaves(_plain(t.learner.base))):
      np.testing.assert_array_equal(a, b)
    # The reference is the adapter as RL began (fresh: no warm start in this config).
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(_plain(t.ref_params))):
      np.testing.assert_array_equal(a, b)
    out = t.export(tmp_path / "export")
  finally:
    t.close()
  merged = _plain(lora.merge(base, adapter, lora.LoraConfig(rank=4, alpha=8.0)))
  sd = safetensors.numpy.load_file(str(out / "model.safetensors"))
  want = models.hf.state_dict_from_params(base_cfg, merged)
  assert set(want) <= set(sd)
  for k, v in want.items():
    np.testing.assert_allclose(sd[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
  # `python -m jaxagent.export` of the checkpoint writes the same merged weights.
  again = checkpoint.export_hf(tmp_path / "run", tmp_path / "export2")
  sd2 = safetensors.numpy.load_file(str(again / "model.safetensors"))
  for k in want:  # (merged on the run's mesh vs on one device: equal to float32 rounding)
    np.testing.assert_allclose(sd2[k], sd[k], rtol=1e-6, atol=1e-7, err_msg=k)
  # Both also write the adapter alone, as a PEFT adapter directory.
  for d in (out, again):
    lcfg, loaded = lora.load_peft(d / "adapter", base_cfg)
    assert lcfg == lora.LoraConfig(rank=4, alpha=8.0)
    for a, b in zip(jax.tree.leaves(adapter), jax.tree.leaves(_plain(loaded))):
      np.testing.assert_array_equal(a, b)
  assert json.loads((out / "adapter" / "adapter_config.json").read_text())[
      "base_model_name_or_path"] == "tiny-llama"

  # A new run can start from the exported adapter (lora.init_from), of the same shape only.
  fresh_dir = tmp_path / "from_adapter"
  t3 = Trainer(_lora_tiny(fresh_dir, **{"lora.init_from": str(out / "adapter")}))
  try:
    for a, b in zip(jax.tree.leaves(adapter), jax.tree.leaves(_plain(t3.state.params))):
      np.testing.assert_array_equal(a, b)
  finally:
    t3.close()
  with pytest.raises(ValueError, match=r"holds an adapter of rank 4, alpha 8.0 on wq,.*w_down; "
                     r"the config says lora.rank=4, lora.alpha=16.0"):
    Trainer(_lora_tiny(fresh_dir, **{"lora.init_from": str(out / "adapter"),
                                     "lora.alpha": 16.0}))

  # A resume needs the adapter's shape: another rank is refused and names the setting.
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match=r"config lora.rank: 4 in "
                     r"the checkpoint, 8 now"):
    Trainer(_lora_tiny(tmp_path, **{"lora.rank": 8, "total_steps": 2})).run()
  t2 = Trainer(_lora_tiny(tmp_path, total_steps=2))
  try:
    assert t2.restore() == 1
    for a, b in zip(jax.tree.leaves(adapter), jax.tree.leaves(_plain(t2.state.params))):
      np.testing.assert_array_equal(a, b)
  finally:
    t2.close()


def test_a_resume_or_export_over_other_base_weights_is_refused(tmp_path):
  tiny = _tiny(tmp_path)
  cfg, params, tok = load_model(tiny.model)
  hf = tmp_path / "base"
  models.save_hf(hf, cfg, _plain(params), tok)
  c = _lora_tiny(tmp_path, **{"model.path": str(hf), "model.tokenizer": ""})
  t = Trainer(c)
  try:
    t.run()
  finally:
    t.close()
  # The same path, other weights (the directory replaced).
  other = _plain(models.init_params(cfg, jax.random.key(7), std=0.02))
  models.save_hf(hf, cfg, other, tok)
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match="other base weights"):
    Trainer(_lora_tiny(tmp_path, **{"model.path": str(hf), "model.tokenizer": "",
                                    "total_steps": 2})).run()
  # (every checkpoint of the run is refused, each named)
  with pytest.raises(checkpoint.CheckpointError, match=r"(?s)checkpoints/1 holds a LoRA adapter "
                     r"trained over other base weights.*checkpoints/0 holds"):
    checkpoint.export_hf(tmp_path / "run", tmp_path / "export")


def test_an_init_from_that_is_no_adapter_directory_fails_before_the_model_loads(tmp_path):
  with pytest.raises(ValueError, match=r"lora.init_from='.*' is not a PEFT adapter directory "
                     r"\(no adapter_config.json there\)"):
    Trainer(_lora_tiny(tmp_path, **{"lora.init_from": str(tmp_path)}))
  assert not (tmp_path / "run").exists()


def test_a_full_weights_export_over_an_earlier_lora_export_drops_its_adapter(tmp_path):
  """`<out>/adapter` of an earlier LoRA export would describe other weights than a full-weights
  export written over it: removed, unless it holds anything but the two PEFT files."""
  out = tmp_path / "export"
  adapter_dir = out / "adapter"
  adapter_dir.mkdir(parents=True)
  for name in (lora.PEFT_CONFIG, lora.PEFT_WEIGHTS):
    (adapter_dir / name).write_text("{}")
  t = Trainer(_tiny(tmp_path))
  try:
    t.export(out)
  finally:
    t.close()
  assert (out / "model.safetensors").is_file() and not adapter_dir.exists()
  # A directory with more in it is not ours to remove.
  adapter_dir.mkdir()
  for name in (lora.PEFT_CONFIG, lora.PEFT_WEIGHTS, "notes.txt"):
    (adapter_dir / name).write_text("{}")
  assert not checkpoint.drop_stale_adapter(out) and (adapter_dir / "notes.txt").is_file()
