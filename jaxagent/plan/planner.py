"""Compile every program of a run for a device set and report whether the run fits.

Place in the data flow: a run config (`configs/*.py`) -> `plan_run(config, topology)` ->
`PlanReport`. The same function serves `python -m jaxagent.plan` (any TPU topology, compiled on a
CPU through libtpu) and the fit check that `python -m jaxagent.launch` runs on the real devices
before the first step.

Programs, each lowered from abstract inputs only (`jax.ShapeDtypeStruct`s carrying the run's
shardings; params come from `jax.eval_shape(init_params)`, so no weight is ever materialised):

  * `update[L=...]`: `rl.step.train_step` on `[rows / train.mini_batches, L]` (one
    mini-batch) per length bucket, with the configured micro-batches (through `Learner.train_step_fn`, the trainer's own jit).
  * `sft[L=...]`: the warm start's update at the longest bucket (when `sft.steps > 0`).
  * `score[L=...]`: `sequence_logprobs`, used when the trainer runs it (`runs_score`: reference
    log-probs with `loss.kl_coef > 0`, old log-probs of observation tokens with an env that
    trains on them, the learner's own old log-probs with `loss.tis_cap`); else reported but not
    part of the verdict.
  * `prefill`, `insert`, `generate`, `append`: the generator's programs (`Engine.program`), at
    the configured slots and cache length, on the rollout mesh (on several hosts, process 0's
    devices alone, where the trainer rolls out; with `rollout.devices = n`, the last n
    devices, which only decode, the learner's programs running on the others).

Shapes are worst cases: every trajectory in its own row (`rows = prompts x samples`, rounded as
the trainer's packing rounds them), prompts as long as the cache allows, all slots prefilled or
appended at once, attention over the whole cache. `PlanOptions` narrows them.

Memory per chip = XLA's arguments + outputs - donated aliases + temporaries + code, plus the
buffers the run keeps alive meanwhile (`resident`): the optimizer state while the generator
decodes (colocated mode shares the params, not the moments; float32 masters with a lower
compute dtype decode from a compute-dtype copy, the masters resident beside it; where the
engine decodes with merged weights, their copy for the rollout beside the params), the frozen
reference params when KL is on, the RL state during the SFT warm start; with rollouts collected
ahead (`train.off_policy_steps = k`) the generator's copies of the weights for the steps in flight,
beside the decode and the learner's programs alike (devices of their own for the rollouts hold
those copies and the cache only, the learner's devices none). Time per program is a roofline
estimate,
max(flops / peak, HBM bytes / bandwidth, collective bytes / interconnect bandwidth), from
loop-aware HLO counts (`jaxagent.plan.hlo`; XLA's own `cost_analysis()` counts each `lax.scan`
body once and is reported alongside). Peaks and bandwidths are in `jaxagent.plan.chips`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import pathlib
import re
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxagent import sharding as shd
from jaxagent.generate.engine import Engine, EngineConfig, pow2_at_least
from jaxagent.generate.sampling import SamplingConfig
from jaxagent.models import config as model_config_lib
from jaxagent.models import lora as lora_lib, param_tree
from jaxagent.models.config import ModelConfig
from jaxagent.plan import hlo
from jaxagent.plan.chips import ChipSpec, chip_for, devices_for, resolve_topology
from jaxagent.plan.report import PlanReport, ProgramReport, RunShapes, knobs
from jaxagent.rl import packing
from jaxagent.rl import step as step_lib

log = logging.getLogger(__name__)

UPDATE_KINDS = ("update", "sft", "score")
DECODE_KINDS = ("prefill", "insert", "generate", "append")


class DoesNotFit(RuntimeError):
  """Raised by `check_fit` when a program of the run does not fit; the message is the report."""

  def __init__(self, report: "PlanReport"):
    super().__init__(report.render())
    self.report = report


@dataclasses.dataclass(frozen=True)
class PlanOptions:
  """Narrow the worst-case shapes the planner assumes.

  Attributes:
    rows: the step's batch rows (default: one trajectory per row, prompts x samples, rounded
      up to mini_batches x micro_batches x data-parallel size as packing does); each update
      program sees rows / mini_batches of them.
    prompt_len: the longest prompt prefilled (default: the config's
      `rollout.max_prompt_tokens`, else the cache length minus one).
    append_len: tokens appended into a slot at once (pending token + observation; the engine
      rounds it up to a power of two, at least 8).
    programs: compile only these kinds (default: all that the run uses, plus `score` when it
      does not, reported apart from the verdict).
  """

  rows: int | None = None
  prompt_len: int | None = None
  append_len: int = 256
  programs: tuple[str, ...] = ()

  def __post_init__(self):
    for f in ("rows", "prompt_len"):
      v = getattr(self, f)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"PlanOptions.{f} must be None or a positive int, got {v!r}")
    if not isinstance(self.append_len, int) or self.append_len < 1:
      raise ValueError(f"PlanOptions.append_len must be a positive int, got {self.append_len!r}")
    bad = [p for p in self.programs if p not in UPDATE_KINDS + DECODE_KINDS]
    if bad:
      raise ValueError(f"PlanOptions.programs: unknown {bad}; choose from "
                       f"{UPDATE_KINDS + DECODE_KINDS}")


# ----------------------------------------------------------------------------- config
def model_config(config) -> ModelConfig:
  """The `ModelConfig` a run would build from `config.model`, without loading any weights.

  Presets give their architecture (vocabulary resized to `model.tokenizer` when one is named,
  as the trainer does); HF directories their `config.json`; `.gguf` files their metadata.
  """
  m = config.get("model") if hasattr(config, "get") else None
  if not hasattr(m, "get") or not m.get("path"):
    raise ValueError(
        "the config names no model: set model.path to a preset "
        f"({', '.join(sorted(model_config_lib.PRESETS))}), an HF model directory or a .gguf "
        "file (e.g. --config.model.path=smollm2-135m-instruct)")
  kw = model_config_lib.run_overrides(m)
  path = str(m.path)
  if path in model_config_lib.EMBEDDED or path in model_config_lib.PRESETS:
    cfg = model_config_lib.get_config(path, **kw)
    tok_name = m.get("tokenizer") or ""
    if path in model_config_lib.PRESETS and tok_name:
      from jaxagent.models import load_tokenizer
      tok = load_tokenizer(tok_name)
      cfg = cfg.replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    return cfg
  p = pathlib.Path(path).expanduser()
  if p.is_dir():
    cfg_file = p / "config.json"
    if not cfg_file.exists():
      from jaxagent.models.hf import no_config_json
      raise no_config_json(p)
    try:
      hf_cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
      raise ValueError(f"{cfg_file} is not valid JSON ({e}): fix or replace the model's "
                       "config.json") from None
    if not isinstance(hf_cfg, dict):  # (a list failed with "'list' object has no attribute")
      raise ValueError(f"{cfg_file}: expected a JSON object (the model's settings), got "
                       f"{type(hf_cfg).__name__}: fix or replace the model's config.json")
    return ModelConfig.from_hf(hf_cfg, **kw)
  if p.is_file() and p.suffix == ".gguf":
    from jaxagent.models import gguf as gguf_lib
    reader = gguf_lib.open_gguf(p)
    meta = gguf_lib.read_gguf_metadata(reader)
    hf_cfg = gguf_lib._hf_config(p, meta, {t.name: t for t in reader.tensors})
    return ModelConfig.from_hf(hf_cfg, **kw)
  raise FileNotFoundError(f"model.path {path!r} is neither a preset "
                          f"({sorted(model_config_lib.PRESETS)}), an HF directory nor a .gguf file")


# The learner settings of a run, as the trainer builds them (one definition for both).
learner_parts = step_lib.learner_parts


def runs_score(config) -> bool:
  """Whether the trainer's RL steps run the learner's `score` program (`sequence_logprobs`).

  It runs for the KL term's reference log-probs (`loss.kl_coef > 0`, `Trainer.rl_step`) and for
  the old log-probs of trained tokens the sampler never sampled: the observation tokens of an
  env with `train_on_observations` (`Trainer.fill_unsampled_old_logps`, on every step whose
  batch holds one), and for the learner's own (proximal) old log-probs of every batch when the
  loss weights by the sampler's (`loss.tis_cap`, `rl/losses.py`). The env is built as the
  trainer builds it (`make_env(env.name, **env.kwargs)`) to read that attribute.
  """
  e = config.get("env") if hasattr(config, "get") else None
  on_observations = False
  if hasattr(e, "get") and e.get("name"):
    from jaxagent.envs import make_env
    try:  # also with KL on: a misspelt env setting is refused here as the trainer refuses it
      env = make_env(e.name, **dict(e.get("kwargs") or {}))
      on_observations = bool(getattr(env, "train_on_observations", False))
    except (ImportError, OSError) as err:  # a package or data file only the run's host has
      log.warning("could not build env %r to ask whether it trains on observation tokens "
                  "(%s: %s); planned as if it does not", e.name, type(err).__name__, err)
  return config.loss.kl_coef > 0 or on_observations or config.loss.get("tis_cap") is not None


def _bucket(n: int, buckets: Sequence[int]) -> int:
  for b in buckets:
    if n <= b:
      return b
  return buckets[-1]


def run_shapes(config, mesh_sizes: dict[str, int], options: PlanOptions = PlanOptions()
               ) -> RunShapes:
  """The worst-case shapes of a run's programs on a mesh of `mesh_sizes`."""
  t, r = config.train, config.rollout
  dp = mesh_sizes["data"] * mesh_sizes["fsdp"]
  pack_cfg = packing.config_from_train(t, dp)  # as the trainer packs
  minis = t.get("mini_batches", 1)
  rows = pack_cfg.round_rows(options.rows or t.prompts_per_step * t.samples_per_prompt)
  # The warm start makes one update per batch: rounded to micro-batches x devices only.
  sft_pack = dataclasses.replace(pack_cfg, row_multiple=pack_cfg.row_multiple // minis)
  sft_rows = sft_pack.round_rows(config.sft.batch_size) if config.sft.steps else 0
  ecfg = EngineConfig(slots=r.slots, max_len=r.max_len)
  prompt_len = min(options.prompt_len or r.get("max_prompt_tokens") or r.max_len - 1,
                   r.max_len - 1)
  return RunShapes(
      rows=rows, len_buckets=pack_cfg.len_buckets, micro_batches=t.micro_batches,
      mini_batches=minis,
      sft_rows=sft_rows, kl=config.loss.kl_coef > 0, slots=r.slots, max_len=r.max_len,
      prefill_batch=pow2_at_least(r.slots),
      prefill_len=_bucket(prompt_len, ecfg.prefill_buckets),
      append_batch=pow2_at_least(r.slots),
      append_len=max(8, pow2_at_least(min(options.append_len, r.max_len))),
      decode_steps=r.decode_steps, kv_len=ecfg.kv_buckets[-1])


# ----------------------------------------------------------------------------- compile
def _sds(tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                      shardings)


def _per_chip_bytes(tree) -> float:
  total = 0.0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
  return total


_OOM_RE = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|exceeds the memory|Ran out of memory")
_KERNEL_LIMIT_RE = re.compile(r"[Ss]hared memory size limit|registers? (limit|exceeded)")
_TEMP_RE = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")


def _compile(report: ProgramReport, fn, args, kwargs, mesh: Mesh, chip: ChipSpec, dtype: str):
  """Lower + compile `fn(*args, **kwargs)`, filling `report`; the compiled program or None."""
  t0 = time.perf_counter()
  try:
    compiled = fn.lower(*args, **kwargs).compile()
  except Exception as e:  # a compiler refusal is a finding of the plan, not a crash
    msg = " ".join(str(e).split())
    # A kernel over its shared-memory (or register) budget is a compile failure of that
    # kernel, not device memory: no config knob frees it.
    report.oom = bool(_OOM_RE.search(msg)) and not _KERNEL_LIMIT_RE.search(msg)
    report.error = msg[:600]
    report.compile_s = time.perf_counter() - t0
    # What is known without the compiled program: the arguments, and the memory the TPU
    # compiler says the program needs when it refuses. Despite its wording ("HLO temporaries")
    # that figure is the program's whole footprint, arguments and outputs included (a program
    # that only reads a 20 GiB argument is refused with "HLO temporaries (20.00G)"), so the
    # temporaries are what it names beyond the arguments.
    report.argument_bytes = _per_chip_bytes(args)
    m = _TEMP_RE.search(msg)
    if m:
      required = float(m.group(1)) * 1024 ** " KMGT".index(m.group(2))
      report.temp_bytes = max(0.0, required - report.argument_bytes)
    return None
  report.compile_s = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  if ma is not None:
    report.argument_bytes = float(ma.argument_size_in_bytes)
    report.output_bytes = float(ma.output_size_in_bytes)
    report.alias_bytes = float(ma.alias_size_in_bytes)
    report.temp_bytes = float(ma.temp_size_in_bytes)
    report.code_bytes = float(ma.generated_code_size_in_bytes)
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  ca = ca or {}
  report.xla_flops = ca.get("flops")
  report.xla_bytes = ca.get("bytes accessed")
  # The TPU compiler answers -1 (about) where it has no estimate: that is no time at all.
  opt_s = ca.get("optimal_seconds")
  report.xla_optimal_s = float(opt_s) if opt_s is not None and opt_s >= 0 else None
  stats = hlo.analyze(compiled.as_text(), tuple(mesh.devices.shape), tuple(mesh.axis_names))
  report.flops, report.bytes_accessed = stats.flops, stats.bytes_accessed
  report.collectives = {k: v for k, v in stats.collectives.items() if v.static}
  report.collective_summary = stats.summary()
  report.unknown_loops = stats.unknown_loops
  peak, bw = chip.peak_flops(dtype), chip.hbm_bandwidth
  if peak and bw:
    # All-reduce moves its payload twice (reduce-scatter + all-gather); the rest about once.
    wire = sum(c.bytes * (2 if k == "all-reduce" else 1) for k, c in stats.collectives.items())
    terms = {"compute": stats.flops / peak, "hbm": stats.bytes_accessed / bw,
             "ici": wire / chip.ici_bandwidth if chip.ici_bandwidth else 0.0}
    report.bound = max(terms, key=terms.get)
    report.est_s = terms[report.bound]
  return compiled


def _rollout_devices(devices: Sequence[jax.Device], topology: str | None
                     ) -> list[jax.Device] | None:
  """The devices the rollouts run on when `devices` span several hosts (process 0's, as the
  trainer runs them); None on one host (the rollout mesh is then over all of them).

  A compile-only TPU client compiles only for whole topologies (one host's devices of a larger
  one are refused), so for a `topology` those are described as a topology of their own: the
  same chips in the same layout."""
  lead = min(d.process_index for d in devices)
  local = [d for d in devices if d.process_index == lead]
  if len(local) == len(devices):
    return None
  if topology and ":" in topology and all(hasattr(d, "coords") for d in local):
    name, shape = topology.split(":", 1)
    coords = np.asarray([d.coords for d in local])
    extent = coords.max(0) - coords.min(0) + 1
    dims = len(shape.split("x"))
    if (extent[dims:] == 1).all():
      try:
        host = devices_for(f"{name}:{'x'.join(str(int(e)) for e in extent[:dims])}")
      except ValueError:
        host = []
      if len(host) == len(local):
        return host
  return local


def _mesh_for(config, devices) -> Mesh:
  m = config.mesh
  return shd.make_mesh(m.data, m.fsdp, m.tensor, devices=devices)


def plan_run(config, devices_or_topology: str | Sequence[jax.Device] | None = None, *,
             options: PlanOptions = PlanOptions(), cfg: ModelConfig | None = None,
             executables: dict | None = None) -> PlanReport:
  """Compile every program of the run `config` for a device set and report per chip.

  Args:
    config: a run config (`configs/*.py` `get_config()`).
    devices_or_topology: a TPU topology name ("v5p:4x4x4", or a Cloud TPU accelerator type
      such as "v5p-128"; compiled here through libtpu),
      "local"/None for this machine's devices, or a list of devices.
    options: narrower shapes than the worst case.
    cfg: the model config, when the caller already has it (else from `config.model`).
    executables: when given (local devices), filled with `name -> (compiled, args)` for every
      program that compiled, `args` being the abstract dynamic arguments (static ones are
      part of the compiled program); `benchmarks/plan_vs_measured.py` times them.
  """
  # rollout.devices = n > 0: the learner's programs on all but the last n devices, the
  # rollout's on those n (`sharding.split_rollout_devices`, as the trainer splits them).
  n_rollout = config.rollout.get("devices", 0) if "rollout" in config else 0
  # train.off_policy_steps = k: rollouts collected k steps ahead of the learner (as the
  # trainer reads it), each hand-off from a copy of the weights of its own.
  ahead_k = (config.train.get("off_policy_steps", 0) or 0) if "train" in config else 0
  if isinstance(ahead_k, bool) or not isinstance(ahead_k, (int, np.integer)) or ahead_k < 0:
    raise ValueError("train.off_policy_steps must be an int >= 0 (0: each step's rollouts "
                     f"from the current params), got {ahead_k!r}")
  topology = None
  if isinstance(devices_or_topology, str) or devices_or_topology is None:
    target = devices_or_topology or "local"
    if target != "local":
      if n_rollout:  # (before the compile-only client starts)
        raise ValueError(f"rollout.devices={n_rollout}: plans for a TPU topology compile for "
                         "the whole topology only; plan a split of this machine's devices "
                         "with --topology=local, or plan rollout.devices=0")
      topology = resolve_topology(target)  # a Cloud accelerator type: the topology it names
      target = target if topology == target else f"{target} (= {topology})"
    devices = devices_for(topology)
  else:
    devices = list(devices_or_topology)
    target = "local"
    if not devices:
      raise ValueError("plan_run: the list of devices is empty; pass devices, a TPU topology "
                       "name such as 'v5e:4x4', or 'local'")
    hosts = {d.process_index for d in devices}
    if len(hosts) > 1 and not set(devices) <= set(jax.devices()):
      # Compile-only devices of a topology (`devices_for`): the rollout's programs compile for
      # one host's devices, which a compile-only client takes only as a topology of their own,
      # and that needs the topology's name (the list failed as a compile error of generate).
      raise ValueError(f"plan_run: these {len(devices)} devices of a TPU topology span "
                       f"{len(hosts)} hosts; pass the topology's name (such as 'v5e:4x4') "
                       "instead of its devices")
  cfg = cfg if cfg is not None else model_config(config)
  chip = chip_for(devices)
  devices, rollout_devices = shd.split_rollout_devices(n_rollout, devices)
  if rollout_devices is None:
    rollout_devices = _rollout_devices(devices, topology)
  mesh = _mesh_for(config, devices)
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  shapes = run_shapes(config, sizes, options)
  want = set(options.programs or UPDATE_KINDS + DECODE_KINDS)
  if "sft" in options.programs and not shapes.sft_rows:
    raise ValueError("PlanOptions.programs (--programs) names sft, but this config runs no SFT "
                     "warm start (sft.steps=0): there is no sft program to plan")
  (scfg, rl_opt), (sft_scfg, sft_opt) = learner_parts(config)
  scores = runs_score(config)  # builds the env, which also checks its settings

  # Abstract params and train state with the trainer's shardings.
  abstract_params = jax.eval_shape(lambda k: param_tree.init_params(cfg, k), jax.random.key(0))
  # With a LoRA adapter (config `lora`) the train state, the reference and the checkpoints hold
  # the adapter; the frozen base is an argument of every learner program, resident throughout.
  lcfg = lora_lib.from_config(config.get("lora"))
  base, base_b, trainable = (), 0.0, abstract_params
  if lcfg is not None:
    base = (_sds(abstract_params, shd.shardings(abstract_params, mesh)),)
    base_b = _per_chip_bytes(base)
    trainable = jax.eval_shape(lambda k: lora_lib.init_lora(cfg, lcfg, k), jax.random.key(0))
  lkw = dict(lora=lcfg, base=base[0]) if base else {}
  learner = step_lib.Learner(cfg, scfg, rl_opt, mesh, **lkw)

  def abstract_state(opt):
    make = lambda p: step_lib.TrainState(step=jnp.zeros((), jnp.int32), params=p,
                                         opt_state=opt.init(p))
    st = jax.eval_shape(make, trainable)
    return _sds(st, learner.state_shardings(st))

  state = abstract_state(rl_opt)
  params = state.params
  params_b = _per_chip_bytes(params)
  opt_b = _per_chip_bytes(state.opt_state) + _per_chip_bytes(state.step)
  ref_b = params_b if shapes.kl else 0.0
  base_c = {"base_params": base_b} if base else {}
  bsh = learner.batch_sharding()

  # The generator's weights (`Trainer._generator_params`), on the rollout mesh
  # (`rollout.mesh`: the learner's, or every rollout device on the data axis with the weights
  # replicated; on several hosts process 0's devices, on rollout devices of their own those).
  # On the learner's mesh it decodes from the masters themselves when the param and compute
  # dtypes agree and no rollout is collected ahead; otherwise from a copy: in the compute
  # dtype, with the base and adapter merged (LoRA), and with `train.off_policy_steps` > 0 one
  # of its own even where nothing needs casting (the update donates the state). Copies made
  # on the learner's devices stay resident beside the masters.
  r = config.rollout
  split = bool(n_rollout)
  dmesh = shd.rollout_mesh(r.get("mesh", "learner"), mesh, rollout_devices)
  dparams, masters_b = params, 0.0
  if base or dmesh is not mesh or cfg.jnp_param_dtype != cfg.jnp_dtype or ahead_k:
    copy = jax.eval_shape(functools.partial(param_tree.compute_copy, cfg=cfg), abstract_params)
    copy_sh = (shd.shardings(copy, dmesh) if dmesh is not mesh
               else jax.tree.map(lambda p: p.sharding, base[0] if base else params))
    dparams, masters_b = _sds(copy, copy_sh), 0.0 if split else params_b + base_b
  copy_b = _per_chip_bytes(dparams)
  # Copies alive at once (`Trainer._rollouts`: one per RL step's hand-off, shared by the steps
  # handed together, freed when their rollouts are collected). On rollout devices of their own
  # the next step's copy arrives while the rollout in flight still decodes: k + 1. On shared
  # devices the update, and with it the next hand-off, waits until that rollout has stopped
  # decoding (`_wait_for_decoding_ahead`): k, the one decoding and those of the steps queued
  # behind it, and the same k through the learner's programs (the rollouts in flight keep
  # theirs until they are collected).
  copies = ahead_k + 1 if split else max(ahead_k, 1)
  ahead_b = (copies - 1) * copy_b           # beside the one a generator program reads
  gen_c = {} if split or not ahead_k else {"generator_params": ahead_k * copy_b}
  gen_b = sum(gen_c.values())               # resident through the learner's programs

  def batch(rows, length, keys):
    dt = {"tokens": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32}
    return {k: jax.ShapeDtypeStruct((rows, length), dt.get(k, jnp.float32), sharding=bsh)
            for k in keys}

  rl_keys = ("tokens", "segment_ids", "positions", "loss_mask", "old_logps", "advantages") + \
      (("ref_logps",) if shapes.kl else ()) + \
      (("behavior_logps",) if scfg.loss.tis_cap is not None else ())
  programs: list[ProgramReport] = []

  def add(rep: ProgramReport, fn, *args, on: Mesh | None = None, **kwargs):
    rep.capacity = chip.hbm_bytes
    rep.n_devices = (on or mesh).devices.size
    programs.append(rep)
    compiled = _compile(rep, fn, args, kwargs, on or mesh, chip, cfg.dtype)
    if executables is not None and compiled is not None:
      executables[rep.name] = (compiled, args)
    return compiled

  m = shapes.micro_batches
  if "update" in want:
    train = learner.train_step_fn(state)
    for length in shapes.len_buckets:
      b = batch(shapes.update_rows, length, rl_keys)
      rep = ProgramReport(f"update[L={length}]", "update",
                          f"[{shapes.update_rows}x{length}] m={m}",
                          resident_bytes=ref_b + gen_b,
                          components={"params": params_b, "optimizer": opt_b,
                                      "batch": _per_chip_bytes(b), "ref_params": ref_b,
                                      **base_c, **gen_c})
      add(rep, train, state, b, *base)
  if "sft" in want and shapes.sft_rows:
    sft_learner = step_lib.Learner(cfg, sft_scfg, sft_opt, mesh, **lkw)
    sft_state = abstract_state(sft_opt)
    length = shapes.len_buckets[-1]
    b = batch(shapes.sft_rows, length, rl_keys[:6])
    rep = ProgramReport(f"sft[L={length}]", "sft", f"[{shapes.sft_rows}x{length}] m={m}",
                        resident_bytes=params_b + opt_b,
                        components={"params": params_b, "optimizer": opt_b,
                                    "batch": _per_chip_bytes(b), "rl_state": params_b + opt_b,
                                    **base_c})
    fn = sft_learner.train_step_fn(sft_state)
    add(rep, fn, sft_state, b, *base)
  if "score" in want:
    length = shapes.len_buckets[-1]
    b = batch(shapes.rows, length, ("tokens", "segment_ids", "positions"))
    # It scores the reference params with the train state resident (KL), or the train
    # state's params with the optimizer state and any reference params resident.
    rep = ProgramReport(f"score[L={length}]", "score", f"[{shapes.rows}x{length}]",
                        used=scores, resident_bytes=opt_b + ref_b + gen_b,
                        components={"params": params_b, "optimizer": opt_b,
                                    "batch": _per_chip_bytes(b), "ref_params": ref_b, **base_c,
                                    **gen_c})
    fn = learner.score_fn(False)
    add(rep, fn, params, b, *base)

  if want & set(DECODE_KINDS):
    ecfg = EngineConfig(slots=r.slots, max_len=r.max_len,
                        eos_ids=cfg.eos_token_ids,
                        sampling=SamplingConfig(r.temperature, r.top_p, r.top_k))
    engine = Engine(cfg, ecfg, mesh=dmesh)
    # The engine's cache may be longer than max_len (the GPU decode kernel's rounds it up to a
    # multiple of 64), and its generate and append read up to the whole cache.
    shapes = dataclasses.replace(shapes, kv_len=engine.kv_buckets[-1])
    dstate = engine.abstract_decode_state()
    kv_b = _per_chip_bytes((dstate.k, dstate.v))
    rep_sh = NamedSharding(dmesh, P())
    vec = lambda n, dt=jnp.int32: jax.ShapeDtypeStruct((n,), dt, sharding=rep_sh)
    # Devices that only decode (rollout.devices) hold no learner state: the generator's
    # weights, their copies handed ahead and the cache.
    d_opt, d_ref = (0.0, 0.0) if split else (opt_b, ref_b)
    dec_components = {"params": copy_b, "kv_cache": kv_b}
    if not split:
      dec_components.update(optimizer=opt_b, ref_params=ref_b)
    if masters_b:
      dec_components["learner_params"] = masters_b
    if ahead_b:
      dec_components["params_ahead"] = ahead_b
    around = masters_b + ahead_b + d_opt + d_ref  # resident through every generator program
    # Where the engine's decode calls multiply by merged q|k|v and gate|up weights
    # (`Engine.merge_weights`, on GPUs by default), the rollout driver merges them once per
    # rollout (`Engine.prepare`): a second copy of every weight, held beside the params through
    # every generator program of the rollout, and the params its generate calls receive.
    decode_params, merged_b = dparams, 0.0
    if engine.merge_weights:
      merge = jax.jit(lambda p: engine.prepare(p).decode)
      merged = jax.eval_shape(merge, dparams)
      decode_params = _sds(merged, merge.lower(dparams).compile().output_shardings)
      merged_b = _per_chip_bytes(decode_params)
      dec_components["decode_weights"] = merged_b
    s = shapes
    b, t = s.prefill_batch, s.prefill_len
    prefill_args = (dparams, jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rep_sh), vec(b),
                    vec(b), vec(b, jnp.uint32), vec(b), vec(b))
    prefill = None
    if want & {"prefill", "insert"}:
      rep = ProgramReport("prefill", "prefill", f"[{b}x{t}]",
                          resident_bytes=around + merged_b + kv_b,
                          components=dec_components)
      prefill = add(rep, engine.program("prefill"), *prefill_args, on=dmesh)
      if "prefill" not in want:  # compiled only for the shardings of its output
        programs.remove(rep)
    if "insert" in want:
      # The rollout driver's `Engine.prefill_insert` hands insert the prefill's whole padded
      # batch (its padding rows are dropped by the insert), with the rows' prompt sharing.
      out = jax.eval_shape(engine.program("prefill"), *prefill_args)
      out_sh = (prefill.output_shardings if prefill is not None
                else jax.tree.map(lambda _: rep_sh, out))
      prefix = _sds(out, out_sh)
      share = (vec(b), vec(b)) if ecfg.share_prompts else None
      rep = ProgramReport("insert", "insert", f"{b} prefixes of {t}",
                          resident_bytes=copy_b + around + merged_b,
                          components=dec_components)
      add(rep, engine.program("insert"), prefix, dstate, vec(b), share, on=dmesh)
    if "generate" in want:
      # Given the merged copy, the params it was made from stay resident beside it.
      held = copy_b if merged_b else 0.0
      rep = ProgramReport("generate", "generate",
                          f"{s.slots} slots x {s.decode_steps} steps, kv {s.kv_len}",
                          resident_bytes=held + around,
                          components=dec_components)
      add(rep, engine.program("generate"), decode_params, dstate, on=dmesh,
          steps=s.decode_steps, kv_len=s.kv_len)
    if "append" in want:
      b, n = s.append_batch, s.append_len
      chunk = jax.ShapeDtypeStruct((b, n), jnp.int32, sharding=rep_sh)
      rep = ProgramReport("append", "append", f"[{b}x{n}], kv {s.kv_len}",
                          resident_bytes=around + merged_b,
                          components=dec_components)
      add(rep, engine.program("append"), dparams, dstate, vec(b), chunk, vec(b), vec(b),
          on=dmesh, kv_len=s.kv_len)

  report = PlanReport(model=cfg.name, num_params=cfg.num_params(), target=target,
                      platform=devices[0].platform, chip=chip, n_devices=len(devices),
                      mesh=sizes, shapes=shapes, programs=programs, knobs=[],
                      rollout_devices=len(rollout_devices) if rollout_devices else None,
                      decode_only=split, generator_copies=copies if dparams is not params else 0)
  report.knobs = knobs(report, config, cfg)
  return report


# ----------------------------------------------------------------------------- launcher
def check_fit(config, mode: str = "auto", devices: Sequence[jax.Device] | None = None,
              cfg: ModelConfig | None = None, options: PlanOptions = PlanOptions()
              ) -> PlanReport | None:
  """The launcher's pre-flight check: compile the run's programs for the real devices.

  mode "off" skips it; "auto" skips it on CPU, where "HBM" is host memory that the OS pages
  (the report would say nothing useful) and runs it on TPU/GPU; "on" always runs it, and on CPU
  only logs the report. Raises `DoesNotFit` (its message is the report) when a used program does
  not fit the accelerator's memory.
  """
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"fit check mode must be 'auto', 'on' or 'off', got {mode!r}")
  devices = list(devices if devices is not None else jax.devices())
  if mode == "off" or (mode == "auto" and devices[0].platform == "cpu"):
    return None
  t0 = time.perf_counter()
  report = plan_run(config, devices, cfg=cfg, options=options)
  if jax.process_index() == 0:
    log.info("fit check (%.0f s):\n%s", time.perf_counter() - t0, report.render())
  if report.fits is False:
    raise DoesNotFit(report)
  return report
