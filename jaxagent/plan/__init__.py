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
from jaxagent.plan.chips import (CHIPS, ChipSpec, chip_for, devices_for, has_libtpu,
                                 resolve_topology)
from jaxagent.plan.hlo import HloStats, analyze
from jaxagent.plan.planner import (DoesNotFit, PlanOptions, check_fit, learner_parts,
                                   model_config, plan_run, run_shapes, runs_score)
from jaxagent.plan.report import PlanReport, ProgramReport, RunShapes, knobs

__all__ = [
    "CHIPS", "ChipSpec", "DoesNotFit", "HloStats", "PlanOptions", "PlanReport", "ProgramReport",
    "RunShapes", "analyze", "check_fit", "chip_for", "devices_for", "has_libtpu", "knobs",
    "learner_parts", "model_config", "plan_run", "resolve_topology", "run_shapes", "runs_score",
]
