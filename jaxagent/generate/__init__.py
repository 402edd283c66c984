"""The generator: JetStream's engine contract in pure JAX, with continuous batching.

    out = jaxagent.generate.generate(params, cfg, prompts, max_new_tokens=64, temperature=1.0)
    out[0].tokens, out[0].logprobs, out[0].stop_reason
"""
from jaxagent.generate.engine import (DecodeState, Engine, EngineConfig, Prefix,
                                      PreparedParams, StepOutput, RUNNING, STOP_BUDGET, STOP_EOS,
                                      STOP_KV_LEN, STOP_LENGTH, STOP_NONFINITE)
from jaxagent.generate.sampling import SamplingConfig, sample, token_keys
from jaxagent.generate.scheduler import Completion, StopChecker, generate, run_requests

__all__ = ["DecodeState", "Engine", "EngineConfig", "Prefix", "PreparedParams", "StepOutput",
           "RUNNING", "STOP_BUDGET", "STOP_EOS", "STOP_KV_LEN", "STOP_LENGTH", "STOP_NONFINITE",
           "SamplingConfig", "sample", "token_keys",
           "Completion", "StopChecker", "generate", "run_requests"]
