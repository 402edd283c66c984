"""Rewards: verifiers (math equivalence, EM/F1, unit tests) and shaping (format, tool use, length),
combined with weights into the scalar the advantage estimator consumes.

Data flow: a finished `Trajectory` becomes a `RewardInput` (`Trajectory.to_reward_input`); a
`CompositeReward` of weighted `Component`s, called as `reward(input, step=...)`, returns a
`RewardOutput`: `.total` for `rl/advantages.py`, `.metrics()` for logging.

This package imports no JAX: rewards run on host threads beside the rollout.
"""
from jaxagent.rewards.components import (
    TESTS_PASSED_KEY,
    TESTS_TOTAL_KEY,
    FormatReward,
    LinearLengthReward,
    MathAnswerReward,
    OverlongReward,
    TextMatchReward,
    ToolUseReward,
    UnitTestReward,
)
from jaxagent.rewards.composite import (
    ENV_REWARD_ERROR,
    Component,
    CompositeReward,
    ProgressiveSchedule,
    RewardInput,
    RewardOutput,
    mean_metrics,
)
from jaxagent.rewards.math_verifier import MathVerifier, MathVerifyConfig, default_verifier, math_equal
from jaxagent.rewards.shaping import (
    FormatCheck,
    FormatConfig,
    LinearLengthConfig,
    OverlongConfig,
    ToolShapingConfig,
    check_format,
    format_reward,
    linear_length_penalty,
    overlong_penalty,
    tool_use_reward,
)
from jaxagent.rewards.verifiers import (
    exact_match,
    extract_answer,
    extract_boxed,
    extract_gsm8k,
    extract_tagged,
    f1_score,
    normalize_answer,
    numeric_match,
    substring_exact_match,
    unit_test_reward,
)

__all__ = [
    "TESTS_PASSED_KEY", "TESTS_TOTAL_KEY", "FormatReward", "LinearLengthReward", "MathAnswerReward",
    "OverlongReward", "TextMatchReward", "ToolUseReward", "UnitTestReward", "ENV_REWARD_ERROR",
    "Component", "CompositeReward", "ProgressiveSchedule", "RewardInput", "RewardOutput",
    "mean_metrics", "MathVerifier", "MathVerifyConfig", "default_verifier", "math_equal",
    "FormatCheck", "FormatConfig", "LinearLengthConfig", "OverlongConfig", "ToolShapingConfig",
    "check_format", "format_reward", "linear_length_penalty", "overlong_penalty", "tool_use_reward",
    "exact_match", "extract_answer", "extract_boxed", "extract_gsm8k", "extract_tagged", "f1_score",
    "normalize_answer", "numeric_match", "substring_exact_match", "unit_test_reward",
]
