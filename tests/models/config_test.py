"""`ModelConfig` validation, presets against the published model sizes, `run_overrides`."""
import ml_collections
import numpy as np
import pytest

from jaxagent.models.config import PRESETS, RUN_MODEL_KEYS, ModelConfig, run_overrides

TINY = PRESETS["tiny-llama"]


@pytest.mark.parametrize("field,value", [
    ("n_layers", True), ("vocab_size", 3.0), ("rope_theta", 0.0), ("rope_theta", -1.0),
    ("rope_theta", float("nan")), ("norm_eps", -1e-5), ("norm_eps", float("inf")),
    ("tie_embeddings", "no"), ("qkv_bias", 1), ("qk_norm", "yes"),
    ("rope_scaling", (32.0, 1.0, 4.0)), ("rope_scaling", (0.0, 1.0, 4.0, 8192)),
    ("rope_scaling", (32.0, 4.0, 1.0, 8192)), ("rope_scaling", (32.0, 1.0, 1.0, 8192)),
    ("rope_scaling", (32.0, 1.0, 4.0, 0)), ("rope_scaling", "abcd"),
    ("eos_token_id", -1), ("eos_token_id", 512), ("eos_token_id", "2"), ("bos_token_id", -1),
    ("extra_eos_token_ids", (600,)), ("extra_eos_token_ids", (-1,)), ("extra_eos_token_ids", 5),
])
def test_bad_field_value_is_refused_naming_the_field(field, value):
  with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
    TINY.replace(**{field: value})


def test_numpy_bools_are_taken_for_every_bool_field():
  # scan_layers refused np.bool_ ("must be a bool, got np.False_") where the other flags took it.
  cfg = TINY.replace(scan_layers=np.False_, qk_norm=np.False_)
  assert cfg.scan_layers is False and cfg.qk_norm is False
  with pytest.raises(ValueError, match=r"ModelConfig.scan_layers must be a bool \(True or False\), got 'no'"):
    TINY.replace(scan_layers="no")


def test_a_preset_resized_to_a_smaller_tokenizer_keeps_its_bos_id():
  # The trainer resizes a preset's vocabulary to the run's tokenizer and sets its eos id only.
  cfg = PRESETS["llama3.2-1b"].replace(vocab_size=49152, eos_token_id=2)
  assert cfg.bos_token_id == 128000


def test_lists_and_numpy_scalars_are_normalised_so_the_config_stays_hashable():
  cfg = TINY.replace(rope_scaling=[32, 1, 4, 8192], extra_eos_token_ids=[3, np.int64(4)],
                     eos_token_id=np.uint32(2), tie_embeddings=np.bool_(False))
  hash(cfg)
  assert cfg.rope_scaling == (32.0, 1.0, 4.0, 8192)
  assert cfg.extra_eos_token_ids == (3, 4) and type(cfg.extra_eos_token_ids[1]) is int
  assert type(cfg.eos_token_id) is int and cfg.tie_embeddings is False
  assert cfg == TINY.replace(rope_scaling=(32.0, 1.0, 4.0, 8192), extra_eos_token_ids=(3, 4),
                             eos_token_id=2, tie_embeddings=False)


def test_numpy_floats_and_dtypes_are_stored_as_python_values_so_the_config_serialises():
  # np.float32 is no Python float and an array's np.dtype no str: both were kept as given,
  # and save_hf's config.json (to_hf) and the checkpoint's metadata failed to write them
  # ("Object of type float32 is not JSON serializable"); the dtype also equalled its name but
  # hashed otherwise.
  import json
  cfg = TINY.replace(rope_theta=np.float32(5e5), norm_eps=np.float32(1e-5),
                     param_dtype=np.dtype("float32"), dtype=np.dtype(np.float16))
  assert type(cfg.rope_theta) is float and type(cfg.norm_eps) is float
  assert cfg.norm_eps == float(np.float32(1e-5))  # the value given, not re-rounded
  assert (cfg.param_dtype, cfg.dtype) == ("float32", "float16")
  same = TINY.replace(rope_theta=5e5, norm_eps=float(np.float32(1e-5)), dtype="float16")
  assert cfg == same and hash(cfg) == hash(same)
  json.dumps(cfg.to_hf())


def test_to_hf_keeps_extra_eos_ids_without_an_eos_token_id():
  # Generation stops on extra_eos_token_ids whether or not eos_token_id is set; to_hf wrote
  # them only beside an eos_token_id, so such a config's export (and its reload) had no stop id.
  for extra, eos in [((5,), None), ((5, 7), None), ((7,), 3), ((), 3)]:
    cfg = TINY.replace(eos_token_id=eos, extra_eos_token_ids=extra)
    assert ModelConfig.from_hf(cfg.to_hf()).eos_token_ids == cfg.eos_token_ids
  assert TINY.replace(eos_token_id=3).to_hf()["eos_token_id"] == 3
  assert "eos_token_id" not in TINY.replace(eos_token_id=None).to_hf()


def test_to_hf_refuses_q_k_norms_the_architecture_lacks():
  with pytest.raises(ValueError, match="qk_norm"):
    TINY.replace(qk_norm=True).to_hf()
  with pytest.raises(ValueError, match="qk_norm"):
    PRESETS["tiny-qwen3"].replace(qk_norm=False).to_hf()
  assert PRESETS["tiny-qwen3"].replace(qkv_bias=True).to_hf()["attention_bias"] is True


# Published sizes: the model cards (SmolLM2 135M; Qwen2.5 0.49B, 1.54B, 3.09B, 7.61B;
# Qwen3 0.6B with 0.44B non-embedding, 1.7B with 1.4B; Llama 3.2 1.23B, 3.21B).
@pytest.mark.parametrize("name,total,non_embedding", [
    ("smollm2-135m", 134.5e6, None), ("qwen2.5-0.5b", 0.49e9, 0.36e9),
    ("qwen2.5-1.5b", 1.54e9, 1.31e9), ("qwen2.5-3b", 3.09e9, 2.77e9),
    ("qwen2.5-7b", 7.61e9, 6.53e9), ("qwen3-0.6b", 0.596e9, 0.44e9),
    ("qwen3-1.7b", 1.72e9, 1.4e9), ("llama3.2-1b", 1.236e9, None),
    ("llama3.2-3b", 3.21e9, None)])
def test_preset_parameter_counts_match_the_published_sizes(name, total, non_embedding):
  cfg = PRESETS[name]
  n = cfg.num_params()
  assert abs(n - total) / total < 0.01, (name, n)
  if non_embedding is not None:
    embed = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    assert abs(n - embed - non_embedding) / non_embedding < 0.01, (name, n - embed)


def _model_section(**extra):
  return ml_collections.ConfigDict(dict(
      path="tiny-llama", tokenizer="", param_dtype="float32", dtype="bfloat16", remat="full",
      init_std=0.02, init_seed=0, scan_layers=True, attention="xla", logprob="auto",
      norm_rope="auto", **extra))


def test_run_overrides_reads_the_section():
  kw = run_overrides(_model_section())
  assert kw["dtype"] == "bfloat16" and kw["attention_impl"] == "xla"
  assert TINY.replace(**kw).remat == "full"


def test_run_overrides_refuses_unknown_keys_with_a_hint():
  with pytest.raises(ValueError, match=r"model.attention_impl \(did you mean model.attention"):
    run_overrides(_model_section(attention_impl="pallas"))


def test_run_model_keys_are_the_quickstart_model_section():
  # The trainer's known `model.*` keys are these; the quickstart config sets every key a run reads.
  from configs.quickstart import get_config
  assert set(RUN_MODEL_KEYS) == set(get_config().model.keys())


def test_valid_presets_build():
  for cfg in PRESETS.values():
    assert isinstance(cfg, ModelConfig)
    hash(cfg)


def test_from_hf_null_fields():
  """null in an HF config.json: key / value heads default to one per query head (as the
  reference implementation reads it); a required or numeric field that is null is named."""
  hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": None,
        "intermediate_size": 128}
  assert ModelConfig.from_hf(hf).n_kv_heads == 4
  assert ModelConfig.from_hf({**hf, "num_key_value_heads": 2}).n_kv_heads == 2
  for key in ("rope_theta", "rms_norm_eps", "max_position_embeddings"):
    with pytest.raises(ValueError, match=f"HF config: {key}=None must be a number"):
      ModelConfig.from_hf({**hf, key: None})
  with pytest.raises(ValueError, match="HF config: rope_theta='1e4' must be a number"):
    ModelConfig.from_hf({**hf, "rope_theta": "1e4"})
  with pytest.raises(ValueError, match="required field 'intermediate_size' is null"):
    ModelConfig.from_hf({**hf, "intermediate_size": None})
  with pytest.raises(ValueError, match="required field 'intermediate_size' is missing"):
    ModelConfig.from_hf({k: v for k, v in hf.items() if k != "intermediate_size"})
  cfg = ModelConfig.from_hf({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
  assert cfg.rope_theta == 5e5


def test_from_hf_keeps_a_long_context_for_export():
  """A 128k context (Llama 3.x, Qwen2.5) was read as 32768, and an export wrote 32768 into its
  config.json. Nothing is sized by max_seq_len (caches take the engine's max_len)."""
  hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "max_position_embeddings": 131072}
  cfg = ModelConfig.from_hf(hf)
  assert cfg.max_seq_len == 131072 and cfg.to_hf()["max_position_embeddings"] == 131072
  assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_models_generate_and_losses_import_without_the_config_machinery():
  # Their import path needs only jax / flax / optax (what a serving or GPU image has): the run
  # config machinery (ml_collections) is for the entry points.
  import subprocess
  import sys
  code = ("import sys; import jaxagent.models, jaxagent.generate, jaxagent.rl; "
          "print(sorted(m for m in ('ml_collections',) if m in sys.modules))")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                     env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


_HF_LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128}
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}


def test_from_hf_reads_rope_theta_where_transformers_does():
  # transformers 5 reads `rope_scaling` in place of `rope_parameters` and a rope_theta inside
  # it before the top-level one (`AutoConfig.from_pretrained` on these dicts gives 5e5).
  assert ModelConfig.from_hf({**_HF_LLAMA, "rope_scaling": {**_LLAMA3, "rope_theta": 5e5}}
                             ).rope_theta == 5e5
  assert ModelConfig.from_hf({**_HF_LLAMA, "rope_parameters": {**_LLAMA3, "rope_theta": 5e5}}
                             ).rope_scaling == (8.0, 1.0, 4.0, 64)
  agree = {**_HF_LLAMA, "rope_theta": 5e5, "rope_parameters": {"rope_type": "default",
                                                               "rope_theta": 500000}}
  assert ModelConfig.from_hf(agree).rope_theta == 5e5
  same = {**_HF_LLAMA, "rope_scaling": {**_LLAMA3, "type": "llama3"}, "rope_parameters": _LLAMA3}
  assert ModelConfig.from_hf(same).rope_scaling == (8.0, 1.0, 4.0, 64)


@pytest.mark.parametrize("rope,match", [
    # Read as 1e4 here and as 5e5 by transformers 5 (which reads the inner one).
    (dict(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
     "rope_theta=10000.0 at the top level and rope_theta=500000.0 in the rope settings"),
    (dict(rope_theta=1e4, rope_scaling={**_LLAMA3, "rope_theta": 5e5}), "disagree"),
    # transformers 5 ignores rope_parameters (and its theta) when rope_scaling is given.
    (dict(rope_scaling=_LLAMA3, rope_parameters={"rope_type": "default", "rope_theta": 3e5}),
     "rope_scaling=.* and rope_parameters=.* disagree"),
    (dict(rope_parameters=[1e4]), "rope_parameters=\\[10000.0\\] must be an object"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}), "must be a number"),
])
def test_from_hf_refuses_rope_settings_that_disagree(rope, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf({**_HF_LLAMA, **rope})


@pytest.mark.parametrize("changes,match", [
    # These escaped as bare TypeErrors (from float(), or hidden_size // heads) that named
    # neither the field nor, through models.load, the file.
    (dict(rope_scaling={**_LLAMA3, "factor": None}), r"llama3 rope scaling factor=None must be a number"),
    (dict(rope_scaling={**_LLAMA3, "high_freq_factor": [4]}), r"high_freq_factor=\[4\] must be a number"),
    (dict(rope_parameters={**_LLAMA3, "low_freq_factor": "1"}), r"low_freq_factor='1' must be a number"),
    (dict(num_attention_heads="4"), r"num_attention_heads='4' must be a positive int"),
    (dict(hidden_size=[64]), r"hidden_size=\[64\] must be a positive int"),
    (dict(num_attention_heads=0), r"num_attention_heads=0 must be a positive int"),
    (dict(architectures="LlamaForCausalLM"), r"architectures='LlamaForCausalLM' must be a list"),
    (dict(architectures=1.5), r"architectures=1.5 must be a list"),
    # Truncated to 8192 before.
    (dict(rope_scaling={**_LLAMA3, "original_max_position_embeddings": 8192.5}),
     r"original_max_position_embeddings=8192.5 must be an int"),
    # A listed eos id went through int(): 2.5 became the stop id 2 and true the id 1, and a
    # null escaped as a bare TypeError. A single id was checked already.
    (dict(eos_token_id=[2.5, 3]), r"eos_token_id: 2\.5 is not a token id"),
    (dict(eos_token_id=[2, True]), r"extra_eos_token_ids: True is not a token id"),
    (dict(eos_token_id=[2, None]), r"extra_eos_token_ids: None is not a token id"),
])
def test_from_hf_malformed_fields_are_named(changes, match):
  hf = {k: v for k, v in _HF_LLAMA.items() if k != "head_dim"}
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf({**hf, **changes})
  assert ModelConfig.from_hf({**hf, "rope_scaling": {**_LLAMA3, "original_max_position_embeddings": 64.0}}
                             ).rope_scaling == (8.0, 1.0, 4.0, 64)


def test_from_hf_qwen3_head_dim_defaults_as_in_transformers():
  # transformers' Qwen3Config defaults head_dim to 128, whatever hidden_size / heads is.
  hf = {**_HF_LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
  assert ModelConfig.from_hf(hf).head_dim == 128
  assert ModelConfig.from_hf({**hf, "head_dim": 16}).head_dim == 16
  assert ModelConfig.from_hf(_HF_LLAMA).head_dim == 16


_HF_MISTRAL = {**_HF_LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
               "max_position_embeddings": 512}


@pytest.mark.parametrize("hf", [
    # transformers' Mistral applies sliding_window whatever use_sliding_window says...
    {**_HF_MISTRAL, "sliding_window": 16, "use_sliding_window": False},
    # ... and the class named in `architectures` is Mistral's without a model_type too.
    {k: v for k, v in {**_HF_MISTRAL, "sliding_window": 16}.items() if k != "model_type"},
    {**_HF_MISTRAL, "sliding_window": 16},
])
def test_from_hf_reads_a_mistral_window_shorter_than_the_sequences(hf):
  # (Both were once loaded with full attention: logits 0.3 apart from transformers' after 16
  # tokens; then refused.) Every Mistral layer is windowed.
  cfg = ModelConfig.from_hf(hf)
  assert (cfg.sliding_window, cfg.sliding_layers) == (16, (0, 1))
  # Sequences no longer than the window: it masks nothing, so none is kept.
  assert ModelConfig.from_hf(hf, max_seq_len=16).sliding_window is None
  assert ModelConfig.from_hf(hf, max_seq_len=17).sliding_window == 16
  assert ModelConfig.from_hf(cfg.to_hf()) == cfg.replace(name="hf")


def test_from_hf_a_mistral_config_without_sliding_window_has_transformers_default_window():
  # transformers' MistralConfig defaults sliding_window to 4096; such a config loaded with full
  # attention over 8192 tokens.
  hf = {**_HF_MISTRAL, "max_position_embeddings": 8192}
  assert ModelConfig.from_hf(hf).sliding_window == 4096
  assert ModelConfig.from_hf(hf, max_seq_len=4096).sliding_window is None
  # Llama has no window: the same fields under it load as they are.
  cfg = ModelConfig.from_hf({**_HF_LLAMA, "max_position_embeddings": 8192})
  assert cfg.max_seq_len == 8192 and cfg.sliding_window is None


@pytest.mark.parametrize("arch,model_type,expected", [
    ("LlamaForCausalLM", "llama", 2048), ("Qwen2ForCausalLM", "qwen2", 32768),
    ("Qwen3ForCausalLM", "qwen3", 32768), ("MistralForCausalLM", "mistral", 131072)])
def test_from_hf_without_max_position_embeddings_takes_the_architectures_default(
    arch, model_type, expected):
  # Every architecture got 4096: a Qwen2 config.json without the key served at most 4096
  # tokens, and a Llama one accepted sequences its rope was never set up for.
  hf = {**_HF_LLAMA, "architectures": [arch], "model_type": model_type, "sliding_window": None}
  hf.pop("max_position_embeddings", None)
  assert ModelConfig.from_hf(hf).max_seq_len == expected


def test_from_hf_mistral_windows_that_mask_nothing_are_accepted():
  assert ModelConfig.from_hf({**_HF_MISTRAL, "sliding_window": None}).max_seq_len == 512
  assert ModelConfig.from_hf({**_HF_MISTRAL, "sliding_window": 512}).sliding_window is None
  # A Qwen2 window is used only with use_sliding_window.
  qwen2 = {**_HF_LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
           "sliding_window": 16}
  assert ModelConfig.from_hf(qwen2).sliding_window is None
  cfg = ModelConfig.from_hf({**qwen2, "use_sliding_window": True, "max_window_layers": 1})
  assert (cfg.sliding_window, cfg.sliding_layers) == (16, (1,))
  with pytest.raises(ValueError, match="sliding_window='16' must be a number or null"):
    ModelConfig.from_hf({**_HF_MISTRAL, "sliding_window": "16"})
  with pytest.raises(ValueError, match="sliding_window=16.5 must be a positive int"):
    ModelConfig.from_hf({**_HF_MISTRAL, "sliding_window": 16.5})


_HF_QWEN2 = {**_HF_LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
             "use_sliding_window": True, "sliding_window": 16}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("changes", [
    # transformers windows only the layers from max_window_layers (default 28) on: none of 2.
    {}, {"max_window_layers": 2},
    # ... or those layer_types names, which it reads in place of max_window_layers.
    {"max_window_layers": 0, "layer_types": ["full_attention", "full_attention"]},
    # A window as long as the sequences masks nothing.
    {"max_window_layers": 0, "sliding_window": 4096, "max_position_embeddings": 4096},
    # Without use_sliding_window the window is not used at all.
    {"max_window_layers": 0, "use_sliding_window": False},
    {"max_window_layers": 0, "sliding_window": None},
])
def test_from_hf_qwen_configs_transformers_runs_with_full_attention_have_no_window(arch,
                                                                                   changes):
  hf = {**_HF_QWEN2, "architectures": [arch.capitalize() + "ForCausalLM"], "model_type": arch,
        "head_dim": 16, **changes}
  cfg = ModelConfig.from_hf(hf)
  assert cfg.architecture == arch and cfg.sliding_window is None


@pytest.mark.parametrize("changes,layers", [
    ({"max_window_layers": 1}, (1,)),
    ({"layer_types": ["sliding_attention", "full_attention"]}, (0,)),
    # transformers' Qwen2Config defaults the window to 4096.
    ({"max_window_layers": 0, "sliding_window": 4096, "max_position_embeddings": 8192},
     (0, 1)),
])
def test_from_hf_qwen_layers_that_a_window_cuts_are_windowed(changes, layers):
  cfg = ModelConfig.from_hf({**_HF_QWEN2, **changes})
  assert cfg.sliding_layers == layers
  back = ModelConfig.from_hf(cfg.to_hf())
  assert back == cfg.replace(name="hf")


@pytest.mark.parametrize("changes,match", [
    ({"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": False},
     r"layer_types makes layer\(s\) \[1\] 'sliding_attention' but no window is set"),
    ({"layer_types": ["full_attention"]}, r"layer_types=\['full_attention'\] must list one of "
                                          r".*num_hidden_layers=2"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "must list one of"),
    ({"max_window_layers": None}, r"max_window_layers=None must be an int"),
])
def test_from_hf_qwen_bad_window_settings_are_refused(changes, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf({**_HF_QWEN2, **changes})


def test_from_hf_a_qwen_window_left_out_is_transformers_default():
  hf = {k: v for k, v in _HF_QWEN2.items() if k != "sliding_window"}
  hf.update(max_window_layers=0, max_position_embeddings=8192)
  assert ModelConfig.from_hf(hf).sliding_window == 4096
  assert ModelConfig.from_hf(hf, max_seq_len=4096).sliding_window is None
