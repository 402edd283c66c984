"""The planner: run shapes, the trainer's step settings, CPU plans, knobs, and TPU AOT compiles."""
import dataclasses
import json
import re

import jax
import numpy as np
import pytest

from configs import quickstart
from jaxagent import plan
from jaxagent.envs import quickstart as quickstart_env
from jaxagent.plan.chips import GiB, ChipSpec

needs_libtpu = pytest.mark.skipif(
    not plan.has_libtpu(),
    reason="libtpu is not installed: pip install 'jaxagent[tpu]' to compile for TPU topologies")


def tiny(data=2, fsdp=1, tensor=2):
  c = quickstart.get_config("tiny")
  c.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
  return c


def test_run_shapes_are_the_trainers_worst_case():
  c = tiny()
  c.train.update(prompts_per_step=5, samples_per_prompt=3, micro_batches=2)
  s = plan.run_shapes(c, {"data": 2, "fsdp": 2, "tensor": 1})
  assert s.rows == 16                          # 15 trajectories, rounded to 2 x (2 x 2)
  assert s.len_buckets == (128,) and s.micro_batches == 2
  assert s.sft_rows == 8                       # sft batch 4, rounded to 8
  c.rollout.update(slots=6, max_len=128)
  s = plan.run_shapes(c, {"data": 1, "fsdp": 1, "tensor": 1},
                      plan.PlanOptions(prompt_len=40, append_len=20))
  assert (s.prefill_batch, s.prefill_len) == (8, 64)     # engine buckets: pow2 count, length
  assert (s.append_batch, s.append_len) == (8, 32)
  assert s.kv_len == 128 and not s.kl
  c.rollout.max_prompt_tokens = 30  # the config's bound on prompts, when no option says
  assert plan.run_shapes(c, {"data": 1, "fsdp": 1, "tensor": 1}).prefill_len == 32
  with pytest.raises(ValueError, match="programs"):
    plan.PlanOptions(programs=("decode",))
  with pytest.raises(ValueError, match=r"PlanOptions.rows must be None or a positive int, got True"):
    plan.PlanOptions(rows=True)  # was read as 1


def test_update_is_planned_for_one_mini_batch_of_the_trainers_rows():
  """train.mini_batches: the step's rows round to mini x micro x data-parallel devices, as the
  trainer packs them; each update (the program compiled) sees rows / mini_batches of them; the
  reference scoring all rows; the warm start's batch, one update, rounds without mini_batches."""
  c = tiny()
  c.train.update(prompts_per_step=5, samples_per_prompt=3, micro_batches=2, mini_batches=2)
  s = plan.run_shapes(c, {"data": 2, "fsdp": 2, "tensor": 1})
  assert s.rows == 16 and s.mini_batches == 2 and s.update_rows == 8  # 15, rounded to 2 x 2 x 4
  assert s.sft_rows == 8                       # sft batch 4, rounded to 2 x 4
  c.train.mini_batches = 3
  s = plan.run_shapes(c, {"data": 2, "fsdp": 2, "tensor": 1})
  assert (s.rows, s.update_rows) == (24, 8)
  from jaxagent.models import get_config
  c = tiny()
  c.train.mini_batches = 2
  report = plan.plan_run(c, jax.devices()[:4], cfg=get_config("tiny-llama", n_layers=1),
                         options=plan.PlanOptions(programs=("update", "score")))
  assert report.shapes.rows == 8                # 4 prompts x 2 samples
  assert report.program("update").shapes == "[4x128] m=1"
  assert report.program("score").shapes == "[8x128]"


def test_update_micro_batch_knob_counts_one_mini_batchs_rows():
  c = tiny()
  c.train.update(prompts_per_step=16, samples_per_prompt=2)  # 32 rows: 8 per chip
  update = lambda: plan.ProgramReport("update[L=128]", "update", "[32x128]", temp_bytes=20 * GiB)
  assert any("8 rows per chip" in k for k in _report_with(update(), c).knobs)
  c.train.mini_batches = 4                                   # 8 rows per update: 2 per chip
  assert any("train.micro_batches=2" in k and "2 rows per chip" in k
             for k in _report_with(update(), c).knobs)


@pytest.mark.slow  # builds a whole Trainer (about 10-20 s on 2 cores)
def test_learner_parts_match_the_trainer():
  c = tiny(1, -1, 1)
  c.workdir = "/tmp/jaxagent-plan-test"
  from jaxagent.trainer import Trainer
  trainer = Trainer(c)
  try:
    (scfg, opt), _ = plan.learner_parts(c)
    assert scfg == trainer.step_cfg
    assert plan.model_config(c) == trainer.cfg
    x = np.zeros(3, np.float32)
    assert jax.tree.structure(opt.init(x)) == jax.tree.structure(trainer.optimizer.init(x))
  finally:
    trainer.close()


@pytest.mark.slow  # ~20 s on 2 cores
def test_model_attention_key_sets_the_attention_path():
  c = tiny()
  assert c.model.attention == "auto" and plan.model_config(c).attention_impl == "auto"
  c.model.attention = "pallas"
  assert plan.model_config(c).attention_impl == "pallas"
  c.model.attention = "flash"
  with pytest.raises(ValueError, match="attention_impl"):
    plan.model_config(c)


def test_model_config_reads_hf_directory(tmp_path):
  from jaxagent.models import get_config
  ref = get_config("tiny-qwen2")
  (tmp_path / "config.json").write_text(json.dumps(ref.to_hf()))
  c = tiny()
  c.model.update(path=str(tmp_path), param_dtype="bfloat16", dtype="bfloat16")
  cfg = plan.model_config(c)
  assert (cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.qkv_bias) == (64, 2, 512, True)
  assert cfg.param_dtype == "bfloat16"
  c.model.path = str(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match="preset"):
    plan.model_config(c)
  (tmp_path / "config.json").write_text('{"model_type": "llama"')  # cut short
  c.model.path = str(tmp_path)
  with pytest.raises(ValueError, match=r"config.json is not valid JSON \(Expecting"):
    plan.model_config(c)
  # Valid JSON that is not an object: an AttributeError the plan's command line re-raised.
  (tmp_path / "config.json").write_text('[{"model_type": "llama"}]')
  with pytest.raises(ValueError, match=r"config.json: expected a JSON object .*, got list"):
    plan.model_config(c)
  # A run's workdir passed as the model: named, with how to export it (as models.load says).
  run = tmp_path / "run"
  (run / "checkpoints" / "6").mkdir(parents=True)
  c.model.path = str(run)
  with pytest.raises(FileNotFoundError, match=r"has no config\.json .*it is a jaxagent run's "
                     r"workdir or checkpoint: export its policy first"):
    plan.model_config(c)


def test_plan_on_local_cpu_devices():
  from jaxagent.models import get_config
  c = tiny()
  # One layer, one micro-batch, one log-prob chunk: every loop runs once, so XLA's own cost
  # analysis is complete and the loop-aware HLO walk must reproduce it.
  cfg = get_config("tiny-llama", n_layers=1)
  report = plan.plan_run(c, jax.devices()[:4], cfg=cfg,
                         options=plan.PlanOptions(programs=("update",)))
  assert [p.name for p in report.programs] == ["update[L=128]"]
  assert report.mesh == {"data": 2, "fsdp": 1, "tensor": 2}
  assert report.fits is None             # host memory: no capacity, no verdict
  up = report.program("update")
  assert up.argument_bytes > 0 and up.alias_bytes > 0       # the train state is donated
  assert up.flops <= up.xla_flops <= 1.15 * up.flops       # XLA adds elementwise flops
  assert up.bytes_accessed == pytest.approx(up.xla_bytes, rel=0.05)
  # Independent count: 6N + attention flops per token (ModelConfig.flops_per_token) over the
  # batch, split over 4 chips; the HLO count adds the full (not causal-half) attention
  # square and the log-prob chunk recomputed in the backward pass.
  expected = cfg.flops_per_token(128) * report.shapes.rows * 128 / 4
  assert 0.9 < up.flops / expected < 2.0, (up.flops, expected)
  assert up.collectives["all-reduce"].static > 0
  assert "update[L=128]" in report.render()


def test_generate_is_planned_over_the_engines_whole_cache(monkeypatch):
  # The GPU decode kernel rounds the cache up to a multiple of 64 tokens (max_len 100: 128),
  # and the engine's generate reads up to all of it; the plan compiled generate and append at
  # kv_len = max_len instead, programs the run never runs. Forced here with the kernel in
  # interpret mode, as on a GPU, where "auto" picks it.
  from jaxagent.generate.engine import Engine, EngineConfig
  from jaxagent.models import get_config
  from jaxagent.plan import planner

  class GpuKernelEngine(Engine):
    def __init__(self, cfg, ecfg, **kw):
      super().__init__(cfg, dataclasses.replace(ecfg, decode_attention="pallas"), **kw)

  monkeypatch.setattr(planner, "Engine", GpuKernelEngine)
  cfg = get_config("tiny-llama", n_layers=1)
  c = tiny(1, 1, 1)
  c.rollout.update(slots=2, max_len=100, decode_steps=1)
  report = plan.plan_run(c, jax.devices()[:1], cfg=cfg,
                         options=plan.PlanOptions(programs=("generate",)))
  engine = GpuKernelEngine(cfg, EngineConfig(slots=2, max_len=100))
  assert engine.cache_len == 128
  assert report.shapes.kv_len == 128
  gen = report.program("generate")
  assert gen.error is None and gen.shapes == "2 slots x 1 steps, kv 128"


def test_merged_decode_weights_are_resident_through_the_rollout(monkeypatch):
  # Where the engine decodes with merged q|k|v and gate|up weights (on GPUs by default), the
  # rollout driver makes them once per rollout (`Engine.prepare`): a second copy of the
  # weights, alive beside the params through prefill, insert, generate and append, and the
  # params generate is called with. The plan left the copy out (append planned as if it did
  # not exist) and planned generate on the plain params, merging inside the program.
  from jaxagent.generate.engine import Engine
  from jaxagent.models import get_config, param_tree
  from jaxagent.plan import planner

  class MergingEngine(Engine):
    def __init__(self, cfg, ecfg, **kw):
      super().__init__(cfg, dataclasses.replace(ecfg, decode_merge_weights=True), **kw)

  planned = {}  # program -> the arguments it is planned with (not compiled: fast)
  monkeypatch.setattr(planner, "Engine", MergingEngine)
  monkeypatch.setattr(planner, "_compile", lambda rep, fn, args, *_: planned.update(
      {rep.name: args}))
  cfg = get_config("tiny-llama", n_layers=1)
  c = tiny(1, 1, 1)
  c.rollout.update(slots=2, max_len=32, decode_steps=1)
  report = plan.plan_run(c, jax.devices()[:1], cfg=cfg,
                         options=plan.PlanOptions(programs=("generate", "append")))
  gen, app = report.program("generate"), report.program("append")
  weights = cfg.num_params() * 4               # float32, one device; merging keeps the count
  assert app.components["decode_weights"] == weights
  assert app.resident_bytes == app.components["optimizer"] + weights
  # generate takes the merged copy, as the driver calls it; the params stay resident.
  assert gen.resident_bytes == gen.components["optimizer"] + gen.components["params"]
  engine = MergingEngine(cfg, planner.EngineConfig(slots=2, max_len=32))
  params = jax.eval_shape(lambda k: param_tree.init_params(cfg, k), jax.random.key(0))
  prepared = jax.eval_shape(engine.prepare, params)
  sig = lambda tree: jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), tree)
  assert sig(planned["generate"][0]) == sig(prepared.decode)
  assert sig(planned["append"][0]) == sig(prepared.params)  # append takes the plain params


def test_insert_is_planned_with_the_arguments_the_rollout_driver_passes():
  # The rollout driver inserts through Engine.prefill_insert: the prefill's whole padded batch
  # (6 slots: 8 rows) with the rows' prompt sharing. The plan compiled insert on the first 6
  # rows without sharing, a program the run never runs, its prefix a quarter smaller.
  from jaxagent.generate.engine import Engine, EngineConfig
  from jaxagent.models import get_config, init_params
  cfg = get_config("tiny-llama", n_layers=1)
  c = tiny(1, 1, 1)
  c.rollout.update(slots=6, max_len=64)
  exe = {}
  report = plan.plan_run(c, jax.devices()[:1], cfg=cfg, executables=exe,
                         options=plan.PlanOptions(prompt_len=20, programs=("insert",)))
  assert report.program("insert").error is None
  assert report.program("insert").shapes == "8 prefixes of 32"
  engine = Engine(cfg, EngineConfig(slots=6, max_len=64))
  calls, real = [], engine._jit_insert
  engine._jit_insert = lambda *args: (calls.append(args), real(*args))[1]
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, cfg.vocab_size, 20).tolist() for _ in range(3)] * 2  # groups of 2
  engine.prefill_insert(init_params(cfg, jax.random.key(0)), engine.init_decode_state(),
                        prompts, list(range(6)), list(range(6)))
  sig = lambda args: (jax.tree.structure(args),
                      [(tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(args)])
  assert sig(exe["insert"][1]) == sig(calls[0])


@pytest.mark.slow  # default-run time budget: 4-7 s of compiles
def test_data_rollout_mesh_plans_decode_with_replicated_weights():
  from jaxagent.models import get_config
  cfg = get_config("tiny-llama", n_layers=1)
  c = tiny(1, 4, 1)
  opts = plan.PlanOptions(programs=("generate",))
  fsdp = plan.plan_run(c, jax.devices()[:4], cfg=cfg, options=opts).program("generate")
  c.rollout.mesh = "data"
  data = plan.plan_run(c, jax.devices()[:4], cfg=cfg, options=opts).program("generate")
  # The decode step reads a whole (replicated) copy of the weights on every chip, and keeps
  # the learner's fsdp-sharded masters resident beside it; over fsdp it gathers the weights
  # at every step, over data only the sampled tokens.
  assert data.components["params"] == pytest.approx(4 * fsdp.components["params"], rel=0.05)
  assert data.components["learner_params"] == fsdp.components["params"]
  gathered = lambda r: r.collectives["all-gather"].bytes if "all-gather" in r.collectives else 0
  weights = data.components["params"]
  assert gathered(fsdp) > 0.5 * weights and gathered(data) < 0.1 * weights, (
      weights, data.collectives, fsdp.collectives)


def test_float32_masters_decode_from_a_compute_dtype_copy_on_the_learner_mesh():
  from jaxagent.models import get_config
  c = tiny(1, 4, 1)
  opts = plan.PlanOptions(programs=("generate",))
  plan_of = lambda cfg: plan.plan_run(c, jax.devices()[:4], cfg=cfg, options=opts
                                      ).program("generate")
  same = plan_of(get_config("tiny-llama", n_layers=1))
  mixed = plan_of(get_config("tiny-llama", n_layers=1, param_dtype="float32", dtype="bfloat16"))
  # The trainer hands the generator a bfloat16 copy of the float32 masters
  # (`Trainer._generator_params`) and keeps the masters alive beside it: half the weight bytes
  # in the program, the masters resident.
  assert "learner_params" not in same.components
  assert mixed.components["learner_params"] == same.components["params"]
  assert mixed.components["params"] == pytest.approx(0.5 * same.components["params"], rel=0.05)
  assert mixed.resident_bytes == pytest.approx(same.resident_bytes + same.components["params"])


class ObservationEnv(quickstart_env.ArithmeticToolEnv):
  """The quickstart task trained on its observation tokens too (as search_qa with
  mask_observations=False): the trainer scores their old log-probs before each update."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.train_on_observations = True


def test_score_is_used_exactly_when_the_trainer_runs_it():
  from jaxagent.models import get_config
  cfg = get_config("tiny-llama", n_layers=1)
  c = tiny(1, 1, 1)
  c.model.tokenizer = ""
  opts = plan.PlanOptions(programs=("score",))
  score = lambda: plan.plan_run(c, jax.devices()[:1], cfg=cfg, options=opts).program("score")
  assert c.loss.kl_coef == 0 and not score().used
  # An env that trains on observations: `Trainer.fill_unsampled_old_logps` scores the current
  # params before every update (the plan left this program out of the verdict).
  c.env.name = f"{__name__}:ObservationEnv"
  obs = score()
  assert obs.used
  # It scores the train state's own params: the optimizer state is what is resident beside
  # them, not a second copy of the params.
  assert obs.resident_bytes == obs.components["optimizer"] > 0
  c.env.name = "quickstart"
  c.loss.kl_coef = 0.01   # reference log-probs: the reference params are the argument
  kl = score()
  assert kl.used
  assert kl.resident_bytes == kl.components["params"] + kl.components["optimizer"]
  # The predicate the planner asks.
  assert plan.runs_score(c)
  c.loss.kl_coef = 0.0
  assert not plan.runs_score(c)
  c.env.name = f"{__name__}:ObservationEnv"
  assert plan.runs_score(c)
  # A misspelt env setting is refused as the trainer refuses it, not planned with the default.
  c.env.name = "quickstart"
  c.env.kwargs.max_term = 3
  with pytest.raises(ValueError, match="unknown setting 'max_term'"):
    plan.plan_run(c, jax.devices()[:1], cfg=cfg, options=plan.PlanOptions(programs=("update",)))


def test_check_fit_is_lenient_on_cpu():
  c = tiny()
  c.model.tokenizer = ""
  assert plan.check_fit(c, "auto") is None           # skipped: CPU memory is host memory
  assert plan.check_fit(c, "off") is None
  rep = plan.check_fit(c, "on", devices=jax.devices()[:4],
                       options=plan.PlanOptions(programs=("generate",)))
  assert rep is not None and rep.fits is None        # reported, never raised
  assert rep.program("generate").components["kv_cache"] > 0
  with pytest.raises(ValueError, match="auto"):
    plan.check_fit(c, "sometimes")


def _report_with(program: plan.ProgramReport, config=None, **mesh):
  config = config if config is not None else tiny()
  shapes = plan.run_shapes(config, {"data": 4, "fsdp": 1, "tensor": 1})
  chip = ChipSpec("v5e", 16 * GiB, 197e12, 197e12, 819e9)
  program.capacity = chip.hbm_bytes
  from jaxagent.models import get_config
  cfg = get_config("qwen2.5-7b")
  rep = plan.PlanReport(model=cfg.name, num_params=cfg.num_params(), target="v5e:2x2",
                        platform="tpu", chip=chip, n_devices=4,
                        mesh=mesh or {"data": 4, "fsdp": 1, "tensor": 1}, shapes=shapes,
                        programs=[program], knobs=[])
  rep.knobs = plan.knobs(rep, config, cfg)
  return rep


def test_knobs_name_the_setting_for_what_overflows():
  weights = plan.ProgramReport("update[L=128]", "update", "[8x128]", argument_bytes=85 * GiB,
                               components={"params": 28 * GiB, "optimizer": 57 * GiB})
  rep = _report_with(weights)
  assert rep.fits is False
  assert "mesh.fsdp=4" in rep.knobs[0]
  assert any("param_dtype=bfloat16" in k for k in rep.knobs)
  assert any("micro_batches" in k for k in rep.knobs)
  assert "DOES NOT FIT" in rep.render()
  assert "(params + optimizer state take 85.0 GiB per chip" in rep.knobs[0]
  # The knobs name what the program holds: a generator program has no optimizer state.
  gen = plan.ProgramReport("generate", "generate", "64 slots", argument_bytes=17 * GiB,
                           components={"params": 15 * GiB})
  knobs = _report_with(gen).knobs
  assert "(params take 15.0 GiB per chip at fsdp=1 and shrink as 1/fsdp)" in knobs[0]
  assert not any("optimizer" in k for k in knobs)

  kv = plan.ProgramReport("generate", "generate", "64 slots", argument_bytes=2 * GiB,
                          temp_bytes=15 * GiB,
                          components={"params": 1 * GiB, "optimizer": 1 * GiB,
                                      "kv_cache": 12 * GiB})
  rep = _report_with(kv)
  assert not any("fsdp" in k for k in rep.knobs)
  assert any("rollout.slots" in k for k in rep.knobs)

  small = plan.ProgramReport("generate", "generate", "8 slots", argument_bytes=GiB)
  assert _report_with(small).fits is True and _report_with(small).knobs == []

  # A compile failure that is not an out-of-memory refusal is reported, not a verdict.
  broken = plan.ProgramReport("append", "append", "[8x8]", error="INVALID_ARGUMENT: bad")
  rep = _report_with(broken)
  assert rep.fits is None and "failed to compile" in rep.knobs[0]
  assert "compile failed: INVALID_ARGUMENT" in rep.render()


def test_score_that_does_not_fit_gets_the_micro_batch_knob():
  # `Learner.score_fn` runs its rows in train.micro_batches, as the update does: more of them
  # shrink its activations (the knobs named only train.pack_len).
  c = tiny()
  c.train.update(prompts_per_step=8, samples_per_prompt=4)   # 32 rows: 8 per chip
  score = plan.ProgramReport("score[L=128]", "score", "[32x128]", temp_bytes=20 * GiB)
  knobs = _report_with(score, c).knobs
  assert any("train.micro_batches=2" in k and "8 rows per chip" in k for k in knobs), knobs


def test_tensor_knob_only_when_it_shrinks_the_kv_cache_per_chip():
  kv = lambda: plan.ProgramReport("generate", "generate", "slots", temp_bytes=17 * GiB,
                                  components={"kv_cache": 12 * GiB})
  tensor_knobs = lambda c: [k for k in _report_with(kv(), c).knobs if "mesh.tensor" in k]
  c = tiny()
  c.rollout.slots = 8   # 8 slots split 4 ways over data=4 already: tensor=2 leaves 2 x 2
  assert tensor_knobs(c) == []
  c.rollout.slots = 6   # 4 does not divide 6 (the slots replicate), 2 does: 2 x 2 ways
  assert len(tensor_knobs(c)) == 1 and "4 ways instead of 1" in tensor_knobs(c)[0]
  c.rollout.mesh = "data"  # the rollout mesh has no tensor axis
  assert tensor_knobs(c) == []


def test_sft_micro_batch_knob_counts_the_sft_rows():
  # The warm start's batch (sft.batch_size) is not the RL batch: its rows per chip decide
  # whether more micro-batches help it.
  c = tiny()
  c.train.update(prompts_per_step=2, samples_per_prompt=2)   # 4 RL rows: 1 per chip
  c.sft.batch_size = 64                                      # 16 SFT rows per chip
  sft = lambda: plan.ProgramReport("sft[L=128]", "sft", "[64x128]", temp_bytes=20 * GiB)
  rep = _report_with(sft(), c)
  assert rep.fits is False
  assert any("train.micro_batches=2" in k and "16 rows per chip" in k for k in rep.knobs), \
      rep.knobs
  c.train.update(prompts_per_step=16, samples_per_prompt=2)  # 32 RL rows: 8 per chip
  c.sft.batch_size = 4                                       # 1 SFT row per chip
  assert not any("micro_batches" in k for k in _report_with(sft(), c).knobs)


@needs_libtpu
@pytest.mark.tpu_aot
def test_tiny_update_and_generate_compile_for_v5e_with_data_and_tensor_sharding():
  c = tiny(data=2, fsdp=1, tensor=2)
  c.model.tokenizer = ""
  report = plan.plan_run(c, "v5e:2x2", options=plan.PlanOptions(programs=("update", "generate")))
  assert report.platform == "tpu" and report.chip.name == "v5e" and report.n_devices == 4
  assert report.fits is True, report.render()
  up, gen = report.program("update"), report.program("generate")
  for p in (up, gen):
    assert p.error is None and 0 < p.total_bytes < 16 * GiB
    assert p.est_s is not None and p.est_s > 0
    assert p.unknown_loops == 0
  # Gradients of data-replicated params are all-reduced over `data`; the tensor-sharded heads
  # and MLP need reductions over `tensor` in the forward and backward passes.
  # (The TPU compiler writes most device groups as mesh axes, `mesh['axis_0'=2,'axis_1'=2]
  # {'axis_0'}`: read as every device, they all said data+tensor.)
  ar_axes = up.collectives["all-reduce"].axes
  assert "data" in ar_axes and "tensor" in ar_axes, up.collective_summary
  # The decode step splits the slots over data: its collectives are over tensor alone.
  gen_axes = {a for c in gen.collectives.values() for a in c.axes}
  assert gen_axes == {"tensor"}, gen.collective_summary
  # The decode loop's collectives run once per layer per step: the scans are weighed.
  ar = gen.collectives["all-reduce"]
  assert ar.executed >= ar.static * 2


@needs_libtpu
@pytest.mark.tpu_aot
def test_7b_without_fsdp_on_v5e_2x2_is_reported_not_raised():
  c = quickstart.get_config()
  c.model.update(path="qwen2.5-7b", tokenizer="")
  c.mesh.update(data=4, fsdp=1, tensor=1)
  # What the launcher does on a real v5e-4: stop with the report, naming the knob.
  with pytest.raises(plan.DoesNotFit, match="mesh.fsdp=4") as info:
    plan.check_fit(c, "on", devices=plan.devices_for("v5e:2x2"),
                   options=plan.PlanOptions(programs=("update",)))
  report = info.value.report
  assert report.fits is False and report.target == "local"
  up = report.programs[0]
  assert up.oom and up.total_bytes > 16 * GiB          # the compiler's refusal, with its sizes
  # ... counted once: the figure it names is the program's whole footprint, arguments included.
  required = float(re.search(r"HLO temporaries \(([\d.]+)G\)", up.error).group(1)) * GiB
  assert up.program_bytes == pytest.approx(required, rel=0.01)
  assert report.chip.source == "compiler" and report.chip.hbm_bytes < 16 * GiB
  assert "DOES NOT FIT" in str(info.value)


def test_kernel_resource_limit_is_a_compile_failure_not_device_memory():
  from jaxagent.plan import planner
  from jaxagent.plan.report import ProgramReport

  class Refusing:
    def __init__(self, msg):
      self.msg = msg

    def lower(self, *a, **k):
      raise RuntimeError(self.msg)

  chip = ChipSpec(name="test", hbm_bytes=16 * GiB, bf16_flops=1e14, f32_flops=1e13,
                  hbm_bandwidth=1e12)
  kernel = ProgramReport(name="append", kind="append", shapes="[1x1]")
  planner._compile(kernel, Refusing("RESOURCE_EXHAUSTED: Shared memory size limit exceeded: "
                                    "requested 311296, available: 232448"), (), {}, None, chip,
                   "bfloat16")
  assert not kernel.oom and kernel.fits is None and "Shared memory" in kernel.error
  hbm = ProgramReport(name="append", kind="append", shapes="[1x1]")
  planner._compile(hbm, Refusing("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm"),
                   (), {}, None, chip, "bfloat16")
  assert hbm.oom and hbm.fits is False


@needs_libtpu
@pytest.mark.tpu_aot
def test_compiler_refusal_counts_the_arguments_once():
  # The TPU compiler's refusal names the program's whole footprint (it calls it "HLO
  # temporaries"): a program that only reads one element of a 20 GiB argument needs 20 GiB,
  # not the argument plus that figure again.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jaxagent.plan import planner
  from jaxagent.plan.report import ProgramReport
  devices = plan.devices_for("v5e:2x2")
  chip = plan.chip_for(devices)
  sh = NamedSharding(Mesh(np.asarray(devices[:1]), ("x",)), P())
  big = jax.ShapeDtypeStruct((20 * GiB,), np.int8, sharding=sh)
  rep = ProgramReport(name="read", kind="update", shapes="[20 GiB]", capacity=chip.hbm_bytes)
  assert planner._compile(rep, jax.jit(lambda a: a[:8]), (big,), {}, None, chip,
                          "bfloat16") is None
  assert rep.oom and "20.00G" in rep.error and rep.fits is False
  assert rep.argument_bytes == 20 * GiB
  assert rep.total_bytes == pytest.approx(20 * GiB, rel=0.01), rep.total_bytes / GiB


def test_xla_has_no_time_estimate_is_none_not_negative():
  # The TPU compiler's cost analysis says optimal_seconds -0.99999 where it has no estimate
  # (a v5e decode loop does): the report (and its JSON) must not carry a negative time.
  from jaxagent.plan import planner
  from jaxagent.plan.report import ProgramReport
  compiled = jax.jit(lambda a: a @ a).lower(np.ones((8, 8), np.float32)).compile()

  class Answers:
    def __init__(self, optimal_s):
      self.optimal_s = optimal_s

    def lower(self, *a, **k):
      return self

    def compile(self):
      return self

    def memory_analysis(self):
      return None

    def cost_analysis(self):
      return {"flops": 1024.0, "optimal_seconds": self.optimal_s}

    def as_text(self):
      return compiled.as_text()

  chip = ChipSpec(name="test", hbm_bytes=16 * GiB, bf16_flops=1e14, f32_flops=1e13,
                  hbm_bandwidth=1e12)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("x",))
  for optimal_s, expected in ((-0.9999884963035583, None), (2e-6, 2e-6)):
    rep = ProgramReport(name="generate", kind="generate", shapes="[1]")
    planner._compile(rep, Answers(optimal_s), (), {}, mesh, chip, "float32")
    assert rep.xla_optimal_s == expected
    assert rep.flops == 2 * 8 * 8 * 8 and rep.est_s > 0
    json.loads(json.dumps(rep.to_dict()), parse_constant=lambda c: pytest.fail(c))



def test_printed_capacity_agrees_with_the_verdict():
  # The v5e compiler's budget is 15.75 GiB: a program of 15.77 GiB does not fit, and the
  # report must not print the capacity as 15.8 GiB beside it.
  from jaxagent.plan.report import PlanReport, ProgramReport
  chip = ChipSpec("v5e", 15.75 * GiB, 197e12, 197e12, 819e9, source="compiler")
  prog = ProgramReport("generate", "generate", "64 slots", argument_bytes=15.77 * GiB,
                       capacity=chip.hbm_bytes)
  rep = PlanReport(model="m", num_params=1, target="v5e:2x2", platform="tpu", chip=chip,
                   n_devices=4, mesh={"data": 4, "fsdp": 1, "tensor": 1},
                   shapes=plan.run_shapes(tiny(), {"data": 4, "fsdp": 1, "tensor": 1}),
                   programs=[prog], knobs=[])
  text = rep.render()
  assert rep.fits is False and "verdict: DOES NOT FIT; peak 15.77 GiB per chip of 15.75 GiB" \
      in text, text
  assert "4 x v5e, 15.75 GiB per chip [compiler]" in text, text


def test_no_verdict_when_no_program_the_run_uses_was_planned():
  # --programs=score without KL: the one program planned is not used by the run, so the plan
  # says nothing about whether the run fits (it said FITS, even with no device capacity).
  from jaxagent.plan.report import PlanReport, ProgramReport
  chip = ChipSpec("v5e", 15.75 * GiB, 197e12, 197e12, 819e9, source="compiler")
  score = ProgramReport("score[L=128]", "score", "[8x128]", used=False, argument_bytes=GiB,
                        capacity=chip.hbm_bytes)
  rep = PlanReport(model="m", num_params=1, target="v5e:2x2", platform="tpu", chip=chip,
                   n_devices=4, mesh={"data": 4, "fsdp": 1, "tensor": 1},
                   shapes=plan.run_shapes(tiny(), {"data": 4, "fsdp": 1, "tensor": 1}),
                   programs=[score], knobs=[])
  assert rep.fits is None
  assert "verdict: none (no program that this run uses was planned)" in rep.render()
  c = tiny(1, 1, 1)
  c.model.tokenizer = ""
  c.sft.steps = 0
  with pytest.raises(ValueError, match="names sft, but this config runs no SFT warm start"):
    plan.plan_run(c, jax.devices()[:1], options=plan.PlanOptions(programs=("sft",)))


def test_roofline_matches_a_hand_derivation_from_the_chip_table():
  # One 1024^3 float32 matmul on one v5e chip: 2 * 1024^3 flops at 197 TFLOP/s against three
  # 4 MiB matrices through 819 GB/s of HBM; then the same contraction split over 8 devices,
  # whose replicated result is one all-reduce of 4 MiB, moved twice over 200 GB/s of ICI.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jaxagent.plan import planner
  from jaxagent.plan.chips import CHIPS
  from jaxagent.plan.report import ProgramReport
  chip, n = CHIPS["TPU v5 lite"], 1024
  mm = jax.jit(lambda a, b: a @ b)
  one = Mesh(np.asarray(jax.devices()[:1]), ("x",))
  rep = ProgramReport("mm", "update", "[1024x1024]")
  planner._compile(rep, mm, (jax.ShapeDtypeStruct((n, n), np.float32),) * 2, {}, one, chip,
                   "float32")
  flops, hbm = 2 * n ** 3, 3 * n * n * 4
  assert (rep.flops, rep.bytes_accessed) == (flops, hbm)
  assert rep.bound == "hbm" and rep.est_s == pytest.approx(max(flops / 197e12, hbm / 819e9))
  eight = Mesh(np.asarray(jax.devices()[:8]), ("x",))
  split = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(eight, P()))
  args = (jax.ShapeDtypeStruct((n, n), np.float32, sharding=NamedSharding(eight, P(None, "x"))),
          jax.ShapeDtypeStruct((n, n), np.float32, sharding=NamedSharding(eight, P("x", None))))
  rep = ProgramReport("mm", "update", "[1024x1024]")
  planner._compile(rep, split, args, {}, eight, chip, "float32")
  assert rep.flops == flops / 8
  ar = rep.collectives["all-reduce"]
  assert (ar.executed, ar.bytes, ar.axes) == (1, n * n * 4, {"x": 1})
  assert rep.bound == "ici" and rep.est_s == pytest.approx(2 * n * n * 4 / 200e9)


def test_rollouts_on_several_hosts_run_on_process_0s_devices():
  # The trainer rolls out on process 0's local devices when the run spans several hosts: the
  # planner's generator programs must be planned there, not over every chip of the pod.
  from types import SimpleNamespace
  from jaxagent.plan import planner
  devs = [SimpleNamespace(process_index=i // 4, id=i) for i in range(16)]
  assert [d.id for d in planner._rollout_devices(devs, None)] == [0, 1, 2, 3]
  assert planner._rollout_devices(devs[:4], None) is None


@needs_libtpu
@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology, target", [
    ("v5e:4x4", "v5e:4x4"),
    pytest.param("v5litepod-16", "v5litepod-16 (= v5e:4x4)", marks=pytest.mark.slow)])
def test_multi_host_topology_plans_the_generator_on_one_hosts_chips(topology, target):
  from jaxagent.models import get_config
  c = tiny(1, -1, 1)
  c.model.tokenizer = ""
  c.rollout.slots = 16
  cfg = get_config("tiny-llama", n_layers=1)
  # v5e:4x4 is 16 chips on 4 hosts of 4: the learner shards over 16, the rollouts over 4.
  # A Cloud accelerator type plans the same slice and the report says which topology it read.
  rep = plan.plan_run(c, topology, cfg=cfg, options=plan.PlanOptions(programs=("generate",)))
  gen = rep.program("generate")
  assert rep.rollout_devices == 4 and gen.error is None, gen.error
  assert f"on {target} (16 x v5e" in rep.render() and rep.target == target
  assert "rollouts on process 0's 4 devices" in rep.render()
  kv = 2 * 16 * 128 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4   # k + v, float32
  assert gen.components["kv_cache"] == kv / 4                           # 16 slots over 4 chips
  weights = cfg.num_params() * 4
  assert gen.components["params"] == pytest.approx(weights / 4, rel=0.05)
  assert gen.components["learner_params"] == pytest.approx(weights / 16, rel=0.05)


@needs_libtpu
@pytest.mark.tpu_aot
def test_a_device_list_must_be_one_hosts_or_this_runtimes():
  # The devices of a topology spanning hosts failed as a compile error of generate ("Unexpected
  # device_id 5 in replica group"), and an empty list as a bare IndexError.
  c = tiny(1, -1, 1)
  with pytest.raises(ValueError, match=r"these 16 devices of a TPU topology span 4 hosts; pass "
                                       r"the topology's name"):
    plan.plan_run(c, plan.devices_for("v5e:4x4"))
  with pytest.raises(ValueError, match="the list of devices is empty"):
    plan.plan_run(c, [])


def test_weight_knobs_for_a_generator_off_the_learner_mesh():
  # rollout.mesh=data decodes from a whole copy of the weights on every chip: mesh.fsdp does
  # not shrink it, so the knob must not say it does.
  c = tiny()
  c.rollout.mesh = "data"
  gen = plan.ProgramReport("generate", "generate", "64 slots", argument_bytes=15 * GiB,
                           temp_bytes=2 * GiB,
                           components={"params": 14 * GiB, "learner_params": 3.5 * GiB})
  knobs = _report_with(gen, c).knobs
  assert knobs[0].startswith("the generator's copy of the weights takes 14.0 GiB per chip (on "
                             "every chip, whole; mesh.fsdp does not split it); rollout.mesh="
                             "learner"), knobs
  assert not any("params take 14.0 GiB" in k for k in knobs), knobs


def test_a_lora_run_is_planned_with_the_adapter_as_train_state_and_the_base_resident():
  """With `lora.rank > 0` the update's state (params and optimizer) is the adapter's, the base
  is one more argument of the learner programs, and the generator decodes from a merged copy
  with the base and the adapter resident (as `Trainer` runs it)."""
  from jaxagent.models import get_config
  cfg = get_config("tiny-llama", n_layers=2)
  opts = plan.PlanOptions(programs=("update", "score", "generate"))
  reports = {}
  for rank in (0, 2):
    c = tiny(1, 4, 1)
    c.lora.rank = rank
    c.loss.kl_coef = 0.01
    rep = plan.plan_run(c, jax.devices()[:4], cfg=cfg, options=opts)
    reports[rank] = {p.kind: p for p in rep.programs}
  full, lo = reports[0], reports[2]
  for kind in ("update", "score", "generate"):
    assert not lo[kind].error, lo[kind].error
  # The adapter's params, optimizer state and reference are a small fraction of the model's.
  assert lo["update"].components["params"] < 0.2 * full["update"].components["params"]
  assert lo["update"].components["optimizer"] < 0.2 * full["update"].components["optimizer"]
  assert lo["update"].components["ref_params"] < 0.2 * full["update"].components["ref_params"]
  assert lo["update"].components["base_params"] == full["update"].components["params"]
  assert "base_params" not in full["update"].components
  # Decode reads a merged copy as large as the model; the base stays resident beside it.
  assert lo["generate"].components["params"] == full["generate"].components["params"]
  assert lo["generate"].components["learner_params"] == pytest.approx(
      full["generate"].components["params"] + lo["update"].components["params"])


def test_a_tis_run_plans_the_samplers_log_probs_and_the_score_program():
  """loss.tis_cap: the update's batch carries behavior_logps (the step refuses one without), and
  the trainer scores every batch for the learner's own old log-probs (`runs_score`)."""
  from jaxagent.models import get_config
  c = tiny()
  assert not plan.runs_score(c)
  c.loss.tis_cap = 2.0
  assert plan.runs_score(c)
  report = plan.plan_run(c, jax.devices()[:4], cfg=get_config("tiny-llama", n_layers=1),
                         options=plan.PlanOptions(programs=("update",)))
  up = report.program("update")
  assert up.error is None, up.error
  # Seven [rows, 128] arrays of 4 bytes (tokens, segment ids, positions, loss mask, old and
  # behaviour log-probs, advantages), rows split over the data-parallel devices.
  dp = report.mesh["data"] * report.mesh["fsdp"]
  assert up.components["batch"] == 7 * report.shapes.update_rows * 128 * 4 / dp


def _planned(monkeypatch, config, devices, programs):
  """`plan_run` with each program's abstract arguments recorded instead of compiled (fast):
  (report, program name -> the devices its arguments lie on)."""
  from jaxagent.models import get_config
  from jaxagent.plan import planner
  on = {}
  monkeypatch.setattr(planner, "_compile", lambda rep, fn, args, *_: on.update(
      {rep.name: set().union(*(x.sharding.device_set for x in jax.tree.leaves(args)))}))
  report = plan.plan_run(config, devices, cfg=get_config("tiny-llama", n_layers=1),
                         options=plan.PlanOptions(programs=programs))
  return report, on


def test_rollout_devices_decode_apart_from_the_learners_state(monkeypatch):
  """rollout.devices=2 of 8: the learner's programs run over the first 6 devices, the
  generator's over the last 2, which hold the generator's weights (split over them, or whole
  on each with rollout.mesh=data), their copy for the next step (train.off_policy_steps=1: it
  arrives while the rollout in flight decodes, nobody waits there) and the cache; not the
  masters, the optimizer state or the reference, which stay with the learner, who holds no
  generator copy (`Trainer._generator_params` puts it on the rollout devices)."""
  devices = jax.devices()[:8]
  c = tiny(3, 2, 1)
  c.rollout.devices = 2
  c.loss.kl_coef = 0.01
  reports = {}
  for k in (0, 1):
    c.train.off_policy_steps = k
    reports[k] = _planned(monkeypatch, c, devices,
                          ("update", "score", "prefill", "generate", "append"))
  report, on = reports[1]
  assert (report.n_devices, report.rollout_devices, report.decode_only) == (6, 2, True)
  assert report.mesh == {"data": 3, "fsdp": 2, "tensor": 1}
  for p in report.programs:
    learner = p.kind in ("update", "score")
    assert p.n_devices == (6 if learner else 2), p.name
    assert on[p.name] == set(devices[:6] if learner else devices[6:]), p.name
  up, gen = report.program("update"), report.program("generate")
  assert "generator_params" not in up.components
  assert up.resident_bytes == up.components["ref_params"] > 0
  from jaxagent.models import get_config
  full = get_config("tiny-llama", n_layers=1).num_params() * 4  # float32, whole
  for k, (rep, _) in reports.items():
    for name in ("prefill", "generate", "append"):
      p = rep.program(name)
      assert not {"optimizer", "ref_params", "learner_params", "decode_weights"} & set(
          p.components), (name, p.components)
      assert p.components["params"] == pytest.approx(full / 2, rel=0.05)  # split over 2
      # k + 1 copies: the rollout's and (k=1) the next step's, handed while it decodes.
      assert p.components.get("params_ahead", 0) == k * p.components["params"]
    gen_k = rep.program("generate")
    assert gen_k.resident_bytes == gen_k.components.get("params_ahead", 0)
    pre = rep.program("prefill")
    assert pre.resident_bytes == pre.components.get("params_ahead", 0) + \
        pre.components["kv_cache"]
  assert report.generator_copies == 2 and reports[0][0].generator_copies == 1
  text = report.render()
  assert "on local (6 x cpu for the learner" in text
  assert ("rollout devices: 2 more (decode only, rollout.devices): prefill, insert, generate "
          "and append run there") in text
  assert "generator weights: 2 copies resident at once" in text
  assert "process 0" not in text
  c.rollout.mesh = "data"  # each rollout device decodes from a whole copy
  gen = _planned(monkeypatch, c, devices, ("generate",))[0].program("generate")
  assert gen.components["params"] == full and gen.components["params_ahead"] == full


def test_off_policy_steps_keep_the_generators_own_weight_copies(monkeypatch):
  """train.off_policy_steps = k on shared devices, param dtype = compute dtype: with k = 0 the
  generator decodes from the masters themselves; with k > 0 from a copy of its own (the update
  donates the state), the masters resident beside it, and with k = 2 the copy of the step
  queued behind too; the learner's programs run with the k copies of the rollouts in flight
  (the update waits until the rollout ahead has stopped decoding, not until it is collected)."""
  c = tiny(1, 4, 1)
  reps = {}
  for k in (0, 1, 2):
    c.train.off_policy_steps = k
    reps[k] = _planned(monkeypatch, c, jax.devices()[:4], ("update", "score", "generate",
                                                           "append"))[0]
  gen = {k: r.program("generate") for k, r in reps.items()}
  up = {k: r.program("update") for k, r in reps.items()}
  copy = gen[0].components["params"]
  assert "learner_params" not in gen[0].components and reps[0].generator_copies == 0
  assert gen[1].components["learner_params"] == copy == gen[1].components["params"]
  assert gen[1].resident_bytes == gen[0].resident_bytes + copy      # one copy more
  assert gen[2].components["params_ahead"] == copy
  assert gen[2].resident_bytes == gen[0].resident_bytes + 2 * copy  # and the queued step's
  for k in (0, 1, 2):
    app = reps[k].program("append")
    assert app.resident_bytes == gen[k].resident_bytes, k
    assert up[k].components.get("generator_params", 0) == k * copy
    assert up[k].resident_bytes == up[0].resident_bytes + k * copy
    score = reps[k].program("score")
    assert score.resident_bytes == reps[0].program("score").resident_bytes + k * copy
  assert [r.generator_copies for r in reps.values()] == [0, 1, 2]
  assert "generator weights: 2 copies" in reps[2].render()
  assert "generator weights" not in reps[1].render()
  c.train.off_policy_steps = -1  # refused, as the trainer refuses it
  with pytest.raises(ValueError, match=r"train.off_policy_steps must be an int >= 0 .*got -1"):
    plan.plan_run(c, jax.devices()[:4])


def test_a_topology_plan_refuses_rollout_devices():
  c = tiny()
  c.rollout.devices = 2
  with pytest.raises(ValueError, match=r"^rollout\.devices=2: plans for a TPU topology compile "
                     r"for the whole topology only; plan a split of this machine's devices "
                     r"with --topology=local, or plan rollout\.devices=0$"):
    plan.plan_run(c, "v5e:2x2")


def test_off_policy_knob_names_the_generator_copies_in_flight():
  c = tiny()
  c.train.off_policy_steps = 2
  # Two copies of 3 GiB resident through the update, beside its 12 GiB (16 GiB chips).
  up = plan.ProgramReport("update[L=128]", "update", "[8x128]", temp_bytes=12 * GiB,
                          resident_bytes=6 * GiB,
                          components={"params": 1 * GiB, "optimizer": 2 * GiB,
                                      "generator_params": 6 * GiB})
  knobs = _report_with(up, c).knobs
  assert ("train.off_policy_steps (now 2): each RL step's rollouts collected ahead keep a copy "
          "of the generator's weights resident (3.0 GiB per chip) until they are collected; "
          "fewer steps ahead keep fewer") in knobs, knobs
  c.train.off_policy_steps = 0
  assert not any("off_policy" in k for k in _report_with(up, c).knobs)


def test_knobs_for_decode_only_devices_name_the_generators_weights_not_the_learners():
  # On devices that only decode the learner's state is absent: no mesh.fsdp or param_dtype
  # knob for it; the copy of the generator's weights is named where it lies.
  from jaxagent.models import get_config
  c = tiny()
  c.rollout.update(devices=2, mesh="data")
  gen = plan.ProgramReport("generate", "generate", "64 slots", argument_bytes=15 * GiB,
                           temp_bytes=2 * GiB, components={"params": 14 * GiB, "kv_cache": 1 * GiB})
  rep = _report_with(gen, c)
  rep.rollout_devices, rep.decode_only = 2, True
  knobs = plan.knobs(rep, c, get_config("qwen2.5-7b"))
  assert knobs[0] == ("the generator's copy of the weights takes 14.0 GiB per chip (on the 2 "
                      "rollout devices, whole on each; mesh.fsdp does not split it); "
                      "rollout.mesh=learner splits it over the rollout devices"), knobs
  assert not any("mesh.fsdp=" in k or "param_dtype" in k for k in knobs), knobs
  rep.decode_only = False  # several hosts: process 0's chips, which the learner shares
  assert plan.knobs(rep, c, get_config("qwen2.5-7b"))[0].startswith(
      "the generator's copy of the weights takes 14.0 GiB per chip (on process 0's 2 chips, "
      "whole on each; mesh.fsdp does not split it); rollout.mesh=learner splits it over them")
