"""Multi-GPU scaling at a fixed global batch: GRPO update and decode on 1, 2 and 4 GPUs.

    python benchmarks/scaling.py --gpus 1,2,4 --model qwen3-0.6b --batch 256 --mesh fsdp

For each GPU count n a child process (`--child n`, CUDA_VISIBLE_DEVICES = the first n GPUs)
builds a mesh over its n devices (`--mesh fsdp`: fsdp=n, params and optimizer state sharded;
`--mesh data`: data=n, replicated) and times, on the SAME global batch (`--batch` rows, so
batch/n rows per device):
  1. update: one jitted `Learner` step (GRPO loss, beta 0.04 k3 KL, AdamW, `--micro-batches`,
     or with `--micro-rows R` batch / (n x R) micro-batches: R rows per device per
     micro-batch at every n, so each device runs the same programme size and more devices
     accumulate fewer micro-batches) over batch x (prompt + gen) tokens, loss on the gen
     tokens, float32 params, bf16 compute, remat `--remat` ("dots"), the layer loop a scan
     unless `--unrolled`; MFU per device = FLOPs / step_s / (n x peak);
  2. decode: prefill + `gen` decode steps of `batch` slots on the same mesh (bf16 params).
Each child prints `RESULT` lines (bench `scaling_run`); the parent then prints one `scaling`
line per part and n with efficiency = t_1 / (n x t_n): strong scaling, 1.0 = perfect (with no
1-GPU run, t_1 = m x t_m of the smallest m measured). A failed child (OOM, error, timeout) is
reported with status "failed". `--tiny` is a CPU smoke test: tiny-qwen3, n host devices
(--xla_force_host_platform_device_count).
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from benchmarks.common import emit, grpo_batch, grpo_learner, peaks, timeit
from jaxagent import models
from jaxagent import sharding as shd
from jaxagent.generate import Engine, EngineConfig, SamplingConfig


def time_update(cfg, mesh, args):
  learner = grpo_learner(cfg, args.micro_batches, mesh, args.gather_weights, args.save_probs)
  st = [learner.init(shd.init_sharded(lambda k: models.init_params(cfg, k), mesh,
                                      jax.random.key(1)))]
  batch = grpo_batch(cfg, args.batch, args.prompt, args.gen)
  batch["ref_logps"] = np.where(batch["loss_mask"] > 0, -12.0, 0.0).astype(np.float32)
  dev = learner.put_batch(batch)
  train = learner.train_step_fn(st[0])

  def one():
    st[0], m = train(st[0], dev)
    jax.block_until_ready(m)

  return timeit(one, warmup=1, iters=3)["min_s"]


def time_decode(cfg, mesh, args):
  b = args.batch
  params = shd.init_sharded(lambda k: models.init_params(cfg, k), mesh, jax.random.key(0))
  eng = Engine(cfg, EngineConfig(slots=b, max_len=args.prompt + args.gen + args.steps,
                                 eos_ids=(), sampling=SamplingConfig(1.0), kv_page=128),
               mesh=mesh)
  prompts = np.random.default_rng(0).integers(2, cfg.vocab_size, (b, args.prompt)).tolist()

  def one():
    state = eng.insert(eng.prefill(params, prompts, list(range(b))), eng.init_decode_state(),
                       list(range(b)))
    done = 1
    while done < args.gen:
      state, out = eng.generate(params, state, steps=args.steps,
                                kv_len=args.prompt + done + args.steps)
      done += args.steps
    jax.block_until_ready(out.tokens)

  return timeit(one, warmup=1, iters=3)["min_s"]


def child(args):
  n = args.child
  if jax.device_count() != n:
    raise SystemExit(f"child for {n} devices sees {jax.device_count()}: {jax.devices()}")
  mesh = shd.make_mesh(data=n, fsdp=1) if args.mesh == "data" else shd.make_mesh(fsdp=n)
  cfg = models.get_config(args.model, dtype="bfloat16", attention_impl=args.attention)
  length = args.prompt + args.gen
  common = dict(n=n, model=args.model, mesh=args.mesh, batch=args.batch)
  if "update" in args.parts:
    ucfg = cfg.replace(param_dtype="float32", remat=args.remat, scan_layers=not args.unrolled)
    t = time_update(ucfg, mesh, args)
    flops = ucfg.flops_per_token(length) * args.batch * length
    emit("scaling_run", part="update", **common, micro_batches=args.micro_batches,
         gather_weights=args.gather_weights, remat=args.remat, scan_layers=not args.unrolled,
         save_probs=args.save_probs,
         step_s=t, tokens_per_s=args.batch * length / t,
         mfu=flops / t / (n * peaks()["bf16_flops"]))
  if "decode" in args.parts:
    t = time_decode(cfg.replace(param_dtype="bfloat16"), mesh, args)
    emit("scaling_run", part="decode", **common, step_s=t, tokens_per_s=args.batch * args.gen / t)


def child_env(n, platform):
  env = dict(os.environ)
  if platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={n}").strip()
  else:
    visible = env.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(n)))).split(",")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:n])
    env.setdefault("NCCL_NVLS_ENABLE", "0")
  return env


def gpu_count():
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
  except OSError:
    return 0
  return sum(line.startswith("GPU ") for line in out.splitlines())


def run_child(n, platform, timeout):
  """The child's RESULT rows by part, and its error (None when it exited cleanly)."""
  cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", str(n),
         "--platform", platform]
  try:
    proc = subprocess.run(cmd, env=child_env(n, platform), capture_output=True, text=True,
                          timeout=timeout)
    out, err = proc.stdout, (proc.stderr if proc.returncode else None)
  except subprocess.TimeoutExpired as e:
    out, err = e.stdout or "", f"timed out after {timeout}s"
    out = out.decode() if isinstance(out, bytes) else out
  rows = {}
  for line in out.splitlines():
    if line.startswith("RESULT "):
      print(line, flush=True)
      row = json.loads(line[len("RESULT "):])
      rows[row["part"]] = row
  if err is not None:
    print(f"child n={n} failed; stderr tail:\n{err[-3000:]}", flush=True)
    err = (err.strip().splitlines() or [""])[-1][-300:]
  return rows, err


def parent(args):
  jax.config.update("jax_platforms", "cpu")  # the parent times nothing; keep it off the GPUs
  platform = args.platform or ("cpu" if args.tiny or not gpu_count() else "gpu")
  runs = {n: run_child(n, platform, args.timeout) for n in args.gpus}
  for part in args.parts:
    done = {n: rows[part] for n, (rows, _) in runs.items() if part in rows}
    base = min(done, default=None)
    dev = {k: done[base][k] for k in ("device", "chip")} if done else {}
    for n in args.gpus:
      row = done.get(n)
      common = dict(part=part, n=n, model=args.model, mesh=args.mesh, batch=args.batch)
      if row is None:
        emit("scaling", args.record, **dev, n_devices=n, **common, status="failed",
             error=runs[n][1])
        continue
      emit("scaling", args.record, **dev, n_devices=n, **common, status="ok",
           step_s=row["step_s"], tokens_per_s=row["tokens_per_s"], mfu=row.get("mfu"),
           efficiency=done[base]["step_s"] * base / (n * row["step_s"]), baseline_n=base)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--gpus", default="1,2,4")
  ap.add_argument("--model", default="qwen3-0.6b")
  ap.add_argument("--batch", type=int, default=256, help="global rows (update) / slots (decode)")
  ap.add_argument("--prompt", type=int, default=128)
  ap.add_argument("--gen", type=int, default=512)
  ap.add_argument("--micro-batches", type=int, default=4)
  ap.add_argument("--micro-rows", type=int, default=0,
                  help="rows per device per micro-batch: n devices run batch / (n x R) "
                  "micro-batches (overrides --micro-batches; 0: off)")
  ap.add_argument("--steps", type=int, default=16, help="decode steps per generate call")
  ap.add_argument("--mesh", choices=("fsdp", "data"), default="fsdp")
  ap.add_argument("--gather-weights", action="store_true",
                  help="all-gather the fsdp weights once per step (StepConfig.gather_weights)")
  ap.add_argument("--parts", default="update,decode")
  ap.add_argument("--attention", default="auto")
  ap.add_argument("--remat", default="dots", help="the learner's ModelConfig.remat")
  ap.add_argument("--unrolled", action="store_true", help="the learner's layer loop unrolled "
                  "(ModelConfig.scan_layers=False; train_step.py's default)")
  ap.add_argument("--save-probs", action="store_true",
                  help="the learner's StepConfig.logprob_save_probs")
  ap.add_argument("--timeout", type=float, default=1800, help="seconds per child")
  ap.add_argument("--record", action="store_true")
  ap.add_argument("--tiny", action="store_true", help="CPU smoke test sizes")
  ap.add_argument("--platform", choices=("cpu", "gpu"), help="default: gpu if nvidia-smi sees one")
  ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.tiny:
    args.model, args.batch, args.prompt, args.gen, args.micro_batches = "tiny-qwen3", 8, 16, 32, 1
  try:
    args.gpus = [int(g) for g in args.gpus.split(",")]
  except ValueError:
    ap.error(f"--gpus takes a comma-separated list of device counts, got {args.gpus!r}")
  if min(args.gpus) < 1:
    ap.error(f"--gpus: each device count must be >= 1, got {args.gpus}")
  args.parts = args.parts.split(",")
  if not set(args.parts) <= {"update", "decode"}:
    ap.error(f"--parts takes update and/or decode, got {args.parts}")
  for n in args.gpus:
    if args.micro_rows:
      if args.batch % (n * args.micro_rows):
        ap.error(f"--batch {args.batch} must divide into {n} devices x micro-batches of "
                 f"--micro-rows {args.micro_rows}")
    elif args.batch % (n * args.micro_batches):
      ap.error(f"--batch {args.batch} must divide into {n} devices x {args.micro_batches} "
               f"micro-batches (batch % (n * micro_batches) == 0)")
  if args.micro_rows and args.child:  # divisibility checked above for every n in --gpus
    args.micro_batches = args.batch // (args.child * args.micro_rows)
  if args.child:
    child(args)
  else:
    parent(args)


if __name__ == "__main__":
  main()
