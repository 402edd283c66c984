"""The decoder's parameters: their layout, initialisation and the transformations of the tree.

A params tree is a nested dict whose leaves are `flax.linen.LogicallyPartitioned` boxes: each
array carries its logical axis names (`("layers", "embed", "heads", "head_dim")`, ...), which
`jaxagent.sharding` maps to the mesh. Layers are stacked on a leading `layers` axis. The
functions of `jaxagent.models.decoder` read this tree; checkpoints, weight import and export,
the learner and the engine build and transform it here.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxagent.models.config import ModelConfig

Params = dict[str, Any]


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
  """The params tree as `(shape, logical_axes, init)` leaves (init in {"normal","ones","zeros"})."""
  d, h, kv, hd, f, v, n = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.ffn_dim, cfg.vocab_size, cfg.n_layers)
  # (1 + w) norms (Gemma) are the identity at w = 0.
  unit = "zeros" if cfg.norm_plus_one else "ones"
  layers = {
      "attn_norm": ((n, d), ("layers", "norm"), unit),
      "wq": ((n, d, h, hd), ("layers", "embed", "heads", "head_dim"), "normal"),
      "wk": ((n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
      "wv": ((n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
      "wo": ((n, h, hd, d), ("layers", "heads", "head_dim", "embed"), "normal"),
      "mlp_norm": ((n, d), ("layers", "norm"), unit),
      "w_gate": ((n, d, f), ("layers", "embed", "mlp"), "normal"),
      "w_up": ((n, d, f), ("layers", "embed", "mlp"), "normal"),
      "w_down": ((n, f, d), ("layers", "mlp", "embed"), "normal"),
  }
  if cfg.qkv_bias:
    layers["bq"] = ((n, h, hd), ("layers", "heads", "head_dim"), "zeros")
    layers["bk"] = ((n, kv, hd), ("layers", "kv_heads", "head_dim"), "zeros")
    layers["bv"] = ((n, kv, hd), ("layers", "kv_heads", "head_dim"), "zeros")
  if cfg.qk_norm:
    layers["q_norm"] = ((n, hd), ("layers", "head_dim"), unit)
    layers["k_norm"] = ((n, hd), ("layers", "head_dim"), unit)
  if cfg.post_norms:  # Gemma: the attention's and the MLP's outputs are normed too
    layers["post_attn_norm"] = ((n, d), ("layers", "norm"), unit)
    layers["post_mlp_norm"] = ((n, d), ("layers", "norm"), unit)
  specs = {
      "embed": ((v, d), ("vocab", "embed"), "normal"),
      "layers": layers,
      "final_norm": ((d,), ("norm",), unit),
  }
  if not cfg.tie_embeddings:
    specs["lm_head"] = ((d, v), ("embed", "vocab"), "normal")
  return specs


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) == 3 and isinstance(x[1], tuple)


def init_params(cfg: ModelConfig, rng: jax.Array, std: float = 0.02) -> Params:
  """Random params (normal(std) weights, unit norms, zero biases), boxed with logical axes.

  Call it under `jax.jit(..., out_shardings=...)` (see `jaxagent.sharding.init_sharded`) so
  large models are created already sharded.
  """
  # A NaN (or a None / string from a run's config, model.init_std) made NaN weights without an
  # error, or failed with a bare TypeError inside the first multiplication.
  if isinstance(std, bool) or not isinstance(std, numbers.Real) or not 0 <= std < math.inf:
    raise ValueError(f"init_params: std must be a finite number >= 0 (the standard deviation "
                     f"of the normal weights; a run's model.init_std), got {std!r}")
  specs = param_specs(cfg)
  leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
  keys = jax.random.split(rng, len(leaves))
  out = []
  for key, (shape, names, init) in zip(keys, leaves):
    if init == "normal":
      val = std * jax.random.normal(key, shape, jnp.float32)
    elif init == "ones":
      val = jnp.ones(shape, jnp.float32)
    else:
      val = jnp.zeros(shape, jnp.float32)
    out.append(nn.LogicallyPartitioned(val.astype(cfg.jnp_param_dtype), names))
  return jax.tree.unflatten(treedef, out)


def box(cfg: ModelConfig, arrays: dict[str, Any]) -> Params:
  """Attach logical axis names to a plain nested dict of arrays laid out as `param_specs`."""
  specs = param_specs(cfg)

  def attach(spec, arr):
    shape, names, _ = spec
    if tuple(arr.shape) != tuple(shape):
      raise ValueError(f"parameter shape {tuple(arr.shape)} does not match the config's "
                       f"{tuple(shape)} (axes {names})")
    return nn.LogicallyPartitioned(arr, names)

  if set(specs) != set(arrays) or set(specs["layers"]) != set(arrays["layers"]):
    raise ValueError(f"params keys {sorted(arrays)} / layers {sorted(arrays.get('layers', {}))} "
                     f"do not match the config's {sorted(specs)} / {sorted(specs['layers'])}")
  return jax.tree.map(attach, specs, arrays, is_leaf=_is_spec)


def unbox(params: Params) -> dict[str, Any]:
  """The plain arrays of a boxed params tree (no-op on an unboxed tree)."""
  return nn.meta.unbox(params)


def check_model_shapes(params: Params, cfg: ModelConfig, what: str) -> None:
  """A ValueError unless `params` (plain, or as `merge_decode_weights` / `chain_decode_weights`
  leave them) have `cfg`'s vocabulary, width and depth: the embedding table is
  [vocab_size, d_model] and every stacked layer weight has n_layers rows. Only shapes are
  read, so under `jax.jit` it costs nothing past the trace. Params of another model of the
  same family would otherwise run, sized by the arrays, and give another model's tokens."""
  def shape(x):
    return tuple(getattr(getattr(x, "value", x), "shape", ()))

  if not isinstance(params, Mapping) or "embed" not in params or "layers" not in params:
    keys = sorted(params) if isinstance(params, Mapping) else type(params).__name__
    raise ValueError(f"{what}: params must be a model's params tree with 'embed' and 'layers' "
                     f"(models.load / models.init_params), got {keys}")
  want = (cfg.vocab_size, cfg.d_model)
  if shape(params["embed"]) != want:
    raise ValueError(f"{what}: the params' embedding table is {shape(params['embed'])}, the "
                     f"model config {cfg.name!r} says [vocab_size, d_model] = {want}: pass the "
                     "params of this config's model (or the config of these params)")
  layers = params["layers"]
  depths = ({len(layers)} if isinstance(layers, (list, tuple)) else
            {shape(x)[0] for x in jax.tree.leaves(layers) if shape(x)})
  if depths - {cfg.n_layers}:
    raise ValueError(f"{what}: the params have {sorted(depths)} layers, the model config "
                     f"{cfg.name!r} says n_layers = {cfg.n_layers}: pass the params of this "
                     "config's model (or the config of these params)")
  # Weights of another architecture of the same sizes: a Qwen2 model's q/k/v biases or a Qwen3
  # model's q/k norms under a Llama config were ignored (other logits, no error), and the
  # reverse failed with a bare KeyError. (Merged decode weights have their own names.)
  first = layers[0] if isinstance(layers, (list, tuple)) and layers else layers
  if isinstance(first, Mapping) and not is_merged(params):
    have, want = set(first), set(param_specs(cfg)["layers"])
    if have != want:
      raise ValueError(
          f"{what}: the params' layers do not match the model config {cfg.name!r} "
          f"({cfg.architecture}): weights it has no use for {sorted(have - want)}, weights it "
          f"needs {sorted(want - have)}: pass the params of this config's model (or the config "
          "of these params)")


# Weights the decoder casts to the compute dtype where it uses them (norm scales stay float32).
_COMPUTE_CAST = ("embed", "lm_head", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "w_gate",
                 "w_up", "w_down")


def compute_copy(params: Params, cfg: ModelConfig) -> Params:
  """The params as the forward pass reads them: matmul weights and embeddings cast to the
  compute dtype once, instead of at every use (norm scales untouched). Gives bitwise the same
  outputs as `params`; a sampler decoding thousands of steps from float32 master weights
  reads half the bytes and skips a cast per weight per step. Identity when the param and
  compute dtypes agree. Jit it with the params' shardings to keep them."""
  if cfg.jnp_param_dtype == cfg.jnp_dtype:
    return params

  def cast(path, x):
    name = getattr(path[-1], "key", None) if path else None
    if name is None and len(path) > 1:  # a boxed leaf: the name sits above the box
      name = getattr(path[-2], "key", None)
    if name in _COMPUTE_CAST and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(cfg.jnp_dtype)
    return x
  return jax.tree_util.tree_map_with_path(cast, params)


def logical_axes(params: Params):
  """The logical-axis `PartitionSpec` tree of boxed params (or optimizer state)."""
  return nn.get_partition_spec(params)


def merge_decode_weights(params: Params, cfg: ModelConfig,
                         fold_norms: bool = False) -> dict[str, Any]:
  """The plain params with each layer's q, k and v projections as one `[D, (H + 2 KV) hd]`
  matrix ("wqkv") and its gate and up projections as one `[D, 2 F]` ("w_gate_up"), in the
  compute dtype; q, k and v biases as one `[H + 2 KV, hd]` ("bqkv") and q and k norm weights
  as one `[2, hd]` ("qk_norms"), where the model has them. The forward, prefill, extend and
  decode functions take either form.

  `fold_norms`: each layer's attention and MLP RMS-norm weights are multiplied into the rows
  of "wqkv" and "w_gate_up" (in float32, then rounded to the compute dtype) and dropped
  ("attn_norm" and "mlp_norm" are gone: `norms_folded`). rms_norm(x) w @ W equals
  r(x) (x @ diag(w) W) with r(x) the norm's per-row scale, so the layer multiplies the unnormed
  residual stream and scales the products afterwards: the GPU decode step does that inside the
  attention kernel and the SwiGLU kernel (`decoder.decode_in_place`), with no norm kernel of
  its own. The same function up to rounding: in bfloat16 the folded weights and the unnormed
  products round differently from the normed activations.

  For the engine's decode program (`EngineConfig.decode_merge_weights`): at decode sizes one
  GEMM over the merged weights costs less than two or three over their parts, and XLA's own
  dot merger, which finds the same merge, concatenates the weights at every step (a copy of
  them per layer and step); merged here once per decode call, the copy is made once per call
  and the step loop reads the merged weights in place. Costs a transient copy of those weights.
  """
  if is_merged(params):
    raise ValueError("merge_decode_weights: the params are merged already (they hold 'wqkv' "
                     "or chained matrices); pass the plain params")
  if fold_norms and (cfg.norm_plus_one or cfg.post_norms):
    raise ValueError("merge_decode_weights: fold_norms=True folds plain RMSNorm weights into "
                     f"the matrices; architecture {cfg.architecture!r} has (1 + w) norms and "
                     "post-norms, which do not fold: use fold_norms=False")
  p = dict(unbox(params))
  lw = dict(p["layers"])
  dt, lead = cfg.jnp_dtype, lw["wq"].shape[:-2]
  # With `fold_norms`, the norm weight scales row d of each matrix it feeds.
  scales = {}
  if fold_norms:
    attn, mlp = (lw.pop(n).astype(jnp.float32)[..., :, None] for n in ("attn_norm", "mlp_norm"))
    scales = dict(wq=attn, wk=attn, wv=attn, w_gate=mlp, w_up=mlp)

  def flat(n):
    w = lw.pop(n).reshape(*lead, -1)
    return (w.astype(jnp.float32) * scales[n]).astype(dt) if scales else w.astype(dt)
  lw["wqkv"] = jnp.concatenate([flat(n) for n in ("wq", "wk", "wv")], axis=-1)
  lw["w_gate_up"] = jnp.concatenate([flat(n) for n in ("w_gate", "w_up")], axis=-1)
  if "bq" in lw:  # the biases as one `[H + 2 KV, hd]` per layer, in the projection's order
    lw["bqkv"] = jnp.concatenate([lw.pop(n).astype(dt) for n in ("bq", "bk", "bv")], axis=-2)
  if "q_norm" in lw:  # Qwen3's q and k norm weights as one `[2, hd]` per layer
    lw["qk_norms"] = jnp.stack([lw.pop("q_norm"), lw.pop("k_norm")], axis=-2)
  p["layers"] = lw
  return p


def is_chained(params: Params) -> bool:
  """Whether `params` hold `chain_decode_weights`'s matrices."""
  return "chain" in unbox(params)


def is_merged(params: Params) -> bool:
  """Whether `params` already hold `merge_decode_weights`'s merged matrices (or
  `chain_decode_weights`'s, made from them)."""
  layers = unbox(params)["layers"]
  first = layers[0] if isinstance(layers, (tuple, list)) else layers
  return "wqkv" in first or is_chained(params)


def norms_folded(params: Params) -> bool:
  """Whether `params` (or one layer's dict of them) hold merged weights with the layer norms
  folded in (`merge_decode_weights(fold_norms=True)`)."""
  if is_chained(params):  # `chain_decode_weights` of folded ones
    return True
  p = unbox(params)
  layers = p.get("layers", p)
  first = layers[0] if isinstance(layers, (tuple, list)) else layers
  return "wqkv" in first and "attn_norm" not in first


def chain_decode_weights(params: Params, cfg: ModelConfig) -> dict[str, Any]:
  """Folded merged weights (`merge_decode_weights(fold_norms=True)`) rearranged so that a decode
  layer runs two GEMMs instead of four: with the norms folded in, the next projection is linear
  in the unnormed residual stream, so it can be taken through the product that makes that
  stream. With x the stream entering layer l, a its attention output, x' = x + a Wo, f the
  MLP's activation and x'' = x' + f Wd (the next layer's input):

    [x | a]  @ [[I, Wgu], [Wo, Wo Wgu]]             = [x'  | x' Wgu]          ("a", per layer)
    [x' | f] @ [[I, Wqkv_next], [Wd, Wd Wqkv_next]] = [x'' | x'' Wqkv_next]   ("b", per layer)

  (Wgu, Wqkv the folded matrices; the products of weights are made in float32 at the highest
  precision and rounded to the compute dtype once.) The stream rides along in the first D
  columns, where the decode kernels read the norms' row scales from it and copy it into their
  outputs (`decoder.decode_in_place`). The first layer's [x | x Wqkv] comes from "in" =
  [I | Wqkv_0] and the last layer's x'' from "out" = [[I], [Wd]]. Returns the folded params with
  "chain" = {"in": [D, D + Q], "a": [L, D + H hd, D + 2 F], "b": [L - 1, D + F, D + Q], "out":
  [D + F, D]} (Q = (H + 2 KV) hd), and the layers' matrices the chain replaces dropped ("wqkv",
  "w_gate_up", "wo", "w_down"; the layers keep their biases and q / k norms).

  The same function up to rounding. It multiplies more: 2.1x the matrices' elements for
  SmolLM2-135M, which at a few hundred rows is cheaper than two more GEMM launches a layer for
  it, and dearer for Qwen2.5-0.5B and larger ones (`chained_layer_bytes`;
  `EngineConfig.decode_chain_weights`)."""
  p = dict(unbox(params))
  if not norms_folded(p):
    raise ValueError("chain_decode_weights: needs merge_decode_weights(fold_norms=True) params")
  if cfg.d_model % cfg.head_dim:
    raise ValueError(f"chain_decode_weights: d_model {cfg.d_model} must be a multiple of "
                     f"head_dim {cfg.head_dim} (the stream rides in the kernels' head rows)")
  lw = dict(p["layers"])
  dt, f32, d = cfg.jnp_dtype, jnp.float32, cfg.d_model
  hi = jax.lax.Precision.HIGHEST
  wqkv, wgu = lw.pop("wqkv").astype(f32), lw.pop("w_gate_up").astype(f32)
  wo = lw.pop("wo").astype(f32).reshape(cfg.n_layers, -1, d)  # [L, H hd, D]
  wd = lw.pop("w_down").astype(f32)  # [L, F, D]
  eye = lambda n: jnp.broadcast_to(jnp.eye(d, dtype=f32), (n, d, d))
  prod = lambda a, b: jnp.matmul(a, b, precision=hi)
  n = cfg.n_layers
  a = jnp.concatenate([jnp.concatenate([eye(n), wgu], -1),
                       jnp.concatenate([wo, prod(wo, wgu)], -1)], -2)
  nxt = wqkv[1:]
  b = jnp.concatenate([jnp.concatenate([eye(n - 1), nxt], -1),
                       jnp.concatenate([wd[:-1], prod(wd[:-1], nxt)], -1)], -2)
  p["chain"] = {"in": jnp.concatenate([jnp.eye(d, dtype=f32), wqkv[0]], -1).astype(dt),
                "a": a.astype(dt), "b": b.astype(dt),
                "out": jnp.concatenate([jnp.eye(d, dtype=f32), wd[-1]], -2).astype(dt)}
  p["layers"] = lw
  return p


def chained_layer_bytes(cfg: ModelConfig) -> int:
  """Bytes of one layer's two chained matrices (`chain_decode_weights`)."""
  d, f, hd = cfg.d_model, cfg.ffn_dim, cfg.head_dim
  q = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
  elems = (d + cfg.n_heads * hd) * (d + 2 * f) + (d + f) * (d + q)
  return elems * jnp.dtype(cfg.jnp_dtype).itemsize


def merged_decode_weight_bytes(cfg: ModelConfig) -> int:
  """Bytes of the merged matrices `merge_decode_weights` makes (the copy it costs)."""
  cols = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + 2 * cfg.ffn_dim
  return cfg.n_layers * cfg.d_model * cols * jnp.dtype(cfg.jnp_dtype).itemsize


def unstack_layers(params: Params) -> dict[str, Any]:
  """`params` with "layers" as a tuple of per-layer dicts of plain arrays (the stacked
  `[n_layers, ...]` weights cut once); `hidden_states` runs such params with an unrolled loop.
  The other entries are kept as they are (boxed or not)."""
  out = dict(params)
  layers = unbox(params["layers"])
  n = jax.tree.leaves(layers)[0].shape[0]
  out["layers"] = tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n))
  return out


def stack_layers(tree: dict[str, Any], like: Params) -> Params:
  """Inverse of `unstack_layers` for a tree shaped like its output (e.g. gradients): the
  per-layer dicts stacked back into `like`'s "layers" (boxed as `like`'s are)."""
  out = dict(tree)
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *tree["layers"])
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
  out["layers"] = jax.tree.map(
      lambda ref, a: ref.replace_boxed(a) if is_box(ref) else a, like["layers"], stacked,
      is_leaf=is_box)
  return out
