"""Ahead-of-time planning: will a run fit, how fast will it go, what does it communicate.

    report = jaxagent.plan.plan_run(config, "v5p:4x4x4")   # a TPU topology, compiled on a CPU
    print(report.render()); report.fits; report.program("generate").total_bytes

`python -m jaxagent.plan --config=configs/<name>.py --topology=v5e:4x4` prints the same report,
and `python -m jaxagent.launch` runs `check_fit` on the real devices before the first step.
Files: `planner.py` (config -> shapes -> compiled programs), `report.py` (memory, verdict,
knobs, rendering), `hlo.py` (loop-aware flops, bytes and collectives from compiled HLO text),
`chips.py` (per-chip capacity and peaks; TPU topologies, or Cloud TPU accelerator types such as
`v5litepod-16`, through libtpu).
"""
import importlib

# Each name's module, imported on first use (`jaxagent.plan.plan_run`, `from jaxagent.plan
# import check_fit`): the planner imports jax, and `python -m jaxagent.plan` names a misspelt
# flag or config key before that import.
_EXPORTS = {
    "chips": ("CHIPS", "ChipSpec", "chip_for", "devices_for", "has_libtpu", "resolve_topology"),
    "hlo": ("HloStats", "analyze"),
    "planner": ("DoesNotFit", "PlanOptions", "check_fit", "learner_parts", "model_config",
                "plan_run", "run_shapes", "runs_score"),
    "report": ("PlanReport", "ProgramReport", "RunShapes", "knobs"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
  module = _MODULE_OF.get(name)
  if module is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_MODULE_OF))


__all__ = [
    "CHIPS", "ChipSpec", "DoesNotFit", "HloStats", "PlanOptions", "PlanReport", "ProgramReport",
    "RunShapes", "analyze", "check_fit", "chip_for", "devices_for", "has_libtpu", "knobs",
    "learner_parts", "model_config", "plan_run", "resolve_topology", "run_shapes", "runs_score",
]
