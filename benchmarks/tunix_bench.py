"""Tunix (google-tunix) baseline on one GPU: vanilla sampler throughput and a
GRPO train step (tunix grpo_loss_fn + nnx.Optimizer/optax.MultiSteps, the same
pattern tunix's PeftTrainer/RL actor trainer uses). Random-init Qwen3-0.6B
shaped model in bf16 (tunix.models.qwen3.model.ModelConfig.qwen3_0p6b()).

With --e2e, also one GRPO iteration end to end: the sampler on 64 prompts x 8 samples
(512 new tokens), reference log-probs of the 512 sequences, and the micro-batched GRPO step over
them (RESULTS["e2e"]); --only_e2e skips the rest. benchmarks/peer_tunix.py runs this file and
compares.

Usage: python tunix_bench.py [--tiny] [--e2e [--only_e2e]]   (--tiny = CPU smoke test config)
"""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import argparse
import dataclasses
import gc
import sys
import time
import traceback

T0 = time.time()


def log(*a):
  print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


p = argparse.ArgumentParser()
p.add_argument("--tiny", action="store_true")
p.add_argument("--budget", type=float, default=400.0,
               help="skip sections that start after this many seconds")
p.add_argument("--skip_256", action="store_true")
p.add_argument("--only_grpo", action="store_true", help="skip the sampler part")
p.add_argument("--mb_list", default="",
               help="e.g. 8:NONE,16:NONE,16:DECODER; with it every config runs")
p.add_argument("--n_timed", type=int, default=0)
p.add_argument("--e2e", action="store_true", help="also time one GRPO iteration end to end")
p.add_argument("--only_e2e", action="store_true", help="only the end-to-end iteration")
p.add_argument("--only_sampler", action="store_true", help="skip the GRPO step")
p.add_argument("--e2e_rollout_batch", type=int, default=0,
               help="sampler calls of this many sequences in the end-to-end rollout (0: one call "
                    "of all; the 512-sequence call needs more than an H100's 80 GB)")
args = p.parse_args()

import numpy as np
import jax
import jax.numpy as jnp
import flax
from flax import nnx
import optax

try:
  import tunix
  from tunix.models.qwen3 import model as qwen3_lib
  from tunix.generate import sampler as sampler_lib
  from tunix.rl import algo_core
  from tunix.rl import common as rl_common
  from tunix.rl.grpo import grpo_learner
except ImportError as e:  # the peer is an optional install, not a dependency of jaxagent
  sys.exit(f"tunix_bench.py needs the peer's wheels in this interpreter ({e}): python3 -m pip "
           "install --no-deps google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 "
           "tensorboardX==2.6.5 perfetto==0.59.1 (benchmarks/README.md)")

import importlib.metadata as md


def ver(n):
  try:
    return md.version(n)
  except Exception:
    return "?"


log("python", sys.version.split()[0])
log("jax", jax.__version__, "jaxlib", ver("jaxlib"), "flax", flax.__version__,
    "optax", optax.__version__, "tunix", tunix.__version__,
    "jax-cuda-plugin", ver("jax-cuda13-plugin"), ver("jax-cuda12-plugin"))
dev = jax.devices()[0]
log("devices", jax.devices(), "kind:", getattr(dev, "device_kind", "?"))
log("XLA_PYTHON_CLIENT_MEM_FRACTION",
    os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"))

RESULTS = {}


def mem():
  try:
    s = dev.memory_stats() or {}
    return (f"mem in_use={s.get('bytes_in_use', 0)/2**30:.1f}GiB "
            f"peak={s.get('peak_bytes_in_use', 0)/2**30:.1f}GiB "
            f"limit={s.get('bytes_limit', 0)/2**30:.1f}GiB")
  except Exception as e:  # pylint: disable=broad-except
    return f"mem ? ({e})"


def over_budget(name):
  if time.time() - T0 > args.budget:
    log(f"SKIP {name}: over time budget ({args.budget}s)")
    return True
  return False


# ----------------------------------------------------------------- config
if args.tiny:
  cfg = qwen3_lib.ModelConfig(
      num_layers=2, vocab_size=1024, embed_dim=64, hidden_dim=128,
      num_heads=4, head_dim=16, num_kv_heads=2, rope_theta=1_000_000,
      norm_eps=1e-6, use_tied_embedding=True)
  GEN_BATCHES, PROMPT_LEN, GEN_LEN = [4, 8], 16, 16
  TRAIN_B, TRAIN_P, TRAIN_C = 8, 16, 48
  MB_ATTEMPTS = [(4, "NONE"), (2, "DECODER")]
  N_TIMED = 1
else:
  cfg = qwen3_lib.ModelConfig.qwen3_0p6b()
  GEN_BATCHES, PROMPT_LEN, GEN_LEN = [64, 256], 128, 512
  if args.skip_256:
    GEN_BATCHES = [64]
  TRAIN_B, TRAIN_P, TRAIN_C = 64, 128, 512
  # (micro-batch, remat) attempts; first that works is reported.
  MB_ATTEMPTS = [(8, "NONE"), (8, "DECODER")]
  N_TIMED = 2
SWEEP = bool(args.mb_list)
if SWEEP:
  MB_ATTEMPTS = [(int(a), b) for a, b in
                 (x.split(":") for x in args.mb_list.split(","))]
if args.n_timed:
  N_TIMED = args.n_timed
cfg.dtype = jnp.bfloat16
cfg.param_dtype = jnp.bfloat16
log("model config:", {f.name: getattr(cfg, f.name)
                      for f in dataclasses.fields(cfg) if f.name != "shd_config"})


def build_model(c, seed=0):
  t = time.time()
  m = qwen3_lib.Qwen3(c, rngs=nnx.Rngs(seed))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  jax.block_until_ready(nnx.state(m, nnx.Param))
  log(f"built Qwen3 model: {n/1e6:.1f}M params in {time.time()-t:.1f}s; {mem()}")
  return m


class DummyTokenizer:
  """Whitespace-separated integer ids; pad=0, bos=0 (none), eos=1."""

  def encode(self, text, **kw):
    return [int(t) for t in text.split()]

  def decode(self, ids, **kw):
    return ""

  def bos_id(self):
    return 0

  def eos_id(self):
    return 1

  def pad_id(self):
    return 0


# ----------------------------------------------------------------- (a) sampler
model = None
try:
  model = build_model(cfg)
except Exception:  # pylint: disable=broad-except
  log("ERROR building model"); traceback.print_exc(); sys.stdout.flush()

if model is not None and not args.only_grpo and not args.only_e2e:
  sampler = None
  try:
    sampler = sampler_lib.Sampler(
        model, DummyTokenizer(),
        sampler_lib.CacheConfig(cache_size=PROMPT_LEN + GEN_LEN,
                                num_layers=cfg.num_layers,
                                num_kv_heads=cfg.num_kv_heads,
                                head_dim=cfg.head_dim))
  except Exception:  # pylint: disable=broad-except
    log("ERROR creating sampler"); traceback.print_exc(); sys.stdout.flush()

  rng = np.random.default_rng(0)
  for B in GEN_BATCHES:
    if sampler is None or over_budget(f"sampler B={B}"):
      break
    try:
      prompts = [" ".join(map(str, rng.integers(2, cfg.vocab_size, PROMPT_LEN)))
                 for _ in range(B)]
      kw = dict(max_generation_steps=GEN_LEN, max_prompt_length=PROMPT_LEN,
                echo=False, temperature=1.0, top_p=1.0, top_k=None,
                eos_tokens=[cfg.vocab_size + 7],  # never sampled -> full length
                pad_output=False, return_logprobs=False)
      t = time.time()
      out = sampler(prompts, seed=0, **kw)
      ntok = sum(len(x) for x in out.tokens)
      log(f"sampler B={B} warm-up (incl. compile): {time.time()-t:.2f}s, "
          f"{ntok} tokens; {mem()}")
      times = []
      for i in range(N_TIMED):
        if i > 0 and over_budget(f"sampler B={B} timed run {i}"):
          break
        t = time.time()
        out = sampler(prompts, seed=i + 1, **kw)
        dt = time.time() - t
        ntok = sum(len(x) for x in out.tokens)
        times.append(dt)
        log(f"sampler B={B} timed run {i}: {dt:.3f}s, generated {ntok} tokens "
            f"-> {ntok/dt:,.0f} tok/s ({dt/GEN_LEN*1e3:.2f} ms/decode step incl. "
            f"prefill)")
      best = min(times)
      RESULTS[f"sampler_B{B}"] = dict(s=best, tok_s=B * GEN_LEN / best)
      # lengths sanity
      lens = [len(x) for x in out.tokens]
      log(f"sampler B={B} output lengths min/max: {min(lens)}/{max(lens)}")
    except Exception:  # pylint: disable=broad-except
      log(f"ERROR sampler B={B}"); traceback.print_exc(); sys.stdout.flush()
  del sampler
del model
gc.collect()

# ----------------------------------------------------------------- (b) GRPO step
algo_config = grpo_learner.GRPOConfig(num_generations=8, num_iterations=1,
                                      beta=0.04, epsilon=0.2)
algo_config.temperature = 1.0
PAD, EOS = 0, 1



def grpo_optimizer(model, k):
  """AdamW (lr 1e-6, b2 0.99, weight decay 0.1) after global-norm clipping, applied once every
  k micro-steps (optax.MultiSteps), as Tunix's trainer sets up gradient accumulation."""
  tx = optax.MultiSteps(
      optax.chain(optax.clip_by_global_norm(1.0),
                  optax.adamw(1e-6, b1=0.9, b2=0.99, weight_decay=0.1)),
      every_k_schedule=k)
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def grpo_micro_step(model, optimizer, ex):
  def loss_fn(m):
    return algo_core.grpo_loss_fn(m, ex, algo_config, pad_id=PAD, eos_id=EOS)
  (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  gnorm = optax.global_norm(grads)
  optimizer.update(model, grads)
  return loss, gnorm, aux["kl"]


jit_micro_step = nnx.jit(grpo_micro_step, donate_argnames=("optimizer",))

rng = np.random.default_rng(1)
prompt_ids = rng.integers(2, cfg.vocab_size, (TRAIN_B, TRAIN_P)).astype(np.int32)
completion_ids = rng.integers(2, cfg.vocab_size, (TRAIN_B, TRAIN_C)).astype(np.int32)
advantages = rng.standard_normal(TRAIN_B).astype(np.float32)

for mb, remat in ([] if args.only_e2e or args.only_sampler else MB_ATTEMPTS):
  if over_budget(f"GRPO mb={mb} remat={remat}"):
    break
  model = opt = None
  try:
    k = TRAIN_B // mb
    c = dataclasses.replace(cfg, remat_config=qwen3_lib.RematConfig[remat])
    model = build_model(c, seed=1)
    graphdef, state = nnx.split(model)

    # Reference-model per-token logps (forward only; tunix computes these for
    # beta>0 via compute_per_token_logps). Policy weights stand in for ref.
    def ref_logps(i):
      sl = slice(i * mb, (i + 1) * mb)
      return rl_common.compute_per_token_logps(
          graphdef, state, prompt_tokens=jnp.asarray(prompt_ids[sl]),
          completion_tokens=jnp.asarray(completion_ids[sl]), pad_id=PAD,
          eos_id=EOS, stop_gradient=True)

    t = time.time()
    ref = [ref_logps(i) for i in range(k)]
    jax.block_until_ready(ref)
    log(f"ref logps warm-up mb={mb} (incl. compile): {time.time()-t:.2f}s")
    t = time.time()
    ref = [ref_logps(i) for i in range(k)]
    jax.block_until_ready(ref)
    dt_ref = time.time() - t
    log(f"ref logps forward {TRAIN_B}x{TRAIN_P + TRAIN_C} (mb={mb}): "
        f"{dt_ref:.3f}s -> {TRAIN_B*(TRAIN_P+TRAIN_C)/dt_ref:,.0f} tok/s; {mem()}")
    RESULTS[f"ref_logps_fwd_mb{mb}"] = dict(s=dt_ref, mb=mb)

    examples = []
    for i in range(k):
      sl = slice(i * mb, (i + 1) * mb)
      examples.append(grpo_learner.TrainExample(
          prompt_ids=jnp.asarray(prompt_ids[sl]),
          prompt_mask=jnp.ones((mb, TRAIN_P), jnp.int32),
          completion_ids=jnp.asarray(completion_ids[sl]),
          completion_mask=jnp.ones((mb, TRAIN_C), jnp.int32),
          advantages=jnp.asarray(advantages[sl]),
          ref_per_token_logps=ref[i],
          old_per_token_logps=None,
      ))

    opt = grpo_optimizer(model, k)

    def full_step():
      outs = [jit_micro_step(model, opt, ex) for ex in examples]
      return jax.block_until_ready(outs)

    t = time.time()
    outs = full_step()
    log(f"GRPO step warm-up (mb={mb}, remat={remat}, {k} micro-steps, incl. "
        f"compile): {time.time()-t:.2f}s; loss={float(outs[-1][0]):.4f} "
        f"gnorm={float(outs[-1][1]):.3f}; {mem()}")
    times = []
    for i in range(N_TIMED + 1):
      if i > 0 and over_budget("GRPO timed step"):
        break
      t = time.time()
      outs = full_step()
      dt = time.time() - t
      times.append(dt)
      ntok = TRAIN_B * (TRAIN_P + TRAIN_C)
      log(f"GRPO step {i} (B={TRAIN_B}, seq={TRAIN_P + TRAIN_C}, mb={mb}, "
          f"remat={remat}): {dt:.3f}s/step -> {ntok/dt:,.0f} tok/s "
          f"(loss={float(outs[-1][0]):.4f}, kl={float(outs[-1][2]):.5f})")
    best = min(times)
    RESULTS[f"grpo_step_mb{mb}_{remat}"] = dict(s=best, tok_s=TRAIN_B * (TRAIN_P + TRAIN_C) / best,
                                mb=mb, remat=remat, peak=mem())
    log(f"GRPO step + ref fwd: {best + dt_ref:.3f}s "
        f"-> {TRAIN_B*(TRAIN_P+TRAIN_C)/(best+dt_ref):,.0f} tok/s")
    log(f"GRPO mb={mb} remat={remat}: median {sorted(times)[len(times)//2]:.3f}s"
        f" min {best:.3f}s over {len(times)} timed steps")
    del model, opt, examples, ref, state, graphdef, outs
    gc.collect()
    if not SWEEP:
      break
  except Exception:  # pylint: disable=broad-except
    log(f"ERROR GRPO mb={mb} remat={remat}"); traceback.print_exc()
    sys.stdout.flush()
    model = opt = None
    gc.collect()



# ----------------------------------------------------------------- (c) one GRPO iteration
def e2e():
  n_prompts, group = (4, 2) if args.tiny else (64, 8)
  n = n_prompts * group
  mb = 4 if args.tiny else 8
  k = n // mb
  model = build_model(cfg, seed=2)
  ref_graphdef, ref_state = nnx.split(build_model(cfg, seed=2))
  sampler = sampler_lib.Sampler(
      model, DummyTokenizer(),
      sampler_lib.CacheConfig(cache_size=PROMPT_LEN + GEN_LEN, num_layers=cfg.num_layers,
                              num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
  rng = np.random.default_rng(2)
  uniq = rng.integers(2, cfg.vocab_size, (n_prompts, PROMPT_LEN))
  prompt_ids = np.repeat(uniq, group, 0).astype(np.int32)
  prompts = [" ".join(map(str, p)) for p in prompt_ids]
  kw = dict(max_generation_steps=GEN_LEN, max_prompt_length=PROMPT_LEN, echo=False,
            temperature=1.0, top_p=1.0, top_k=None, eos_tokens=[cfg.vocab_size + 7],
            pad_output=False, return_logprobs=False)
  opt = grpo_optimizer(model, k)

  def iteration(seed):
    t0 = time.time()
    rb = args.e2e_rollout_batch or n
    toks = []
    for j in range(0, n, rb):
      toks += list(sampler(prompts[j:j + rb], seed=seed * 1000 + j, **kw).tokens)
    comp = np.array([list(x)[:GEN_LEN] for x in toks], np.int32)
    t1 = time.time()
    ref = []
    for i in range(k):
      sl = slice(i * mb, (i + 1) * mb)
      ref.append(rl_common.compute_per_token_logps(
          ref_graphdef, ref_state, prompt_tokens=jnp.asarray(prompt_ids[sl]),
          completion_tokens=jnp.asarray(comp[sl]), pad_id=PAD, eos_id=EOS,
          stop_gradient=True))
    jax.block_until_ready(ref)
    t2 = time.time()
    rewards = rng.standard_normal((n_prompts, group))
    adv = ((rewards - rewards.mean(1, keepdims=True))
           / (rewards.std(1, keepdims=True) + 1e-6)).reshape(-1).astype(np.float32)
    outs = []
    for i in range(k):
      sl = slice(i * mb, (i + 1) * mb)
      ex = grpo_learner.TrainExample(
          prompt_ids=jnp.asarray(prompt_ids[sl]),
          prompt_mask=jnp.ones((mb, PROMPT_LEN), jnp.int32),
          completion_ids=jnp.asarray(comp[sl]),
          completion_mask=jnp.ones((mb, GEN_LEN), jnp.int32),
          advantages=jnp.asarray(adv[sl]), ref_per_token_logps=ref[i],
          old_per_token_logps=None)
      outs.append(jit_micro_step(model, opt, ex))
    jax.block_until_ready(outs)
    t3 = time.time()
    log(f"e2e iteration seed={seed}: {t3 - t0:.2f}s (rollout {t1 - t0:.2f}s, ref "
        f"{t2 - t1:.2f}s, update {t3 - t2:.2f}s, {k} micro-steps of {mb}); {mem()}")
    return dict(s=t3 - t0, rollout_s=t1 - t0, ref_s=t2 - t1, update_s=t3 - t2)

  iteration(0)  # compile
  times = [iteration(i) for i in range(1, 1 + N_TIMED)]
  RESULTS["e2e"] = min(times, key=lambda r: r["s"])


if args.e2e and not over_budget("e2e"):
  try:
    e2e()
  except Exception:  # pylint: disable=broad-except
    log("ERROR e2e"); traceback.print_exc(); sys.stdout.flush()
  gc.collect()

log("RESULTS", RESULTS)
log("done")
