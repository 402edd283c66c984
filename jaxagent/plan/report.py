"""What a plan reports: per-program memory, cost and collectives, the verdict, and the knobs.

Place in the data flow: `jaxagent.plan.planner.plan_run` fills a `ProgramReport` per compiled
program and wraps them in a `PlanReport`; `render()` is what `python -m jaxagent.plan` prints and
what the launcher's fit check stops with. `knobs` turns what overflows into the settings to
change, largest lever first.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxagent.models.config import ModelConfig
from jaxagent.plan import hlo
from jaxagent.plan.chips import GiB, ChipSpec


@dataclasses.dataclass(frozen=True)
class RunShapes:
  """The static shapes of every program of a run on a given mesh."""

  rows: int
  len_buckets: tuple[int, ...]
  micro_batches: int
  sft_rows: int                 # 0: no SFT warm start
  kl: bool                      # reference scoring used
  slots: int
  max_len: int
  prefill_batch: int
  prefill_len: int
  append_batch: int
  append_len: int
  decode_steps: int
  kv_len: int
  mini_batches: int = 1         # the RL update runs on rows / mini_batches of them

  @property
  def update_rows(self) -> int:
    """Rows of one RL update (one mini-batch of the step's `rows`)."""
    return self.rows // self.mini_batches


@dataclasses.dataclass
class ProgramReport:
  """One compiled program: memory per chip, cost estimate and collectives."""

  name: str
  kind: str
  shapes: str
  used: bool = True
  argument_bytes: float = 0.0
  output_bytes: float = 0.0
  alias_bytes: float = 0.0
  temp_bytes: float = 0.0
  code_bytes: float = 0.0
  resident_bytes: float = 0.0
  components: dict[str, float] = dataclasses.field(default_factory=dict)
  flops: float = 0.0            # loop-aware matmul flops per chip
  bytes_accessed: float = 0.0   # loop-aware HBM bytes per chip
  xla_flops: float | None = None
  xla_bytes: float | None = None
  xla_optimal_s: float | None = None
  est_s: float | None = None
  bound: str = ""               # which roofline term sets est_s: "compute", "hbm" or "ici"
  collectives: dict[str, hlo.Collective] = dataclasses.field(default_factory=dict)
  collective_summary: str = ""
  unknown_loops: int = 0
  compile_s: float = 0.0
  oom: bool = False             # the compiler itself refused: out of device memory
  error: str | None = None
  capacity: float | None = None
  n_devices: int = 0            # the devices the program runs over (its mesh's)

  @property
  def program_bytes(self) -> float:
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + \
        self.code_bytes

  @property
  def total_bytes(self) -> float:
    return self.program_bytes + self.resident_bytes

  @property
  def fits(self) -> bool | None:
    """True / False, or None when unknown: no capacity (CPU), or a compile failure that is not
    the compiler running out of memory (reported, but it does not stop a launch: the run itself
    would meet the same error with its own message)."""
    if self.oom:
      return False
    if self.error is not None or self.capacity is None:
      return None
    return self.total_bytes <= self.capacity

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["collectives"] = {k: dataclasses.asdict(v) for k, v in self.collectives.items() if v.static}
    d.update(program_bytes=self.program_bytes, total_bytes=self.total_bytes, fits=self.fits)
    return d


@dataclasses.dataclass
class PlanReport:
  """Every program of a run compiled for one device set, and the verdict."""

  model: str
  num_params: int
  target: str                   # topology name or "local"
  platform: str
  chip: ChipSpec
  n_devices: int
  mesh: dict[str, int]
  shapes: RunShapes
  programs: list[ProgramReport]
  knobs: list[str]
  rollout_devices: int | None = None  # the devices the generator's programs run on: on several
                                      # hosts process 0's, or those that only decode (None: all
                                      # `n_devices`)
  decode_only: bool = False     # rollout.devices: the `rollout_devices` only decode, apart from
                                # the `n_devices` (the learner's) that the update runs on
  generator_copies: int = 0     # copies of the generator's weights resident at once on a chip
                                # that decodes (train.off_policy_steps; 0: it decodes from the
                                # learner's params)

  @property
  def fits(self) -> bool | None:
    """False if a used program does not fit; None if the capacity is unknown, or if no program
    the run uses was planned; else True."""
    verdicts = [p.fits for p in self.programs if p.used]
    if not verdicts:
      return None
    if any(v is False for v in verdicts):
      return False
    if any(v is None for v in verdicts):
      return None
    return True

  def program(self, name: str) -> ProgramReport:
    for p in self.programs:
      if p.name == name or p.kind == name:
        return p
    raise KeyError(f"no program {name!r} in the plan; have {[p.name for p in self.programs]}")

  def update_time_s(self) -> float | None:
    """Estimated time of one update step at the longest length bucket."""
    ups = [p for p in self.programs if p.kind == "update" and p.est_s is not None]
    return ups[-1].est_s if ups else None

  def decode_step_time_s(self) -> float | None:
    """Estimated time of one decode step (the generate program over its steps)."""
    gen = [p for p in self.programs if p.kind == "generate" and p.est_s is not None]
    return gen[0].est_s / self.shapes.decode_steps if gen else None

  def peak_bytes(self) -> float:
    return max((p.total_bytes for p in self.programs if p.used), default=0.0)

  def to_dict(self) -> dict[str, Any]:
    return {"model": self.model, "num_params": self.num_params, "target": self.target,
            "platform": self.platform, "chip": dataclasses.asdict(self.chip),
            "n_devices": self.n_devices, "mesh": self.mesh,
            "rollout_devices": self.rollout_devices, "decode_only": self.decode_only,
            "generator_copies": self.generator_copies,
            "shapes": dataclasses.asdict(self.shapes), "fits": self.fits,
            "peak_bytes": self.peak_bytes(), "update_time_s": self.update_time_s(),
            "decode_step_time_s": self.decode_step_time_s(),
            "programs": [p.to_dict() for p in self.programs], "knobs": self.knobs}

  def render(self) -> str:
    """A plain-text report: header, one line per program, verdict and knobs."""
    c = self.chip
    cap = f"{c.hbm_bytes / GiB:.2f} GiB" if c.hbm_bytes else "unknown"
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
    lines = [
        f"model {self.model} ({self.num_params / 1e9:.2f}B params) on {self.target} "
        f"({self.n_devices} x {c.name}{' for the learner' if self.decode_only else ''}, "
        f"{cap} per chip [{c.source}]), mesh {mesh}"
        + (f"; rollouts on process 0's {self.rollout_devices} devices (the generator programs)"
           if self.rollout_devices and not self.decode_only else ""),
    ]
    if self.decode_only:
      lines.append(
          f"rollout devices: {self.rollout_devices} more (decode only, rollout.devices): "
          "prefill, insert, generate and append run there, beside the generator's weights and "
          f"cache alone; update, sft and score on the {self.n_devices} learner devices above")
    if self.generator_copies > 1:
      lines.append(
          f"generator weights: {self.generator_copies} copies resident at once on a decoding "
          "chip (train.off_policy_steps: one per RL step's hand-off in flight), counted in "
          "resid")
    lines += [
        f"{'program':<16} {'shape':<28} {'args':>8} {'out':>8} {'temp':>8} {'resid':>8} "
        f"{'total':>9} {'fits':>5} {'est ms':>8} {'TFLOP':>8} {'GB':>7}  collectives (executed)",
    ]
    g = lambda x: f"{x / GiB:.2f}"
    for p in self.programs:
      fits = {True: "yes", False: "NO", None: "?"}[p.fits] + ("" if p.used else "*")
      est = f"{p.est_s * 1e3:.2f}{p.bound[:1]}" if p.est_s is not None else "-"
      if p.error and not p.oom:
        lines.append(f"{p.name:<16} {p.shapes:<28} compile failed: {p.error}")
        continue
      lines.append(
          f"{p.name:<16} {p.shapes:<28} {g(p.argument_bytes):>8} {g(p.output_bytes):>8} "
          f"{g(p.temp_bytes):>8} {g(p.resident_bytes):>8} {g(p.total_bytes):>9} {fits:>5} "
          f"{est:>8} {p.flops / 1e12:>8.3f} {p.bytes_accessed / 1e9:>7.2f}  "
          f"{p.collective_summary or 'none'}")
      if p.oom:
        lines.append(f"{'':<16} the compiler ran out of device memory: {p.error}")
    lines.append("(GiB per chip; resid = buffers the run keeps alive meanwhile; total = args + "
                 "out - donated args reused for outputs + temp + code + resid; * = not used by "
                 "this config; est = roofline max of compute (c), HBM (h) and interconnect (i) "
                 "time from loop-aware HLO counts)")
    verdict = {True: "FITS", False: "DOES NOT FIT",
               None: "fit unknown (no device capacity, or a program failed to compile)"
               if any(p.used for p in self.programs)
               else "none (no program that this run uses was planned)"}
    lines.append(f"verdict: {verdict[self.fits]}; peak {self.peak_bytes() / GiB:.2f} GiB per "
                 f"chip of {cap}")
    ut, dt = self.update_time_s(), self.decode_step_time_s()
    if ut is not None or dt is not None:
      lines.append("estimated: update step " + (f"{ut * 1e3:.1f} ms" if ut else "-") +
                   ", decode step " + (f"{dt * 1e3:.2f} ms" if dt else "-"))
    for k in self.knobs:
      lines.append(f"knob: {k}")
    return "\n".join(lines)


def knobs(report: PlanReport, config, cfg: ModelConfig) -> list[str]:
  """Which settings to turn, largest lever first, for each used program that does not fit."""
  out: list[str] = []
  cap = report.chip.hbm_bytes
  n, mesh, s = report.n_devices, report.mesh, report.shapes
  g = lambda x: f"{x / GiB:.1f} GiB"

  def say(msg):
    if msg not in out:
      out.append(msg)

  for p in report.programs:
    if p.used and p.error and not p.oom:
      say(f"{p.name} failed to compile (see its line): fix that first")
      continue
    if not p.used or p.fits is not False:
      continue
    comp = p.components
    parts = {"params": "params", "optimizer": "optimizer state", "ref_params": "reference params"}
    # A generator off the learner's mesh (rollout.mesh=data, process 0's chips on several
    # hosts, or devices that only decode) decodes from a copy of the weights that mesh.fsdp
    # does not split: named apart.
    off_learner = p.kind not in ("update", "sft", "score") and (
        config.rollout.get("mesh", "learner") == "data" or bool(report.rollout_devices))
    if off_learner:
      copy = comp.get("params", 0)
      if copy > 0.3 * (cap or p.total_bytes or 1.0):
        data = config.rollout.get("mesh", "learner") == "data"
        whole = "whole on each" if data else "split over them"
        if report.decode_only:
          on = f"the {report.rollout_devices} rollout devices, {whole}"
          instead = ("; rollout.mesh=learner splits it over the rollout devices" if data else
                     f"; more rollout devices (rollout.devices, now {report.rollout_devices}) "
                     "split it further")
        else:
          on = (f"process 0's {report.rollout_devices} chips, {whole}"
                if report.rollout_devices else "every chip, whole")
          instead = ("; rollout.mesh=learner splits it over them" if report.rollout_devices
                     else "; rollout.mesh=learner decodes from the learner's sharded weights "
                     "instead") if data else ""
        say(f"the generator's copy of the weights takes {g(copy)} per chip (on {on}; mesh.fsdp "
            "does not split it)" + instead)
    # Rollouts collected ahead (train.off_policy_steps) each keep a copy of the weights.
    train = config.get("train")
    k = (train.get("off_policy_steps", 0) or 0) if hasattr(train, "get") else 0
    ahead = comp.get("params_ahead", 0) + comp.get("generator_params", 0)
    if k and ahead > 0.1 * (cap or p.total_bytes or 1.0):
      each = comp.get("generator_params", 0) / k or comp.get("params", 0)
      say(f"train.off_policy_steps (now {k}): each RL step's rollouts collected ahead keep a "
          f"copy of the generator's weights resident ({g(each)} per chip) until they are "
          "collected; fewer steps ahead keep fewer")
    if off_learner:
      parts = {"learner_params": "learner params", "optimizer": "optimizer state",
               "ref_params": "reference params"}
    held = [name for key, name in parts.items() if comp.get(key, 0) > 0] or ["params"]
    what = " + ".join(held)
    weights = sum(comp.get(key, 0) for key in parts)
    share = weights / (cap or p.total_bytes or 1.0)
    if share > 0.3:
      if mesh["fsdp"] < n // max(1, mesh["tensor"]):
        say(f"shard weights over more chips: mesh.fsdp={n // mesh['tensor']} with mesh.data=1 "
            f"({what} take {g(weights)} per chip at fsdp={mesh['fsdp']} and shrink as "
            f"1/fsdp)")
      if cfg.param_dtype == "float32":
        say(f"model.param_dtype=bfloat16 halves {what} ({g(weights)} per chip now)")
      if share > 0.7 and mesh["fsdp"] * mesh["tensor"] >= n:
        say(f"the weights alone need {g(weights)} per chip on {n} chips: use a larger topology")
    if p.kind in ("update", "sft", "score"):
      # The score program runs its rows in the update's micro-batches too (`Learner.score_fn`).
      rows = {"sft": s.sft_rows, "update": s.update_rows}.get(p.kind, s.rows)
      rows_per_chip = rows // max(1, s.micro_batches * mesh["data"] * mesh["fsdp"])
      if rows_per_chip > 1:
        say(f"train.micro_batches={s.micro_batches * 2} (now {s.micro_batches}; "
            f"{rows_per_chip} rows per chip per micro-batch; activations scale with it)")
    if p.kind in ("update", "sft"):
      if cfg.remat == "none":
        say("model.remat=full (recompute layer activations in the backward pass)")
      say(f"train.pack_len / train.len_buckets (rows of {s.len_buckets[-1]} tokens now)")
    elif p.kind == "score":
      say(f"score in smaller batches: train.pack_len (now {s.len_buckets[-1]})")
    else:
      kv = comp.get("kv_cache", 0)
      if kv > 0.2 * (cap or p.total_bytes):
        say(f"rollout.slots (now {s.slots}) or rollout.max_len (now {s.max_len}): the KV cache "
            f"is {g(kv)} per chip and scales with both")
        # On the learner's mesh the cache splits its slots over data x fsdp (when they divide
        # them) and its heads over tensor (when they divide): with the chip count fixed, a
        # larger tensor axis shrinks the cache per chip only where the slots did not split.
        rows, t = mesh["data"] * mesh["fsdp"], mesh["tensor"]
        now, more = _kv_ways(s.slots, cfg.n_kv_heads, rows, t), 0
        if rows % 2 == 0 and cfg.n_kv_heads % (2 * t) == 0:
          more = _kv_ways(s.slots, cfg.n_kv_heads, rows // 2, 2 * t)
        if (config.rollout.get("mesh", "learner") == "learner" and not report.rollout_devices
            and more > now):
          say(f"mesh.tensor={2 * t} with mesh.data x mesh.fsdp = {rows // 2} splits the KV "
              f"cache {more} ways instead of {now} (its {cfg.n_kv_heads} heads over tensor; "
              f"{s.slots} slots over data x fsdp only where they divide)")
      if p.kind == "append":
        say(f"append: rollout.slots (now {s.slots}) or rollout.max_len (now {s.max_len}); "
            f"planned with all {s.append_batch} slots appending {s.append_len} tokens at once, "
            f"its temporaries grow with the cache it gathers for the appended slots")
      if p.kind == "prefill":
        say(f"prefill fewer or shorter prompts: rollout.slots (now {s.slots}); prompts are "
            f"planned at {s.prefill_len} tokens (PlanOptions.prompt_len)")
  return out


def _kv_ways(slots: int, kv_heads: int, rows: int, tensor: int) -> int:
  """How many ways `sharding.kv_cache_spec` splits a KV cache over data x fsdp = `rows` and
  `tensor` devices: each dim splits over its axes when it divides them, else not at all."""
  return (rows if slots % rows == 0 else 1) * (tensor if kv_heads % tensor == 0 else 1)
