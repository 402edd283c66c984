"""Tool overlap: do slow tools stall the device? (DESIGN decision 5)

    python benchmarks/tool_overlap.py                      # CPU, tiny-llama, 256 x 4 turns
    python benchmarks/tool_overlap.py --model qwen2.5-1.5b --dtype bfloat16 --slots 256  # a GPU

Runs the same 256 four-turn trajectories twice through `agent.rollout`: once with tools that
sleep `--tool-ms` (200 ms) and once with tools that return at once, and prints the wall times and
their ratio (goal: <= 1.15, i.e. tool latency hidden behind other trajectories' decoding) as the
last line, one JSON object, with the driver's time breakdown of the fastest run of each. Both runs
use the same seed and request ids; `same_tokens` says whether their tokens came out identical (they
do in float32 on CPU; on a GPU the numerics depend on how observations were batched into `append`
calls, which tool timing changes, so sampled ids may differ).

The model is randomly initialised, so the policy cannot know the tool format; a benchmark
tokenizer maps every 16th token id to "|" (the parser's stop string, a call of the `wait` tool)
and the others to "a", so turns end after ~16 tokens at random and every trajectory makes three
calls and is cut at its fourth turn (`max_turns`). Both configurations run untimed until a round
compiles no new program; `compiles_during_timing` counts programs compiled in the timed runs anyway.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax

from jaxagent import models
from jaxagent.agent import Env, Example, ParseResult, RolloutConfig, RolloutDriver, ToolCall
from jaxagent.generate import Engine, EngineConfig, SamplingConfig
from jaxagent.rewards import RewardOutput
from jaxagent.tools import ToolExecutor, ToolRegistry, function_tool


class StripeTokenizer:
  """Benchmark tokenizer: ids divisible by `period` decode to "|", all others to "a"."""

  def __init__(self, vocab_size: int, period: int = 16):
    self.vocab_size, self.period = vocab_size, period

  def decode(self, ids):
    return "".join("|" if int(i) % self.period == 0 else "a" for i in ids)

  def encode(self, text):
    return [1 + (ord(c) % (self.vocab_size - 1)) for c in text]


class WaitEnv(Env):
  """Every turn ends with a call to `wait`, which sleeps `tool_ms` and returns "ok"."""

  name = "wait"
  observation_template = "<obs>{output}</obs>"

  def __init__(self, tool_ms: float):
    class EveryTurnCalls:
      def stop_strings(self):
        return ["|"]

      def parse(self, text):
        return ParseResult("tool_call", call=ToolCall("wait", {}, text))

    @function_tool
    def wait() -> str:
      """Sleep, then answer."""
      time.sleep(tool_ms / 1000)
      return "ok"

    self.parser = EveryTurnCalls()
    self.tools = ToolRegistry([wait])

  def reward(self, trajectory, example, tokenizer, step):
    return RewardOutput(total=0.0, components={}, weights={})


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="tiny-llama", help="model preset (random weights)")
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--trajectories", type=int, default=256)
  ap.add_argument("--samples", type=int, default=4, help="samples per prompt (G)")
  ap.add_argument("--turns", type=int, default=4)
  ap.add_argument("--tool-ms", type=float, default=200.0)
  ap.add_argument("--slots", type=int, default=256)
  ap.add_argument("--decode-steps", type=int, default=8)
  ap.add_argument("--tokens-per-turn", type=int, default=64, help="most tokens per turn")
  ap.add_argument("--turn-tokens", type=int, default=16,
                  help="mean turn length: each sampled token ends the turn with probability "
                       "1 / turn-tokens")
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--max-len", type=int, default=512)
  ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (min is kept)")
  ap.add_argument("--max-warmup", type=int, default=4, help="most untimed warm-up rounds")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  small = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
           if k in ("trajectories", "samples", "turns", "slots", "decode_steps",
                    "tokens_per_turn", "turn_tokens", "prompt_len", "repeats") and v < 1]
  if small:  # --turn-tokens 0 divided by zero inside the rollout; others ran nothing
    ap.error(f"these must be >= 1: {', '.join(small)}")

  cfg = models.get_config(args.model, dtype=args.dtype, param_dtype=args.dtype)
  if args.max_len > cfg.max_seq_len:  # random weights: a tiny preset can take longer contexts
    cfg = dataclasses.replace(cfg, max_seq_len=args.max_len)
  params = models.init_params(cfg, jax.random.key(args.seed), std=0.02)
  engine = Engine(cfg, EngineConfig(slots=args.slots, max_len=args.max_len,
                                    sampling=SamplingConfig(temperature=1.0)))
  tok = StripeTokenizer(cfg.vocab_size, period=args.turn_tokens)
  n_prompts = max(1, args.trajectories // args.samples)
  examples = [Example(f"p{i}", "a" * (args.prompt_len - 1) + chr(ord("b") + i % 20))
              for i in range(n_prompts)]
  rcfg = RolloutConfig(max_turns=args.turns, max_tokens_per_turn=args.tokens_per_turn,
                       decode_steps=args.decode_steps, tool_timeout_s=60.0,
                       traj_tool_timeout_s=600.0)
  jitted = [engine._jit_prefill, engine._jit_insert, engine._jit_generate, engine._jit_append,
            engine._jit_update]

  def compiled():  # programs compiled so far (jax's private cache counter; 0 where it is missing)
    return sum(getattr(f, "_cache_size", lambda: 0)() for f in jitted)

  def run(tool_ms):
    with ToolExecutor(max_workers=args.slots) as ex:
      driver = RolloutDriver(engine, WaitEnv(tool_ms), tokenizer=tok, cfg=rcfg, executor=ex)
      t = time.perf_counter()
      trajs = driver.run(params, examples, num_samples=args.samples, seed=args.seed)
      return time.perf_counter() - t, trajs, driver.stats

  # Compile what both schedules need: tool timing changes how observations batch into `append`
  # calls (batch and cache-length buckets), so warm up until a round compiles nothing new.
  prev = -1
  for _ in range(args.max_warmup):
    for ms in (0.0, args.tool_ms):
      run(ms)
    if compiled() == prev:
      break
    prev = compiled()
  before = compiled()
  times = {0.0: [], args.tool_ms: []}
  tokens, stats, calls, policy = {}, {0.0: [], args.tool_ms: []}, {}, {}
  for _ in range(args.repeats):
    for ms in (0.0, args.tool_ms):
      wall, trajs, st = run(ms)
      times[ms].append(wall)
      tokens[ms] = [t.token_ids for t in trajs]
      stats[ms].append(st)
      calls[ms] = sum(t.num_tool_calls for t in trajs)
      policy[ms] = sum(t.num_policy_tokens for t in trajs)
      print(f"tool {ms:5.0f} ms: {wall:7.2f} s  ({len(trajs)} trajectories, "
            f"{policy[ms]} policy tokens, {calls[ms]} tool calls, generate calls {st.generate_calls}, "
            f"append calls {st.append_calls}, waited on tools {st.tool_wait_s:.2f} s)", flush=True)
  fast, slow = min(times[0.0]), min(times[args.tool_ms])
  best = {ms: stats[ms][times[ms].index(min(times[ms]))] for ms in times}

  def breakdown(st):
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in st.to_dict().items()}

  trajs_n = len(tokens[0.0])
  result = {
      "benchmark": "tool_overlap", "model": args.model, "dtype": args.dtype,
      "device": jax.devices()[0].platform, "trajectories": trajs_n, "turns": args.turns,
      "tool_ms": args.tool_ms, "slots": args.slots, "decode_steps": args.decode_steps,
      "wall_s_no_tools": round(fast, 3), "wall_s_tools": round(slow, 3),
      "ratio": round(slow / fast, 3), "goal": 1.15,
      "wall_s_no_tools_median": round(statistics.median(times[0.0]), 3),
      "wall_s_tools_median": round(statistics.median(times[args.tool_ms]), 3),
      "tool_calls": calls[args.tool_ms],
      "serial_tool_s": round(args.tool_ms / 1000 * calls[args.tool_ms], 1),  # if tools ran one by one
      "policy_tokens": policy[args.tool_ms],
      "stats_no_tools": breakdown(best[0.0]), "stats_tools": breakdown(best[args.tool_ms]),
      "same_tokens": tokens[0.0] == tokens[args.tool_ms],
      "compiles_during_timing": compiled() - before,
  }
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
