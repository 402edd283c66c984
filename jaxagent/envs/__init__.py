"""Tasks: prompts, tools, parsers and verifiers behind the `Env` contract (`jaxagent.agent.env`).

    env = jaxagent.envs.make_env("quickstart", max_terms=5)   # or "math_tool", "search_qa", "code"
    env = jaxagent.envs.make_env("mixture", tasks={"arith": {"env": "quickstart"},
                                                   "gsm": {"env": "math_tool"}})
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
    "mixture": "jaxagent.envs.mixture:MixtureEnv",         # several tasks trained at once
    "mcp_tools": "jaxagent.envs.mcp_tools:MCPToolEnv",     # your questions + MCP servers' tools
}


def make_env(name: str, **kwargs):
  """Build a task with its keyword settings: a registered name, or "module:Class" for a task
  of your own (an `Env` subclass in an importable module, e.g. "mytask:ReverseEnv")."""
  if name in REGISTRY:
    module, cls = REGISTRY[name].split(":")
    env_cls = getattr(importlib.import_module(module), cls)
  elif ":" in name:
    env_cls = _import_env(name)
  else:
    raise ValueError(f"unknown env {name!r}; registered envs: {sorted(REGISTRY)}, or name your "
                     "own task's class as 'module:Class'")
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


def _import_env(name: str):
  """The class named by "module:Class", with errors that say what to fix."""
  from jaxagent.agent.env import Env
  module, _, cls = name.partition(":")
  try:
    mod = importlib.import_module(module)
  except ImportError as e:
    missing = getattr(e, "name", None)
    if missing is not None and not (module == missing or module.startswith(missing + ".")):
      # The module was found; an import inside it failed ('put it on the Python path' misled).
      raise ValueError(f"env {name!r}: importing module {module!r} failed inside it: "
                       f"{type(e).__name__}: {e} (traceback above)") from e
    raise ValueError(f"env {name!r}: cannot import module {module!r} ({e}); put it on the Python "
                     "path (e.g. run from its directory, or set PYTHONPATH)") from e
  env_cls = mod
  for part in cls.split("."):
    env_cls = getattr(env_cls, part, None)
  if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
    envs = sorted(k for k, v in vars(mod).items()
                  if isinstance(v, type) and issubclass(v, Env) and v is not Env)
    found = (f"module {module!r} has no attribute {cls!r}" if env_cls is None
             else f"{module}.{cls} is {env_cls!r}")
    raise ValueError(f"env {name!r}: {found}; name a subclass of jaxagent.agent.Env (in "
                     f"{module!r}: {', '.join(envs) or 'none'})")
  return env_cls
