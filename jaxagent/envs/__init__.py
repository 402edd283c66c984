"""Tasks: prompts, tools, parsers and verifiers behind the `Env` contract (`jaxagent.agent.env`).

    env = jaxagent.envs.make_env("quickstart", max_terms=5)   # or "math_tool", "search_qa", "code"
    env.examples("train"), env.examples("eval")
"""
from __future__ import annotations

import difflib
import importlib
import inspect

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
  env_cls = getattr(importlib.import_module(module), cls)
  params = inspect.signature(env_cls).parameters
  if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
    allowed = sorted(n for n, p in params.items()
                     if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
    for key in kwargs:
      if key not in allowed:
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"bad settings for env {name!r}: unknown setting {key!r}{hint}; its "
                         f"settings are: {allowed}")
  try:
    return env_cls(**kwargs)
  except TypeError as e:
    raise ValueError(f"bad settings for env {name!r}: {e}") from e
