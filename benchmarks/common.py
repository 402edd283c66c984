"""Shared helpers of the benchmark scripts: device facts, timing, result lines.

Each script prints one machine-readable line per measurement (`RESULT {json}`) and, with
`--record`, appends a row to `benchmarks/RESULTS.md` with the device, versions and date.
"""
from __future__ import annotations

import datetime
import itertools
import json
import pathlib
import statistics
import sys
import time

import jax

# Dense bf16 peak and HBM bandwidth of the chips we report against (vendor datasheets). "H100"
# and "H200" are the SXM parts; the PCIe / NVL cards run slower clocks (and the H100 PCIe
# slower memory) and report their own device kinds.
PEAKS = {
    "H100": dict(bf16_flops=989e12, hbm_bytes_s=3.35e12),
    "H100 PCIe": dict(bf16_flops=756e12, hbm_bytes_s=2.0e12),
    "H100 NVL": dict(bf16_flops=835e12, hbm_bytes_s=3.9e12),
    "H200": dict(bf16_flops=989e12, hbm_bytes_s=4.8e12),
    "H200 NVL": dict(bf16_flops=835e12, hbm_bytes_s=4.8e12),
    "cpu": dict(bf16_flops=float("nan"), hbm_bytes_s=float("nan")),
}
RESULTS = pathlib.Path(__file__).resolve().parent / "RESULTS.md"

# Values of on/off options (`AUTO_ON_OFF`: "auto" is None, an `EngineConfig` auto setting).
ON_OFF = {"on": True, "off": False}
AUTO_ON_OFF = {"auto": None, **ON_OFF}


def add_decode_switches(ap) -> None:
  """The decode program's weight switches as options, each a comma-separated list of values
  with one run per combination (`decode_switch_runs`)."""
  ap.add_argument("--merge-weights", default="auto",
                  help="q|k|v and gate|up weights merged into one matrix each "
                       "(EngineConfig.decode_merge_weights): auto, on, off, or a list")
  ap.add_argument("--fused-qkv", default="on",
                  help="bias, q / k norms and RoPE in the decode kernel with merged weights "
                       "(EngineConfig.decode_fused_qkv): on, off, or on,off")
  ap.add_argument("--fold-norms", default="on",
                  help="the layer norms' weights folded into the merged matrices, their scales "
                       "in the decode kernels (EngineConfig.decode_fold_norms): on, off, or "
                       "on,off")
  ap.add_argument("--chain-weights", default="auto",
                  help="prepared decode matrices chained, two GEMMs a layer "
                       "(EngineConfig.decode_chain_weights): auto, on, off, or a list")


def _switch_values(option: str, spec: str, allowed: dict) -> list:
  values = spec.split(",")
  bad = [v for v in values if v not in allowed]
  if bad:
    raise SystemExit(f"{option}: unknown value(s) {bad}; expected a comma-separated list of "
                     f"{', '.join(allowed)}")
  return [allowed[v] for v in values]


def list_option(option: str, spec: str, allowed) -> list:
  """The values of a comma-separated option, each one of `allowed` (a list of names, or a dict
  from name to value); an unknown one exits with a message naming the option (a misspelt
  section or switch would otherwise skip its measurement, or run the other setting, silently)."""
  allowed = allowed if isinstance(allowed, dict) else {name: name for name in allowed}
  return _switch_values(option, spec, allowed)


def decode_switch_runs(args) -> list[dict]:
  """`EngineConfig` keywords of every combination of `add_decode_switches`' values."""
  return [dict(decode_merge_weights=merge, decode_fused_qkv=fused, decode_fold_norms=fold,
               decode_chain_weights=chain)
          for merge, fused, fold, chain in itertools.product(
              _switch_values("--merge-weights", args.merge_weights, AUTO_ON_OFF),
              _switch_values("--fused-qkv", args.fused_qkv, ON_OFF),
              _switch_values("--fold-norms", args.fold_norms, ON_OFF),
              _switch_values("--chain-weights", args.chain_weights, AUTO_ON_OFF))]


def decode_switch_run(args) -> dict:
  """The one `decode_switch_runs` combination of a script that takes a single value of each
  switch."""
  runs = decode_switch_runs(args)
  if len(runs) != 1:
    raise SystemExit("this script takes one value of each of --merge-weights, --fused-qkv, "
                     "--fold-norms and --chain-weights, not a list")
  return runs[0]


def chip_of(kind: str) -> str:
  """The `PEAKS` entry of a device kind ("NVIDIA H100 80GB HBM3": "H100"; "NVIDIA H100 PCIe",
  which used to take the SXM part's figures: "H100 PCIe")."""
  for variant in ("H100 PCIe", "H100 NVL", "H200 NVL"):
    if variant in kind:
      return variant
  return "H200" if "H200" in kind else "H100" if "H100" in kind else "cpu"


def device_info() -> dict:
  d = jax.devices()[0]
  kind = getattr(d, "device_kind", d.platform)
  chip = chip_of(kind)
  return {"device": kind, "n_devices": jax.device_count(), "chip": chip,
          "jax": jax.__version__, "python": sys.version.split()[0]}


def peaks() -> dict:
  return PEAKS[device_info()["chip"]]


def kv_bytes_per_token(cfg) -> int:
  """bf16 keys and values of one cached token over every layer."""
  return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2


def mean_live_kv(cached: int, steps: int) -> float:
  """Keys per slot that `steps` decode steps move on average when each slot holds `cached`
  before the first: step i writes its token's K/V at position `cached + i` and attends over
  `cached + i + 1` keys, so the mean is `cached + (steps + 1) / 2` (`prompt + new / 2` was half
  a key short for a whole run, and `cached` alone (steps + 1) / 2 keys short for a held call)."""
  return cached + (steps + 1) / 2


def decode_roofline_bytes(cfg, slots: int, cached: float) -> float:
  """What one decode step must read from HBM: the bf16 weights plus `slots` slots' live K/V of
  `cached` tokens each (the roofline of `generate.py` and `decode_profile.py`). An untied input
  embedding is read only as the `slots` rows it looks up, not as a whole table."""
  weights = cfg.num_params()
  if not cfg.tie_embeddings:
    weights -= (cfg.vocab_size - min(slots, cfg.vocab_size)) * cfg.d_model
  return weights * 2 + slots * cached * kv_bytes_per_token(cfg)


def timeit(fn, *, warmup: int = 2, iters: int = 5) -> dict:
  """Median / min wall time of `fn()` (which must block until its device work is done)."""
  for _ in range(warmup):
    fn()
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return {"median_s": statistics.median(ts), "min_s": min(ts), "iters": iters}


def emit(name: str, record: bool = False, **fields) -> dict:
  row = {"bench": name, **device_info(), "date": datetime.date.today().isoformat(), **fields}
  print("RESULT " + json.dumps(row), flush=True)
  if record:
    with open(RESULTS, "a") as f:
      f.write(f"\n<!-- {name} -->\n`{json.dumps(row)}`\n")
  return row


def grpo_batch(cfg, rows: int, prompt: int, gen: int) -> dict:
  """Random `[rows, prompt + gen]` GRPO rows: loss on the `gen` completion tokens, one advantage
  per row, the sampler's log-probs a constant (-11.9); no `ref_logps`."""
  import numpy as np
  rng = np.random.default_rng(1)
  length = prompt + gen
  mask = np.concatenate([np.zeros((rows, prompt)), np.ones((rows, gen))], 1).astype(np.float32)
  return {
      "tokens": rng.integers(2, cfg.vocab_size, (rows, length)).astype(np.int32),
      "segment_ids": np.ones((rows, length), np.int32),
      "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
      "loss_mask": mask,
      "advantages": np.repeat(rng.standard_normal((rows, 1)), length, 1).astype(np.float32),
      "old_logps": np.where(mask > 0, -11.9, 0.0).astype(np.float32),
  }


def grpo_learner(cfg, micro_batches: int, mesh=None, gather_weights: bool = False,
                 save_probs: bool = False):
  """The learner of the peer comparison's GRPO step, as the Tunix harness sets its own: k3 KL
  at 0.04, AdamW (lr 1e-6, b2 0.99, weight decay 0.1) after clipping the global norm at 1.
  `save_probs`: `StepConfig.logprob_save_probs`."""
  from jaxagent.rl import losses, step
  scfg = step.StepConfig(loss=losses.LossConfig(kl_coef=0.04, kl_estimator="k3"),
                         micro_batches=micro_batches, entropy=False,
                         gather_weights=gather_weights, logprob_save_probs=save_probs)
  opt = step.make_optimizer(1e-6, weight_decay=0.1, b2=0.99, max_grad_norm=1.0)
  return step.Learner(cfg, scfg, opt, mesh)
