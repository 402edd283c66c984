"""A task whose tools come from MCP servers: your questions, the servers' tools, JSON tool calls,
and an answer checked against the gold.

    config.env.name = "mcp_tools"
    config.env.kwargs = {
        "mcp_servers": [{"command": "python", "args": ["my_server.py"], "tools": ["lookup"]}],
        "train_file": "train.jsonl", "eval_file": "eval.jsonl",   # {"question": ..., "answer": ...}
    }

Each `mcp_servers` entry is an `MCPServerConfig` as a dict (`command`, `args`, `env`, `cwd`,
`tools`, `prefix`, `rename`, `timeout_s`, ...; `jaxagent/tools/mcp.py`); the servers start when
the env is built, and their tools are the task's `ToolRegistry`, called through the rollout's
executor like any other tool (argument checks against each tool's input schema, time limits,
failures as observations). Questions come from JSONL, ArrayRecord or Parquet files
(`jaxagent/envs/problem_file.py`).

The policy calls a tool as `<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>`,
reads `<tool_response>...</tool_response>`, and ends with `<answer>...</answer>`. The tools are
listed in the system prompt as `ToolRegistry.describe()` writes them (one line per tool with its
arguments), so any chat template shows them; with `tools_in_template=True` their schemas go to the
chat template as `tools=` instead (for templates that render tools, Qwen2.5's, with their own
instructions). Reward: `match` of the `<answer>` block against the gold (1 or 0), plus
`tool_bonus` times `shaping.tool_use_reward`.
"""
from __future__ import annotations

from typing import Any, Literal, Mapping, Sequence

from jaxagent.agent.env import (OBSERVATION_TEMPLATES, Env, Example, NoSplitError,
                                check_shaping_settings)
from jaxagent.agent.parsers import JSONToolCallParser
from jaxagent.agent.trajectory import Trajectory
from jaxagent.envs.problem_file import read_problems, resolve_problem_file
from jaxagent.rewards import Component, CompositeReward, RewardOutput, TextMatchReward, ToolUseReward

SYSTEM_PROMPT = (
    "You are a helpful assistant with tools. To call a tool, write "
    '<tool_call>{{"name": "<tool>", "arguments": {{...}}}}</tool_call>; its result comes back '
    "between <tool_response> tags. Finish with <answer>your answer</answer>.\n\nTools:\n{tools}")
TEMPLATE_SYSTEM_PROMPT = (  # the chat template lists the tools and says how to call them
    "You are a helpful assistant with tools. Finish with <answer>your answer</answer>.")
TOOL_RESPONSE = "\n<tool_response>\n{output}\n</tool_response>\n"


class MCPToolEnv(Env):
  """Questions answered with the tools of MCP servers (see the module docstring).

  Args:
    mcp_servers: the servers, each a dict of `MCPServerConfig` fields (at least one).
    train_file, eval_file: the questions (a path or glob pattern; "" for no such split).
    question_key, answer_key: the records' keys of the question and its gold answer.
    match: how the answer is compared with the gold (`TextMatchReward.metric`).
    system_prompt: the instructions; `{tools}` is replaced by the tool listing (None: the
      default for `tools_in_template`).
    tools_in_template: give the tool schemas to the chat template instead of the listing.
    observation_template: how a result is shown (`{output}`), or a name in
      `OBSERVATION_TEMPLATES` ("chatml_tool": a tool turn of ChatML templates).
    tool_bonus: weight of the tool-use shaping term (0: the answer alone).
  """

  name = "mcp_tools"
  observation_template = TOOL_RESPONSE

  def __init__(self, *, mcp_servers: Sequence[Mapping[str, Any]], train_file: str = "",
               eval_file: str = "", question_key: str = "question", answer_key: str = "answer",
               match: Literal["exact_match", "f1", "substring_exact_match", "numeric_match"] = "exact_match",
               system_prompt: str | None = None, tools_in_template: bool = False,
               observation_template: str = TOOL_RESPONSE, tool_bonus: float = 0.0):
    from jaxagent.tools.mcp import start_servers  # the `mcp` extra, needed by this task only

    check_shaping_settings("MCPToolEnv", tool_bonus=tool_bonus)
    if not isinstance(tools_in_template, bool):
      raise ValueError(f"MCPToolEnv.tools_in_template must be a bool, got {tools_in_template!r}")
    observation_template = OBSERVATION_TEMPLATES.get(observation_template, observation_template)
    if not isinstance(observation_template, str) or "{output}" not in observation_template:
      raise ValueError("MCPToolEnv.observation_template must be a template with {output}, or one of "
                       f"{sorted(OBSERVATION_TEMPLATES)}, got {observation_template!r}")
    if isinstance(mcp_servers, (str, Mapping)) or not mcp_servers:
      raise ValueError("MCPToolEnv.mcp_servers must be a non-empty list of servers, each a dict such as "
                       f'{{"command": "python", "args": ["server.py"]}}, got {mcp_servers!r}')
    specs = [spec.to_dict() if hasattr(spec, "to_dict") else spec for spec in mcp_servers]  # ConfigDicts
    # A glob pattern's files are listed (and checked) once, here: exactly these are read.
    self._files = {split: resolve_problem_file(path, f"MCPToolEnv.{split}_file")
                   for split, path in (("train", train_file), ("eval", eval_file)) if path}
    self.question_key, self.answer_key = question_key, answer_key
    self.observation_template = observation_template
    self.tools_in_template = tools_in_template
    self.parser = JSONToolCallParser("tool_call", answer_tag="answer")
    self._reward = CompositeReward([
        Component("correct", TextMatchReward(match, fallback=False), 1.0, role="outcome"),
        Component("tool_calls", ToolUseReward(), tool_bonus, role="shaping"),
    ])
    if system_prompt is None:
      system_prompt = TEMPLATE_SYSTEM_PROMPT if tools_in_template else SYSTEM_PROMPT
    try:  # checked before any server starts
      system_prompt.format(tools="")
    except (AttributeError, KeyError, IndexError, ValueError) as e:
      raise ValueError(f"MCPToolEnv.system_prompt must be text whose only field is {{tools}} (other "
                       f"braces doubled, {{{{ }}}}), got {system_prompt!r}: {type(e).__name__}: {e}") from None
    # Last: what fails above leaves no server process behind.
    self.servers, self.tools = start_servers(specs)
    self.system_prompt = system_prompt.format(tools=self.tools.describe())
    self._cache: dict[str, list[Example]] = {}

  def examples(self, split: str) -> Sequence[Example]:
    """The questions of `split` ("train" or "eval"); [] for a split without a file. There are
    no demonstrations: a warm start takes a chat JSONL file (`sft.data`)."""
    if split == "sft":
      raise NoSplitError("MCPToolEnv has no demonstrations to warm-start on", split=split)
    if split not in ("train", "eval"):
      raise NoSplitError(f"unknown split {split!r}; expected 'train' or 'eval'", split=split)
    if split not in self._files:
      return []
    if split not in self._cache:
      path, files = self._files[split]
      problems = read_problems(path, question_key=self.question_key, answer_key=self.answer_key,
                               owner="MCPToolEnv", setting=f"{split}_file", gsm8k_answers=False,
                               files=files, record_keys=())
      self._cache[split] = [
          Example(id=f"{split}-{p.key}", gold=p.gold, metadata={"where": p.where},
                  prompt=({"role": "system", "content": self.system_prompt},
                          {"role": "user", "content": p.question}))
          for p in problems]
    return self._cache[split]

  def render_prompt(self, example: Example, tokenizer) -> list[int]:
    if not self.tools_in_template or isinstance(example.prompt, str):
      return super().render_prompt(example, tokenizer)
    return list(tokenizer.encode_chat(list(example.prompt), add_generation_prompt=True,
                                      tools=self.tools.schemas()))

  def reward(self, trajectory: Trajectory, example: Example, tokenizer, step: int) -> RewardOutput:
    inp = trajectory.to_reward_input(tokenizer, example.gold, metadata=example.metadata,
                                     policy_only=True)
    return self._reward(inp, step=step)

  def close(self) -> None:
    """Closes the MCP servers (also done at interpreter exit)."""
    for server in getattr(self, "servers", ()):
      server.close()


__all__ = ["MCPToolEnv", "SYSTEM_PROMPT", "TEMPLATE_SYSTEM_PROMPT"]
