"""Models: one decoder definition for training and sampling, weight I/O and tokenizers.

    cfg, params = jaxagent.models.load("smollm2-135m-instruct")
    tok = jaxagent.models.load_tokenizer("smollm2-135m-instruct")
    logits = jaxagent.models.forward(params, tokens, cfg=cfg, segment_ids=seg)
"""
from jaxagent.models.config import EMBEDDED, PRESETS, ModelConfig, get_config
from jaxagent.models.decoder import (extend, forward, hidden_states, prefill, segment_positions,
                                     write_kv)
from jaxagent.models.logprobs import logits_from_hidden, token_logprobs
from jaxagent.models.param_tree import box, init_params, logical_axes, param_specs, unbox
from jaxagent.models.hf import load, save_hf


def load_tokenizer(path_or_preset):
  """A `Tokenizer` from an HF directory, a `.gguf` file or an embedded preset name."""
  from jaxagent.models.tokenizer import load_tokenizer as _load
  return _load(path_or_preset)


__all__ = [
    "EMBEDDED", "PRESETS", "ModelConfig", "get_config", "box", "extend", "forward",
    "hidden_states", "init_params", "load", "load_tokenizer", "logical_axes",
    "logits_from_hidden", "param_specs", "prefill", "save_hf", "segment_positions",
    "token_logprobs", "unbox", "write_kv",
]
