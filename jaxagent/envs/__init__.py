"""Tasks: prompts, tools, parsers and verifiers behind the `Env` contract (`jaxagent.agent.env`).

    env = jaxagent.envs.make_env("quickstart", max_terms=5)   # or "math_tool", "search_qa", "code"
    env.examples("train"), env.examples("eval")
"""
from __future__ import annotations

import importlib

# name -> "module:class" (imported lazily: tasks pull optional packages).
REGISTRY = {
    "quickstart": "jaxagent.envs.quickstart:ArithmeticToolEnv",
    "calculator": "jaxagent.agent.env:CalculatorEnv",
    "math_tool": "jaxagent.envs.math_tool:MathToolEnv",    # ReTool: GSM-style math + Python
    "search_qa": "jaxagent.envs.search_qa:SearchQAEnv",    # Search-R1: multi-hop QA + BM25
    "code": "jaxagent.envs.code:CodeEnv",                  # HumanEval + unit tests
}


def make_env(name: str, **kwargs):
  """Build a registered task by name with its keyword settings."""
  if name not in REGISTRY:
    raise ValueError(f"unknown env {name!r}; registered envs: {sorted(REGISTRY)}")
  module, cls = REGISTRY[name].split(":")
  try:
    return getattr(importlib.import_module(module), cls)(**kwargs)
  except TypeError as e:
    raise ValueError(f"bad settings for env {name!r}: {e}") from e
