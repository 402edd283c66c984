"""Checkpoints: round trip and resharding, retention, skipped/corrupt/incompatible checkpoints,
exact resume of the tiny quickstart run, SIGTERM and kill -9 in subprocesses, HF export."""
import dataclasses
import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxagent import checkpoint, models, sharding
from jaxagent.rl import step as step_lib
from tests.conftest import CPU_TEST_XLA_FLAGS

REPO = pathlib.Path(__file__).resolve().parent.parent
CFG = models.get_config("tiny-llama", vocab_size=256)


@functools.lru_cache(maxsize=None)
def _learner(n_devices: int, cfg=CFG):
  """One learner per mesh size for the whole module (each compiles its step once)."""
  mesh = sharding.make_mesh(1, -1, 1, devices=jax.devices()[:n_devices])
  return step_lib.Learner(cfg, step_lib.StepConfig(), step_lib.make_optimizer(1e-2), mesh)


def _batch(seed=0, rows=8, length=16):
  rng = np.random.default_rng(seed)
  return dict(tokens=rng.integers(0, CFG.vocab_size, (rows, length)).astype(np.int32),
              segment_ids=np.ones((rows, length), np.int32),
              positions=np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
              loss_mask=(np.arange(length) > 0)[None].repeat(rows, 0).astype(np.float32),
              old_logps=np.full((rows, length), -5.0, np.float32),
              advantages=rng.normal(size=(rows, length)).astype(np.float32))


@functools.lru_cache(maxsize=None)
def _initial_params(cfg=CFG):
  return jax.device_get(models.init_params(cfg, jax.random.key(0), std=0.1))


def _trained_state(learner, steps=2):
  state = learner.init(_initial_params(learner.cfg))
  for i in range(steps):
    state, _ = learner.train_step(state, _batch(i))
  return state


def _target(learner):
  """A restore target on the learner's mesh (values are irrelevant, only shapes/shardings)."""
  return checkpoint.state_target(learner.init(_initial_params(learner.cfg)), learner.mesh)


def _config(**model):
  c = ml_collections.ConfigDict(dict(seed=0, total_steps=4, model=dict(path="tiny-llama", **model),
                                     env=dict(name="quickstart"), optimizer=dict(lr=1e-2)))
  return c


def _meta(config):
  return {"config": checkpoint.config_to_json(config), "warm_started": True,
          "model_config": {"name": "unused"}}


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_host(a), _host(b)):
    np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------- manager
def test_restore_onto_a_smaller_mesh_reshards_boxed_state(tmp_path):
  big = _learner(8)
  state = _trained_state(big)
  before = jax.device_get(state)
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1))
  mgr.save(2, state, meta=_meta(_config()))
  # Async save: the state may be donated right after `save` returns.
  state, _ = big.train_step(state, _batch(7))
  mgr.wait()

  small = _learner(4)
  target = _target(small)
  r = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1)).restore_latest(
      target, config=_config())
  assert r.step == 2 and r.changed == []
  _assert_trees_equal(r.state, before)
  emb = r.state.params["embed"]
  assert emb.names == ("vocab", "embed")  # logical axes survive the round trip
  assert emb.value.sharding.mesh.devices.size == 4
  assert emb.value.sharding.spec == sharding.logical_to_spec(emb.names, emb.value.shape,
                                                             small.mesh)
  assert len(emb.value.addressable_shards) == 4


def test_keep_last_n_plus_every_k(tmp_path):
  learner = _learner(1)
  state = learner.init(_initial_params())
  mgr = checkpoint.CheckpointManager(
      tmp_path, checkpoint.CheckpointConfig(every=1, keep=2, keep_every=3, async_save=False))
  for s in range(1, 8):
    assert mgr.should_save(s)
    assert mgr.save(s, state, meta=_meta(_config()))
  assert not mgr.save(7, state, meta=_meta(_config()))  # a step is written once
  mgr.close()
  assert mgr.steps() == [3, 6, 7]
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "6", "7"]
  every4 = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=4))
  assert every4.should_save(8) and not every4.should_save(6)


def test_numbered_folders_that_are_not_checkpoints_are_refused_and_kept(tmp_path):
  # A user's folders named like steps: orbax lists them as steps, and retention deleted them.
  for n in ("1", "7"):
    (tmp_path / n).mkdir()
    (tmp_path / n / "notes.txt").write_text("not a checkpoint")
  learner = _learner(1)
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1, keep=1))
  refused = (rf"not jaxagent checkpoints: {tmp_path / '1'}, {tmp_path / '7'}\. "
             r"Checkpoint retention would .* move them out")
  with pytest.raises(checkpoint.CheckpointError, match=refused):  # was: "no usable checkpoint"
    mgr.restore_latest(_target(learner), config=_config())
  with pytest.raises(checkpoint.CheckpointError, match=refused):
    mgr.save(8, learner.init(_initial_params()), meta=_meta(_config()))
  mgr.close()
  assert all((tmp_path / n / "notes.txt").read_text() == "not a checkpoint" for n in ("1", "7"))
  # Read-only (export) does not refuse; a folder without our metadata is a CheckpointError.
  ro = checkpoint.CheckpointManager(tmp_path, read_only=True)
  with pytest.raises(checkpoint.CheckpointError, match=rf"checkpoint {tmp_path / '7'} is unreadable"):
    ro.read_meta(7)


def test_a_checkpoint_directory_that_is_a_file_is_refused_at_once(tmp_path):
  """A file at the checkpoint path listed no checkpoints, so the run started from scratch, and
  then its first save failed in orbax's background threads (NotADirectoryError on
  `<path>/0.orbax-checkpoint-tmp`, then a 300 s wait for a signal that never came)."""
  path = tmp_path / "checkpoints"
  path.write_text("not a directory")
  for read_only in (False, True):
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"checkpoint directory {path} is a file, not a directory"):
      checkpoint.CheckpointManager(path, checkpoint.CheckpointConfig(every=1),
                                   read_only=read_only)
  assert path.read_text() == "not a directory"


def test_retention_deletes_only_this_runs_checkpoints(tmp_path):
  # Two runs (other seeds) writing into one directory, and a user's folder that appears while
  # they run: each run's retention keeps its own newest 2 and touches nothing else.
  state = _learner(1).init(_initial_params())
  cfg = checkpoint.CheckpointConfig(every=1, keep=2, async_save=False)
  a, b = _config(), _config()
  b.seed = 1
  run_a = checkpoint.CheckpointManager(tmp_path, cfg)
  run_b = checkpoint.CheckpointManager(tmp_path, cfg)
  for s in (1, 2, 3):
    assert run_a.save(s, state, meta=_meta(a))
  for s in (10, 11, 12):
    run_b._mgr.reload()  # (as a second process sees the directory)
    assert run_b.save(s, state, meta=_meta(b))
    if s == 10:
      (tmp_path / "5").mkdir()
      (tmp_path / "5" / "notes.txt").write_text("user data")
  run_a._mgr.reload()
  assert run_a.save(4, state, meta=_meta(a))
  run_a.close()
  run_b.close()
  assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [3, 4, 5, 11, 12]
  assert (tmp_path / "5" / "notes.txt").read_text() == "user data"


@pytest.mark.slow  # default-run time budget: 7-14 s on 2 cores
def test_a_checkpoint_whose_deletion_was_cut_short_does_not_stop_the_resume(tmp_path):
  """Retention deletes an old checkpoint's files (the top-level ones among the first), then
  its folders; a kill in between left a numbered folder without metadata that the resume took
  for a user's folder: every later start of the run was refused ("not jaxagent checkpoints")."""
  learner, _ = _two_checkpoints(tmp_path)
  files = sorted((p for p in (tmp_path / "1").rglob("*") if p.is_file()), key=str)
  for p in files[::2] + [tmp_path / "1" / "_CHECKPOINT_METADATA",
                         tmp_path / "1" / "commit_success.txt", tmp_path / "1" / "meta" / "metadata"]:
    p.unlink(missing_ok=True)
  assert any(p.is_file() for p in (tmp_path / "1").rglob("*"))  # array files left
  said = []
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1),
                                     say=said.append)
  r = mgr.restore_latest(_target(learner), config=_config())
  assert r.step == 2 and said == []
  assert mgr.save(3, r.state, meta=_meta(_config()))
  mgr.close()
  assert (tmp_path / "3").is_dir() and (tmp_path / "1").is_dir()  # kept: nothing names its run
  # With every file gone (the folders left), the same.
  for p in [p for p in (tmp_path / "1").rglob("*") if p.is_file()]:
    p.unlink()
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1))
  assert mgr.restore_latest(_target(learner), config=_config()).step == 3
  mgr.close()


def test_an_empty_step_folder_left_by_a_deletion_does_not_stop_the_resume(tmp_path):
  """A kill at the very end of a checkpoint's deletion leaves its folder empty: it was taken
  for a user's folder, and every later start of the run was refused."""
  learner = _learner(1)
  state = learner.init(_initial_params())
  cfg = checkpoint.CheckpointConfig(every=1, async_save=False)
  mgr = checkpoint.CheckpointManager(tmp_path, cfg)
  assert mgr.save(1, state, meta=_meta(_config()))
  mgr.close()
  for n in ("0", "2"):  # older and newer than the checkpoint
    (tmp_path / n).mkdir()
  said = []
  mgr = checkpoint.CheckpointManager(tmp_path, cfg, say=said.append)
  r = mgr.restore_latest(_target(learner), config=_config())
  assert r.step == 1 and mgr.steps() == [1]
  assert said == [f"removed the empty step folder {tmp_path / n} (left by an interrupted deletion)"
                  for n in ("0", "2")]
  assert mgr.save(2, r.state, meta=_meta(_config()))
  mgr.close()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_on_a_bucket_only_interrupted_saves_are_cleaned_up(tmp_path, monkeypatch):
  # On gs:// orbax completes a save by writing commit_success.txt into the step folder, and its
  # clean-up of unfinished saves deleted every folder without that file (a user's notes/ or
  # 7/). The bucket's behaviour, on a local directory:
  from orbax.checkpoint._src.path import gcs_utils
  monkeypatch.setattr(gcs_utils, "is_gcs_path", lambda path: True)
  learner = _learner(1)
  state = learner.init(_initial_params())
  cfg = checkpoint.CheckpointConfig(every=1, async_save=False)
  mgr = checkpoint.CheckpointManager(tmp_path, cfg)
  for s in (1, 2):
    mgr.save(s, state, meta=_meta(_config()))
  mgr.close()
  assert (tmp_path / "2" / "commit_success.txt").exists()
  # A save of step 3 killed before its commit file, and a user's folder.
  (tmp_path / "3" / "params").mkdir(parents=True)
  (tmp_path / "3" / "_CHECKPOINT_METADATA").write_text("{}")
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "todo.txt").write_text("user data")
  said = []
  mgr = checkpoint.CheckpointManager(tmp_path, cfg, say=said.append)
  assert mgr.restore_latest(_target(learner), config=_config()).step == 2
  assert mgr.save(3, state, meta=_meta(_config()))
  mgr.close()
  assert (tmp_path / "notes" / "todo.txt").read_text() == "user data"
  assert any(f"skipping incomplete checkpoint {tmp_path / '3'}" in m for m in said), said
  assert (tmp_path / "3" / "commit_success.txt").exists()
  # A numbered folder that is not a save of ours is refused and kept.
  (tmp_path / "7").mkdir()
  (tmp_path / "7" / "todo.txt").write_text("user data")
  mgr = checkpoint.CheckpointManager(tmp_path, cfg)
  with pytest.raises(checkpoint.CheckpointError, match=rf"not jaxagent checkpoints: {tmp_path / '7'}\."):
    mgr.restore_latest(_target(learner), config=_config())
  mgr.close()
  assert (tmp_path / "7" / "todo.txt").exists() and (tmp_path / "notes" / "todo.txt").exists()


def _two_checkpoints(tmp_path):
  learner = _learner(2)
  s1 = _trained_state(learner, steps=1)
  h1 = jax.device_get(s1)
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1))
  mgr.save(1, s1, meta=_meta(_config()))
  s2, _ = learner.train_step(s1, _batch(5))
  mgr.save(2, s2, meta=_meta(_config()))
  mgr.close()
  return learner, h1


def _corrupt(step_dir: pathlib.Path):
  """Cut every array file of the checkpoint's params in half (a torn write)."""
  files = [p for p in (step_dir / "params").rglob("*") if p.is_file()]
  assert files
  for p in files:
    data = p.read_bytes()
    p.write_bytes(data[:len(data) // 2])


def test_interrupted_save_is_named_and_skipped(tmp_path):
  learner, _ = _two_checkpoints(tmp_path)
  # What a process killed mid-save leaves: orbax's temporary directory for step 3.
  tmp = tmp_path / "3.orbax-checkpoint-tmp"
  (tmp / "params").mkdir(parents=True)
  (tmp / "params" / "partial").write_bytes(b"\0" * 100)
  said = []
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1),
                                     say=said.append)
  r = mgr.restore_latest(_target(learner), config=_config())
  assert r.step == 2
  assert any(str(tmp) in m and "incomplete" in m for m in said), said
  assert not tmp.exists()  # cleaned up so it cannot be mistaken for a checkpoint later


def test_corrupt_newest_falls_back_to_previous(tmp_path):
  learner, h1 = _two_checkpoints(tmp_path)
  _corrupt(tmp_path / "2")
  said = []
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1),
                                     say=said.append)
  target = _target(learner)
  r = mgr.restore_latest(target, config=_config())
  assert r.step == 1
  _assert_trees_equal(r.state, h1)
  assert any(str(tmp_path / "2") in m and "corrupt" in m for m in said), said
  # The unreadable step is moved aside (not deleted), so the resumed run can save step 2 again.
  aside = tmp_path.parent / f"{tmp_path.name}-unreadable" / "2"
  assert aside.is_dir() and not (tmp_path / "2").exists() and mgr.steps() == [1]
  assert any(f"moved the unreadable checkpoint {tmp_path / '2'} to {aside}" in m for m in said)
  assert mgr.save(2, r.state, meta=_meta(_config()))
  mgr.wait()
  again = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1),
                                       say=said.append).restore_latest(target, config=_config())
  assert again.step == 2
  _assert_trees_equal(again.state, h1)


def test_nonfinite_params_are_never_saved_or_exported(tmp_path):
  learner, _ = _two_checkpoints(tmp_path)
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1))
  state = _trained_state(learner, steps=1)
  leaves, treedef = jax.tree.flatten(state.params)
  leaves[1] = leaves[1].at[0].set(jnp.nan)
  bad = dataclasses.replace(state, params=jax.tree.unflatten(treedef, leaves))
  with pytest.raises(checkpoint.NonFiniteParamsError, match=r"not saving checkpoint .*3: the params "
                     r"hold NaN or Inf \(\d+ values in 1 arrays"):
    mgr.save(3, bad, meta=_meta(_config()))
  mgr.wait()
  assert mgr.steps() == [1, 2]
  with pytest.raises(checkpoint.NonFiniteParamsError):
    checkpoint.check_finite(bad.params, "x")
  checkpoint.check_finite(state.params, "x")  # finite params pass


def test_flipped_bytes_that_still_read_are_caught_by_the_fingerprints(tmp_path):
  learner, h1 = _two_checkpoints(tmp_path)
  # Damage the middle of the largest array file of step 2 in place: the files still read.
  files = sorted((p for p in (tmp_path / "2" / "params").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
  data = bytearray(files[-1].read_bytes())
  mid = len(data) // 2
  data[mid:mid + 64] = bytes(b ^ 0x5A for b in data[mid:mid + 64])
  files[-1].write_bytes(bytes(data))
  said = []
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1),
                                     say=said.append)
  r = mgr.restore_latest(_target(learner), config=_config())
  assert r.step == 1
  _assert_trees_equal(r.state, h1)
  assert any("is corrupt: the contents of params" in m and "differ from what was saved" in m
             for m in said), said
  # The fingerprints of an intact checkpoint match (step 1 restored above), and export checks
  # them too.
  with pytest.raises(checkpoint.CheckpointError, match="differ from what was saved"):
    checkpoint.CheckpointManager(tmp_path.parent / f"{tmp_path.name}-unreadable",
                                 read_only=True).restore_params(2, _target(learner).params)


# ----------------------------------------------------------------------------- rollouts_ahead
def _ahead(step: int):
  """`Trainer._ready`-like rollouts of the step after `step`: values whose bits matter (NaN,
  -0.0, a subnormal, -inf, bools)."""
  batch = {"tokens": np.arange(12, dtype=np.int32).reshape(2, 6) + step,
           "old_logps": np.array([[np.nan, -0.0, -1e-45, -np.inf, 0.5, -3.25 * step]] * 2,
                                 np.float32),
           "loss_mask": np.array([[0, 1, 1, 0, 1, step % 2]] * 2, bool)}
  return {step + 1: ({"reward/mean": 0.25 * step, "x": float("nan")}, batch, step - 1)}


def _assert_ahead_equal(got, want):
  assert sorted(got) == sorted(want)
  for s, (metrics, batch, version) in want.items():
    m, b, v = got[s]
    assert v == version and sorted(m) == sorted(metrics)
    np.testing.assert_array_equal(np.array(list(m.values())), np.array(list(metrics.values())))
    assert sorted(b) == sorted(batch)
    for k, x in batch.items():  # bit for bit: dtype, shape and raw bytes
      assert b[k].dtype == x.dtype and b[k].shape == x.shape and b[k].tobytes() == x.tobytes()


def _two_checkpoints_with_rollouts_ahead(tmp_path):
  from jaxagent.trainer import _encode_ahead
  learner = _learner(2)
  s1 = _trained_state(learner, steps=1)
  h1 = jax.device_get(s1)
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1))
  mgr.save(1, s1, meta=_meta(_config()), rollouts_ahead=_encode_ahead(_ahead(1)))
  s2, _ = learner.train_step(s1, _batch(5))
  mgr.save(2, s2, meta=_meta(_config()), rollouts_ahead=_encode_ahead(_ahead(2)))
  mgr.close()
  return learner, h1


def _restore_with_rollouts_ahead(tmp_path, learner, said):
  from jaxagent.trainer import _decode_ahead
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1),
                                     say=said.append)
  return mgr, mgr.restore_latest(_target(learner), config=_config(), decode_ahead=_decode_ahead)


def _edit_json(path: pathlib.Path, edit):
  data = json.loads(path.read_text())
  edit(data)
  path.write_text(json.dumps(data))


def _flip_payload_char(item):
  """Replace one base64 character in the middle of the (one) saved step's npz by another base64
  character: the JSON still parses and the string is still base64."""
  (step,) = item["steps"].values()
  text, i = step["npz_base64"], len(step["npz_base64"]) // 2
  step["npz_base64"] = text[:i] + ("B" if text[i] == "A" else "A") + text[i + 1:]


def test_rollouts_ahead_round_trip_bit_for_bit_with_their_digest(tmp_path):
  learner, _ = _two_checkpoints_with_rollouts_ahead(tmp_path)
  saved = json.loads((tmp_path / "2" / "rollouts_ahead" / "metadata").read_text())
  meta = json.loads((tmp_path / "2" / "meta" / "metadata").read_text())
  assert meta["rollouts_ahead"] is True
  assert meta["json_digests"] == {"rollouts_ahead": checkpoint.json_digest(saved)}
  said = []
  mgr, r = _restore_with_rollouts_ahead(tmp_path, learner, said)
  assert r.step == 2 and not said
  _assert_ahead_equal(r.rollouts_ahead, _ahead(2))
  # Without a decoder the item comes back as saved.
  raw = mgr.restore(2, _target(learner), config=_config())
  assert raw.rollouts_ahead == saved


@pytest.mark.parametrize("damage", ["step", "next_index", "config", "truncated"])
def test_an_edited_metadata_file_falls_back_to_the_previous_checkpoint(tmp_path, damage):
  """The metadata (RL step, prompt-stream state, config) had no digest of its own: an edited
  file, or one cut short where it still parses, resumed from that checkpoint as if intact."""
  learner, h1 = _two_checkpoints_with_rollouts_ahead(tmp_path)
  meta_file = tmp_path / "2" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  assert meta[checkpoint.META_DIGEST] == checkpoint.meta_digest(meta)

  def edit(m):
    if damage == "step":
      m["step"] = 3
    elif damage == "next_index":
      m["data"] = {"next_index": 7}
    elif damage == "config":
      m["config"]["optimizer"]["lr"] = 0.5  # a setting a resume may change
    else:  # the summary lost, the rest still valid JSON
      m.pop("warm_started")
  _edit_json(meta_file, edit)
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1))
  with pytest.raises(checkpoint.CheckpointError,
                     match=rf"checkpoint {tmp_path / '2'} is corrupt: its metadata file "
                     rf"{meta_file} differs from what was saved"):
    mgr.read_meta(2)
  mgr.close()
  said = []
  mgr, r = _restore_with_rollouts_ahead(tmp_path, learner, said)
  assert r.step == 1
  _assert_trees_equal(r.state, h1)
  assert any(f"its metadata file {meta_file} differs" in m for m in said), said
  assert mgr.steps() == [1]


def test_metadata_saved_without_a_digest_restores(tmp_path):
  """Checkpoints written before the metadata had a digest restore as before."""
  learner, _ = _two_checkpoints_with_rollouts_ahead(tmp_path)
  _edit_json(tmp_path / "2" / "meta" / "metadata", lambda m: m.pop(checkpoint.META_DIGEST))
  said = []
  _, r = _restore_with_rollouts_ahead(tmp_path, learner, said)
  assert r.step == 2 and not said
  _assert_ahead_equal(r.rollouts_ahead, _ahead(2))


@pytest.mark.parametrize("damage", ["flipped character", "truncated", "params_version"])
def test_a_damaged_rollouts_ahead_item_falls_back_to_the_previous_checkpoint(tmp_path, damage):
  """An item that still parses as JSON but whose contents changed resumed from that checkpoint
  (and an edited params_version went unnoticed), or failed the resume after the checkpoint was
  chosen; now its digest fails it as a damaged array does: named, moved away, and the previous
  checkpoint restores with its own rollouts."""
  learner, h1 = _two_checkpoints_with_rollouts_ahead(tmp_path)

  def edit(item):
    step3 = item["steps"]["3"]
    if damage == "flipped character":
      _flip_payload_char(item)
    elif damage == "truncated":
      step3["npz_base64"] = step3["npz_base64"][:len(step3["npz_base64"]) // 2 // 4 * 4]
    else:
      step3["params_version"] += 1  # decodes: only the digest shows it
  _edit_json(tmp_path / "2" / "rollouts_ahead" / "metadata", edit)
  said = []
  mgr, r = _restore_with_rollouts_ahead(tmp_path, learner, said)
  assert r.step == 1
  _assert_trees_equal(r.state, h1)
  _assert_ahead_equal(r.rollouts_ahead, _ahead(1))
  assert any(f"checkpoint {tmp_path / '2'} is corrupt: the contents of its rollouts_ahead item "
             "differ from what was saved" in m for m in said), said
  aside = tmp_path.parent / f"{tmp_path.name}-unreadable" / "2"
  assert aside.is_dir() and not (tmp_path / "2").exists() and mgr.steps() == [1]
  assert any(f"moved the unreadable checkpoint {tmp_path / '2'} to {aside}" in m for m in said)


def test_rollouts_ahead_saved_without_a_digest_restore_and_their_damage_falls_back(tmp_path):
  """Checkpoints written before the digest was kept restore their rollouts as before; one whose
  item no longer decodes is skipped inside the restore (it raised after the checkpoint was
  chosen, and the run could not resume until the checkpoint was moved by hand)."""
  learner, h1 = _two_checkpoints_with_rollouts_ahead(tmp_path)
  for step in ("1", "2"):
    _edit_json(tmp_path / step / "meta" / "metadata",
               lambda m: (m.pop("json_digests"), m.pop(checkpoint.META_DIGEST)))
  said = []
  _, r = _restore_with_rollouts_ahead(tmp_path, learner, said)
  assert r.step == 2 and not said
  _assert_ahead_equal(r.rollouts_ahead, _ahead(2))

  _edit_json(tmp_path / "2" / "rollouts_ahead" / "metadata", _flip_payload_char)
  mgr, r = _restore_with_rollouts_ahead(tmp_path, learner, said)
  assert r.step == 1
  _assert_trees_equal(r.state, h1)
  _assert_ahead_equal(r.rollouts_ahead, _ahead(1))
  assert any(f"checkpoint {tmp_path / '2'}: its rollouts_ahead item is unreadable" in m
             for m in said), said
  assert (tmp_path.parent / f"{tmp_path.name}-unreadable" / "2").is_dir() and mgr.steps() == [1]
  # With no earlier checkpoint to fall back to, the error names the damage and what to do.
  _edit_json(tmp_path / "1" / "rollouts_ahead" / "metadata", _flip_payload_char)
  with pytest.raises(checkpoint.CheckpointError,
                     match=rf"no usable checkpoint in {tmp_path}:\n  checkpoint {tmp_path / '1'}: "
                     r"its rollouts_ahead item is unreadable \(.*\n.*start from scratch"):
    _restore_with_rollouts_ahead(tmp_path, learner, said)


def test_corrupt_only_checkpoint_is_a_clear_error(tmp_path):
  learner, _ = _two_checkpoints(tmp_path)
  _corrupt(tmp_path / "1")
  _corrupt(tmp_path / "2")
  target = _target(learner)
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1),
                                     say=lambda m: None)
  with pytest.raises(checkpoint.CheckpointError) as e:
    mgr.restore_latest(target, config=_config())
  msg = str(e.value)
  assert f"{tmp_path / '1'} is corrupt" in msg and f"{tmp_path / '2'} is corrupt" in msg
  assert "start from scratch" in msg


def test_incompatible_config_and_shapes_are_named(tmp_path):
  learner, _ = _two_checkpoints(tmp_path)
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1))
  target = _target(learner)
  # Another model preset: the identity setting is named with both values.
  other = _config()
  other.model.path = "tiny-qwen3"
  with pytest.raises(checkpoint.IncompatibleCheckpointError,
                     match=r"config model.path: 'tiny-llama' in the checkpoint, 'tiny-qwen3' now"):
    mgr.restore_latest(target, config=other)
  # Other shapes under the same name: each differing array is named with both shapes.
  wide = models.get_config("tiny-llama", vocab_size=256, ffn_dim=CFG.ffn_dim * 2)
  wide_target = _target(_learner(2, wide))
  with pytest.raises(checkpoint.IncompatibleCheckpointError) as e:
    mgr.restore_latest(wide_target, config=_config())
  assert "params['layers']['w_up']" in str(e.value) and str(CFG.ffn_dim * 2) in str(e.value)
  # A KL reference is needed now but was not saved.
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match="ref_params.*kl_coef"):
    mgr.restore_latest(target, ref_target=target.params, config=_config())
  # Allowed changes are reported, not refused.
  changed = _config()
  changed.optimizer.lr = 5e-3
  r = mgr.restore_latest(target, config=changed)
  assert r.changed == [("optimizer.lr", 1e-2, 5e-3)]
  # Clipping turned off changes the optimizer state's layout: the setting is named.
  no_clip = _config()
  no_clip.optimizer.max_grad_norm = 0.0
  unclipped = step_lib.Learner(CFG, step_lib.StepConfig(), step_lib.make_optimizer(1e-2, max_grad_norm=0),
                               learner.mesh)
  with pytest.raises(checkpoint.IncompatibleCheckpointError,
                     match=r"the optimizer state is laid out differently; these settings changed and "
                           r"shape it: optimizer.max_grad_norm: '<unset>' in the checkpoint, 0.0 now"):
    mgr.restore_latest(checkpoint.state_target(unclipped.init(_initial_params()), learner.mesh),
                       config=no_clip)


def test_another_model_architecture_under_the_same_config_is_named(tmp_path):
  """Same run config, same array shapes, another function (rope_theta, norm_eps, rope scaling):
  `check_model_config` refuses it (the trainer's resume calls it); what only changes how the
  model is computed, or its longest sequence, passes."""
  learner = _learner(1)
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1))
  mgr.save(3, learner.init(_initial_params()),
           meta={**_meta(_config()), "model_config": dataclasses.asdict(CFG)})
  mgr.wait()
  meta = mgr.read_meta(3)
  mgr.close()
  path = tmp_path / "3"
  checkpoint.check_model_config(meta, CFG, path)
  checkpoint.check_model_config(meta, dataclasses.replace(
      CFG, remat="full", attention_impl="xla", scan_layers=False, max_seq_len=64), path)
  checkpoint.check_model_config({"model_config": None}, CFG, path)  # written without one
  other = dataclasses.replace(CFG, rope_theta=5e5, norm_eps=1e-6,
                              rope_scaling=(8.0, 1.0, 4.0, 256))
  with pytest.raises(checkpoint.IncompatibleCheckpointError) as e:
    checkpoint.check_model_config(meta, other, path)
  msg = str(e.value)
  assert f"checkpoint {path} was written by another model" in msg
  assert f"model rope_theta: {CFG.rope_theta!r} in the checkpoint, 500000.0 now" in msg
  assert f"model norm_eps: {CFG.norm_eps!r} in the checkpoint, 1e-06 now" in msg
  assert "model rope_scaling: None in the checkpoint, [8.0, 1.0, 4.0, 256] now" in msg


def test_runtime_model_settings_may_change_on_resume(tmp_path):
  """Every model.* and env.* change was refused: a run that ran out of memory could not resume
  with model.remat changed, nor on another machine with its task data elsewhere."""
  learner = _learner(1)
  config = _config(remat="none", attention="auto")
  config.env.kwargs = dict(data_dir="/data/a", size=3)
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1, keep=1,
                                                                           async_save=False))
  mgr.save(1, learner.init(_initial_params()), meta=_meta(config))
  moved = _config(remat="full", attention="xla")
  moved.env.kwargs = dict(data_dir="/mnt/b", size=3)
  r = mgr.restore_latest(_target(learner), config=moved)
  assert r.changed == [("env.kwargs.data_dir", "/data/a", "/mnt/b"),
                       ("model.attention", "auto", "xla"), ("model.remat", "none", "full")]
  # The resumed run's checkpoints are the same run's: retention deletes the older one.
  mgr.save(2, learner.init(_initial_params()), meta=_meta(moved))
  mgr.close()
  assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2]
  # What the run computes still may not change.
  other = _config(remat="full", attention="xla", dtype="bfloat16")
  other.env.kwargs = dict(data_dir="/mnt/b", size=4)
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1))
  with pytest.raises(checkpoint.IncompatibleCheckpointError) as e:
    mgr.restore_latest(_target(learner), config=other)
  mgr.close()
  assert "config env.kwargs.size: 3 in the checkpoint, 4 now" in str(e.value)
  assert "config model.dtype: '<unset>' in the checkpoint, 'bfloat16' now" in str(e.value)
  assert "remat" not in str(e.value) and "data_dir" not in str(e.value)


def test_a_mixture_task_s_data_dir_may_move_on_resume(tmp_path):
  """A mixture task's `kwargs.data_dir` was an identity key: moving one task's data refused the
  resume. Its other settings (the weight here) still belong to the run."""
  learner = _learner(1)

  def mixture(data_dir, weight):
    config = _config()
    config.env.name = "mixture"
    config.env.kwargs = dict(tasks=dict(
        kb=dict(env="search_qa", weight=weight, kwargs=dict(data_dir=data_dir)),
        arith=dict(env="quickstart", weight=1.0)))
    return config

  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1, keep=1,
                                                                           async_save=False))
  mgr.save(1, learner.init(_initial_params()), meta=_meta(mixture("/data/kb", 2.0)))
  r = mgr.restore_latest(_target(learner), config=mixture("/mnt/kb", 2.0))
  assert r.changed == [("env.kwargs.tasks.kb.kwargs.data_dir", "/data/kb", "/mnt/kb")]
  # Retention sees the moved run as the same run.
  mgr.save(2, learner.init(_initial_params()), meta=_meta(mixture("/mnt/kb", 2.0)))
  mgr.close()
  assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2]
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1))
  with pytest.raises(checkpoint.IncompatibleCheckpointError) as e:
    mgr.restore_latest(_target(learner), config=mixture("/mnt/kb", 3.0))
  mgr.close()
  assert "config env.kwargs.tasks.kb.weight: 2.0 in the checkpoint, 3.0 now" in str(e.value)
  assert "kwargs.data_dir" not in str(e.value)
  assert checkpoint.is_runtime_key("env.kwargs.tasks.kb.kwargs.data_dir")
  assert not checkpoint.is_runtime_key("env.kwargs.tasks.kb.kwargs.data_dir_extra")
  assert not checkpoint.is_runtime_key("env.kwargs.tasks.kb.data_dir")


def test_config_with_inf_or_nan_resumes_and_its_changes_are_named(tmp_path):
  # JSON holds no inf or nan: the saved config must still equal the run's own on resume.
  learner = _learner(1)
  config = _config()
  config.env.kwargs = dict(limit=float("inf"), floor=float("-inf"), scale=float("nan"))
  mgr = checkpoint.CheckpointManager(tmp_path, checkpoint.CheckpointConfig(every=1,
                                                                           async_save=False))
  mgr.save(1, learner.init(_initial_params()), meta=_meta(config))
  assert mgr.restore_latest(_target(learner), config=config).changed == []
  config.env.kwargs.limit = 5.0
  with pytest.raises(checkpoint.IncompatibleCheckpointError,
                     match=r"config env.kwargs.limit: 'inf' in the checkpoint, 5.0 now"):
    mgr.restore_latest(_target(learner), config=config)


@pytest.mark.parametrize("key,value", [("checkpoint_every", True), ("checkpoint_every", 2.5),
                                       ("checkpoint_keep", None), ("checkpoint_keep", 1.9),
                                       ("checkpoint_keep_every", -1)])
def test_bad_checkpoint_settings_are_refused_not_truncated(key, value):
  with pytest.raises(ValueError, match=rf"{key} must be an int >= [01], got {value!r}"):
    checkpoint.CheckpointConfig.from_config({key: value})
  cfg = checkpoint.CheckpointConfig.from_config(
      {"checkpoint_every": np.int64(4), "checkpoint_keep": 2, "checkpoint_keep_every": None})
  assert (cfg.every, cfg.keep, cfg.keep_every) == (4, 2, 0) and type(cfg.every) is int


# ----------------------------------------------------------------------------- trainer runs
# The tiny quickstart in subprocesses of `python -m jaxagent.launch`, made to update every step
# (entropy and KL terms give gradients even when a random model earns no reward) and cheap to
# evaluate. One CPU device each (resharding is tested above; one device halves the compile time)
# and a shared compilation cache, which changes how long the programs take to get, not the
# programs (see `run_files`).
FLAGS = ("--config=configs/quickstart.py:tiny", "--config.log.tensorboard=False",
         "--config.loss.entropy_coef=0.01", "--config.loss.kl_coef=0.01",
         "--config.train.zero_variance=keep", "--config.eval.size=2", "--config.eval.every=2",
         "--config.log.dump_every=1")


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
  """A compilation cache shared by the runs, and the quickstart tokenizer saved as
  tokenizer.json (the same tokenizer; it loads in 0.2 s instead of 5 s from the GGUF)."""
  cache = tmp_path_factory.mktemp("jax_cache")
  tok_dir = tmp_path_factory.mktemp("tokenizer")
  models.load_tokenizer("smollm2-135m-instruct").save(tok_dir)
  return cache, tok_dir


def _launch(workdir, run_files, *flags, **popen):
  cache, tok_dir = run_files
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {CPU_TEST_XLA_FLAGS}",
             JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  cmd = [sys.executable, "-m", "jaxagent.launch", *FLAGS, f"--config.workdir={workdir}",
         f"--config.model.tokenizer={tok_dir}", *flags]
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, **popen)


def _finish(proc, timeout=300) -> str:
  try:
    out, _ = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 0, out[-4000:]
  return out


def _records(workdir):
  recs = [json.loads(l) for l in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  # Timings, and compile counts (they depend on what the process and the shared compilation
  # cache already hold, not on the run).
  timing = lambda k: (k == "time" or k.startswith("time/") or k.endswith(("_s", "seconds"))
                      or "compile" in k)
  return [{k: v for k, v in r.items() if not timing(k)} for r in recs]


def _samples(workdir, step):
  keys = ("request_id", "example_id", "tokens", "roles", "logprobs", "stop_reason")
  lines = (pathlib.Path(workdir) / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()
  return [{k: json.loads(l)[k] for k in keys} for l in lines]


def _saved_arrays(workdir, step):
  """Every array of checkpoint `step` as host NumPy, by item name."""
  import orbax.checkpoint as ocp
  mgr = ocp.CheckpointManager(pathlib.Path(workdir) / "checkpoints",
                              options=ocp.CheckpointManagerOptions(read_only=True))
  out = {}
  for name in ("params", "train", "ref_params"):
    tree = mgr.restore(step, args=ocp.args.Composite(**{name: ocp.args.PyTreeRestore()}))[name]
    out[name] = jax.tree.map(np.asarray, tree)
  mgr.close()
  return out


def _metric_steps(workdir):
  path = pathlib.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  steps = []
  for line in path.read_text().splitlines():
    try:
      steps.append(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError):
      pass
  return steps


@pytest.mark.slow  # three launches in subprocesses (about a minute on 2 cores)
def test_resume_is_exact(tmp_path, run_files):
  """4 steps straight == 2 steps, a restart from the step-2 checkpoint, 2 more steps."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  every = "--config.checkpoint_every=2"
  # One after another: the first run fills the compilation cache for the others.
  _finish(_launch(straight, run_files, "--config.total_steps=4", every))
  _finish(_launch(resumed, run_files, "--config.total_steps=2", every))
  assert sorted(int(p.name) for p in (resumed / "checkpoints").iterdir() if p.name.isdigit()) == [
      0, 2]
  out = _finish(_launch(resumed, run_files, "--config.total_steps=4", every))
  assert f"resumed from checkpoint {resumed / 'checkpoints' / '2'} (RL step 2 of 4)" in out
  assert "resuming with changed settings: total_steps: 2 -> 4" in out
  assert "sft step" not in out and "before training" not in out  # no second warm start

  # Bitwise: params, optimizer state and step count, KL reference.
  a, b = _saved_arrays(straight, 4), _saved_arrays(resumed, 4)
  _assert_trees_equal(b, a)
  assert int(b["train"]["step"]) == 4
  moved = [np.any(x != y) for x, y in zip(jax.tree.leaves(a["params"]),
                                          jax.tree.leaves(a["ref_params"]))]
  assert any(moved)  # it trained
  # Same data order and rollouts at every step, before and after the restart.
  for step in range(1, 5):
    assert _samples(resumed, step) == _samples(straight, step), f"step {step}"
  # Same metrics; each step logged once; the pre-RL phase logged once.
  rec_a, rec_b = _records(straight), _records(resumed)
  assert rec_b == rec_a
  assert [r["step"] for r in rec_b if r["step"] > 0] == [1, 2, 3, 4]
  assert all(r["train/loss"] is not None for r in rec_b if r["step"] > 0)
  summary = json.loads((resumed / "summary.json").read_text())
  assert summary["sft/num_examples"] == 16 and "pass@1/before" in summary


@pytest.mark.slow  # tens of seconds on a 2-core CPU (the default run's time budget)
def test_sigterm_finishes_the_step_saves_and_exits_zero(tmp_path, run_files):
  proc = _launch(tmp_path, run_files, "--config.total_steps=200",
                 "--config.checkpoint_every=1000")
  try:
    deadline = time.time() + 240
    while not any(s >= 1 for s in _metric_steps(tmp_path)):
      assert proc.poll() is None, proc.communicate()[0][-3000:]
      assert time.time() < deadline, "RL did not start"
      time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
  except BaseException:
    proc.kill()
    raise
  out = _finish(proc)
  last = max(_metric_steps(tmp_path))
  assert 1 <= last < 200
  ckpt = tmp_path / "checkpoints" / str(last)
  assert f"received SIGTERM: saved checkpoint {ckpt} at step {last}" in out, out[-3000:]
  assert sorted(int(p.name) for p in ckpt.parent.iterdir() if p.name.isdigit()) == [0, last]
  meta = json.loads((ckpt / "meta" / "metadata").read_text())
  assert meta["step"] == last and meta["warm_started"]


@pytest.mark.slow  # CI time; test_interrupted_save_is_named_and_skipped covers the skip in-process
def test_kill9_during_save_resumes_from_previous_checkpoint(tmp_path, run_files):
  ckdir = tmp_path / "checkpoints"
  proc = _launch(tmp_path, run_files, "--config.total_steps=20",
                 "--config.checkpoint_every=1")
  killed_at = None
  try:
    deadline = time.time() + 300
    while killed_at is None:
      if proc.poll() is not None:
        pytest.fail("the run ended before a save could be interrupted:\n" +
                    proc.communicate()[0][-3000:])
      assert time.time() < deadline
      if ckdir.is_dir():
        tmps = [p for p in ckdir.iterdir() if p.name.endswith(".orbax-checkpoint-tmp")
                and int(p.name.split(".")[0]) >= 1]
        if tmps:
          os.kill(proc.pid, signal.SIGKILL)
          killed_at = tmps[0]
      time.sleep(0.002)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  complete = sorted(int(p.name) for p in ckdir.iterdir() if p.name.isdigit())
  partial = [p for p in ckdir.iterdir() if p.name.endswith(".orbax-checkpoint-tmp")]
  assert complete, "no complete checkpoint before the kill"
  assert partial, f"the kill landed after {killed_at} was finalised"
  resume_step = complete[-1]
  assert resume_step < int(killed_at.name.split(".")[0])

  out = _finish(_launch(tmp_path, run_files, f"--config.total_steps={resume_step + 1}",
                        "--config.checkpoint_every=1"))
  for p in partial:
    assert f"skipping incomplete checkpoint {p}" in out, out[-3000:]
  assert f"resumed from checkpoint {ckdir / str(resume_step)}" in out, out[-3000:]
  assert (ckdir / str(resume_step + 1)).is_dir() and not any(p.exists() for p in partial)
  steps = [s for s in _metric_steps(tmp_path) if s > 0]
  assert steps == list(range(1, resume_step + 2))  # each step logged once


# ----------------------------------------------------------------------------- export
def test_export_loads_in_transformers_with_matching_logits(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  learner = _learner(2)
  state = _trained_state(learner)
  config = _config()
  config.model.tokenizer = ""
  mgr = checkpoint.CheckpointManager(tmp_path / "run" / "checkpoints",
                                     checkpoint.CheckpointConfig(every=1))
  meta = dict(_meta(config), model_config=dataclasses.asdict(CFG))
  mgr.save(2, state, meta=meta)
  mgr.close()
  out = checkpoint.export_hf(tmp_path / "run", tmp_path / "hf", tokenizer=None)
  assert json.loads((out / "jaxagent_export.json").read_text())["step"] == 2

  hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
  tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 12)).astype(np.int32)
  with torch.no_grad():
    want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  got = models.forward(jax.device_get(state.params), jnp.asarray(tokens), cfg=CFG)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4)
  # And our loader reads the export back to the same arrays.
  _, params = models.load(out)
  _assert_trees_equal(models.unbox(params), models.unbox(jax.device_get(state.params)))


def test_export_skips_a_corrupt_newest_checkpoint(tmp_path, caplog):
  """A corrupt newest checkpoint stopped the export, though the resume skips it for the one
  before; now the newest that reads is exported and the skipped one is named."""
  learner = _learner(2)
  s1 = _trained_state(learner, steps=1)
  p1 = jax.device_get(s1.params)
  config = _config()
  config.model.tokenizer = ""
  meta = dict(_meta(config), model_config=dataclasses.asdict(CFG))
  ckdir = tmp_path / "run" / "checkpoints"
  mgr = checkpoint.CheckpointManager(ckdir, checkpoint.CheckpointConfig(every=1, async_save=False))
  mgr.save(1, s1, meta=meta)
  s2, _ = learner.train_step(s1, _batch(5))  # (donates s1)
  mgr.save(2, s2, meta=meta)
  mgr.close()
  _corrupt(ckdir / "2")
  with caplog.at_level("WARNING", logger="jaxagent.checkpoint"):
    out = checkpoint.export_hf(tmp_path / "run", tmp_path / "hf", tokenizer=None)
  assert json.loads((out / "jaxagent_export.json").read_text())["step"] == 1
  assert f"not exporting checkpoint {ckdir / '2'} is corrupt" in caplog.text
  _, params = models.load(out)
  _assert_trees_equal(models.unbox(params), models.unbox(p1))
  # A step asked for by number is that step or an error.
  with pytest.raises(checkpoint.CheckpointError, match=f"{ckdir / '2'} is corrupt"):
    checkpoint.export_hf(tmp_path / "run", tmp_path / "hf2", step=2, tokenizer=None)
  _corrupt(ckdir / "1")
  with pytest.raises(checkpoint.CheckpointError, match=r"no usable checkpoint in .*\n  .*2 is "
                     r"corrupt.*\n  .*1 is corrupt"):
    checkpoint.export_hf(tmp_path / "run", tmp_path / "hf3", tokenizer=None)


def test_export_of_another_format_or_model_config_is_named_not_a_traceback(tmp_path):
  """A checkpoint of another format, or whose model config has a field this version lacks
  (written by another jaxagent version), raised a bare TypeError from ModelConfig, which
  `python -m jaxagent.export` showed as a traceback; now a CheckpointError names it."""
  learner = _learner(2)
  config = _config()
  config.model.tokenizer = ""
  ckdir = tmp_path / "run" / "checkpoints"
  mgr = checkpoint.CheckpointManager(ckdir, checkpoint.CheckpointConfig(every=1, async_save=False))
  mgr.save(1, _trained_state(learner, steps=1),
           meta=dict(_meta(config), model_config=dataclasses.asdict(CFG)))
  mgr.close()
  meta_file = ckdir / "1" / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  meta["model_config"]["a_later_field"] = 4  # as a later jaxagent writes it, with its digest
  meta[checkpoint.META_DIGEST] = checkpoint.meta_digest(meta)
  meta_file.write_text(json.dumps(meta))
  with pytest.raises(checkpoint.IncompatibleCheckpointError,
                     match=r"1 holds a model config this jaxagent cannot read \(TypeError: .*"
                     r"a_later_field"):
    checkpoint.export_hf(tmp_path / "run", tmp_path / "hf", step=1, tokenizer=None)
  meta["format"] = checkpoint.FORMAT + 1
  meta[checkpoint.META_DIGEST] = checkpoint.meta_digest(meta)
  meta_file.write_text(json.dumps(meta))
  with pytest.raises(checkpoint.IncompatibleCheckpointError,
                     match=rf"1 has format {checkpoint.FORMAT + 1}; this jaxagent reads format"):
    checkpoint.export_hf(tmp_path / "run", tmp_path / "hf", step=1, tokenizer=None)


def test_a_changed_window_or_gemma_setting_is_another_model():
  """Sliding windows and Gemma 3's settings change the function the same arrays compute: a
  resume under another window, RoPE base of the windowed layers or attention scale is refused;
  metadata written before these fields existed (no such keys) still passes."""
  from jaxagent import models
  path = "ckpt/3"
  windowed = dataclasses.replace(CFG, sliding_window=8, sliding_layers=(0,))
  meta = {"model_config": json.loads(json.dumps(checkpoint._json_safe(dataclasses.asdict(CFG))))}
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match="model sliding_window: None in "
                     "the checkpoint, 8 now"):
    checkpoint.check_model_config(meta, windowed, path)
  old = {"model_config": {k: v for k, v in meta["model_config"].items()
                          if k not in ("sliding_window", "sliding_layers")}}
  checkpoint.check_model_config(old, CFG, path)
  gemma = models.get_config("tiny-gemma3")
  gmeta = {"model_config": json.loads(json.dumps(checkpoint._json_safe(dataclasses.asdict(gemma))))}
  checkpoint.check_model_config(gmeta, gemma, path)
  for change in ({"local_rope_theta": 1234.0}, {"query_pre_attn_scalar": 7.0},
                 {"sliding_layers": tuple(i for i in range(gemma.n_layers)
                                          if i not in gemma.sliding_layers)}):
    field = next(iter(change))
    with pytest.raises(checkpoint.IncompatibleCheckpointError, match=f"model {field}:"):
      checkpoint.check_model_config(gmeta, dataclasses.replace(gemma, **change), path)
