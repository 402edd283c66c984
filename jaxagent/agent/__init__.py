"""The multi-turn agent loop: rollout driver, trajectory ledgers, tool-call parsers, env contract.

    env = CalculatorEnv()
    trajs = rollout(engine, params, env, examples, tokenizer=tok, num_samples=8,
                    cfg=RolloutConfig(max_turns=4, max_tokens_per_turn=128))
    items = [t.to_pack_item(advantage=a) for t, a in zip(trajs, advantages)]

Data flow: `envs/` tasks implement `Env` (`env.py`); `rollout.py` schedules their trajectories onto
the engine's KV slots and their tool calls onto a `tools.ToolExecutor`; each trajectory comes back
as a `Trajectory` token ledger (`trajectory.py`) for `rewards/` and `rl/packing.py`.
"""
from jaxagent.agent.env import (OBSERVATION_TEMPLATES, CalculatorEnv, Env, Episode, Example,
                                NoSplitError, lacks_split)
from jaxagent.agent.parsers import (JSONToolCallParser, ParseResult, Parser, ToolCall,
                                    XMLTagParser)
from jaxagent.agent.rollout import (RolloutCancelled, RolloutConfig, RolloutDriver, RolloutStats,
                                    rollout, rollout_metrics)
from jaxagent.agent.trajectory import (NATURAL_STOPS, OBSERVATION, POLICY, PROMPT, STOP_REASONS,
                                       Role, ToolOutcome, Trajectory, Turn,
                                       demonstration_trajectory)

__all__ = [
    "OBSERVATION_TEMPLATES", "CalculatorEnv", "Env", "Episode", "Example", "NoSplitError",
    "lacks_split", "JSONToolCallParser",
    "ParseResult", "Parser", "ToolCall", "XMLTagParser", "RolloutCancelled", "RolloutConfig",
    "RolloutDriver",
    "RolloutStats", "rollout", "rollout_metrics", "NATURAL_STOPS", "OBSERVATION", "POLICY", "PROMPT",
    "STOP_REASONS", "Role", "ToolOutcome", "Trajectory", "Turn", "demonstration_trajectory",
]
