"""LoRA edge paths: gathered weights over fsdp, skipped non-finite steps, mixed precision and
bfloat16 bases, target subsets, q/k/v biases, untied embeddings, and the sampler's merged
weights against the learner's."""
import jax
import numpy as np
import pytest

from jaxagent import models, sharding
from jaxagent.models import lora, param_tree
from jaxagent.rl import step

LCFG = lora.LoraConfig(rank=4, alpha=8.0)


def _random_adapter(cfg, lcfg=LCFG, seed=1):
  """An adapter with both A and B random (a fresh one has B = 0)."""
  fresh = lora.init_lora(cfg, lcfg, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
  return jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape), fresh)


def _plain(tree):
  return jax.device_get(param_tree.unbox(tree))


@pytest.mark.slow  # ~35 s on 2 cores (two 8-device compiles and steps)
def test_gathered_weights_with_an_adapter_same_update_fewer_all_gathers():
  """fsdp over 8 devices, 4 micro-batches: `gather_weights` with an adapter gives the update of
  the default path and gathers the weights once per step (the merge used to run on the
  adapter's fsdp shards and all-gather each merged weight again in every micro-batch)."""
  from benchmarks.common import grpo_batch
  from jaxagent.plan import hlo

  cfg = models.get_config("tiny-qwen3", param_dtype="float32", dtype="bfloat16")
  mesh = sharding.make_mesh(fsdp=8)
  batch = grpo_batch(cfg, 32, 8, 24)
  params = models.init_params(cfg, jax.random.key(0))
  ad = _random_adapter(cfg)
  out, gathered = {}, {}
  for g in (False, True):
    scfg = step.StepConfig(micro_batches=4, entropy=False, gather_weights=g)
    learner = step.Learner(cfg, scfg, step.make_optimizer(1e-3), mesh, lora=LCFG, base=params)
    st = learner.init(ad)
    text = learner.train_step_fn(st).lower(st, learner.put_batch(batch),
                                           learner.base).compile().as_text()
    stats = hlo.analyze(text, tuple(mesh.shape.values()), tuple(mesh.axis_names))
    gathered[g] = stats.collectives["all-gather"].bytes
    new, _ = learner.train_step(st, batch)
    out[g] = _plain(new.params)
  for a, b in zip(jax.tree.leaves(out[False]), jax.tree.leaves(out[True])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert gathered[True] < 0.6 * gathered[False], gathered
