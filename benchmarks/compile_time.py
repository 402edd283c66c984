"""Compile seconds of the generator's programs, per cache layout and attention path.

    python benchmarks/compile_time.py --model smollm2-135m --variants stacked/xla,per_layer/pallas

Every bucket a rollout meets (prompt rows and length, appended rows, chunk length and live
KV) is a separate compilation of a whole-model program, so on a GPU compile time, not decode
speed, can decide how long the first evals and RL steps of a run take. This prints, for one
program of each kind (prefill + insert, a decode call of `--steps` steps, an append), the XLA
backend compile time (`jaxagent.compile_stats`) and the first call's run time after it.
Random-init weights; nothing is read from disk.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from benchmarks.common import emit
from jaxagent import compile_stats, models
from jaxagent.generate import Engine, EngineConfig, SamplingConfig


def measure(fn):
  """(compile seconds, programs compiled, wall seconds) of one call of `fn`."""
  c0, t0 = compile_stats.snapshot(), time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  d = compile_stats.snapshot() - c0
  return d.seconds, d.count, time.perf_counter() - t0, out


def run(model, layout, attention, slots, max_len, rows, prompt_len, chunk, steps, dtype, record):
  cfg = models.get_config(model, param_dtype=dtype, dtype=dtype)
  params = jax.jit(lambda k: models.init_params(cfg, k))(jax.random.key(0))
  eng = Engine(cfg, EngineConfig(slots=slots, max_len=max_len, eos_ids=(),
                                 sampling=SamplingConfig(1.0), decode_attention=attention,
                                 cache_layout=layout))
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, cfg.vocab_size, (rows, prompt_len)).tolist()
  state = eng.init_decode_state()
  jax.block_until_ready(state)
  fields = {}
  c, n, w, (state, _) = measure(lambda: eng.prefill_insert(params, state, prompts,
                                                           list(range(rows)), list(range(rows))))
  fields.update(prefill_insert_compile_s=c, prefill_insert_programs=n, prefill_insert_wall_s=w)
  c, n, w, (state, _) = measure(lambda: eng.generate(params, state, steps=steps,
                                                     kv_len=prompt_len + steps))
  fields.update(generate_compile_s=c, generate_programs=n, generate_wall_s=w)
  lens = np.asarray(state.lengths)[:rows]
  state = eng.update_slots(state, list(range(rows)), lengths=lens,
                           tokens=np.asarray(state.tokens)[:rows], active=False)
  obs = rng.integers(0, cfg.vocab_size, (rows, chunk - 1)).tolist()
  c, n, w, (state, _) = measure(lambda: eng.append(params, state, list(range(rows)), obs,
                                                   cached_lens=lens))
  fields.update(append_compile_s=c, append_programs=n, append_wall_s=w)
  emit("compile_time", record, model=model, layout=eng.cache_layout, attention=eng._attn,
       layers=cfg.n_layers, slots=slots, max_len=max_len, rows=rows, prompt_len=prompt_len,
       chunk=chunk, steps=steps, dtype=dtype, **fields)


def schedule(model, layout, attention, slots, max_len, steps, calls, seed=0):
  """Replays a rollout-like sequence of engine calls (a full first admission, then decode
  calls, host-side stops, appends of tool output into varying numbers of slots and small
  re-admissions, all sizes drawn from `seed`) and counts the programs each engine entry point
  compiled: the number a real rollout pays for, whatever the model size."""
  cfg = models.get_config(model)
  params = models.init_params(cfg, jax.random.key(0))
  eng = Engine(cfg, EngineConfig(slots=slots, max_len=max_len, eos_ids=(),
                                 sampling=SamplingConfig(1.0), decode_attention=attention,
                                 cache_layout=layout))
  rng = np.random.default_rng(seed)
  lens = np.zeros(slots, int)
  state = eng.init_decode_state()

  def admit(state, rows):
    prompts = [rng.integers(1, cfg.vocab_size, rng.integers(max_len // 16, max_len // 8)).tolist()
               for _ in rows]
    ids = list(map(int, rows))
    if hasattr(eng, "prefill_insert"):
      state, _ = eng.prefill_insert(params, state, prompts, ids, ids)
    else:  # an engine from before prefill_insert
      state = eng.insert(eng.prefill(params, prompts, ids), state, ids)
    lens[rows] = [len(p) for p in prompts]
    return state

  c0 = compile_stats.snapshot()
  state = admit(state, np.arange(slots))
  for _ in range(calls):
    state, _ = eng.generate(params, state, steps=steps, kv_len=int(lens.max()) + steps)
    lens += steps
    k = int(rng.integers(1, max(2, slots // 4)))
    stop = np.sort(rng.choice(slots, k, replace=False))
    room = max_len // 2 - lens[stop]
    tools = stop[room > 64]  # these append a tool observation, the rest restart
    state = eng.update_slots(state, stop, lengths=lens[stop],
                             tokens=np.asarray(state.tokens)[stop], active=False)
    if len(tools):
      obs = [rng.integers(1, cfg.vocab_size, rng.integers(8, 64)).tolist() for _ in tools]
      state, _ = eng.append(params, state, tools, obs, cached_lens=lens[tools])
      lens[tools] += 1 + np.array([len(o) for o in obs])
    again = np.setdiff1d(stop, tools)
    if len(again):
      state = admit(state, again)
  jax.block_until_ready(state)
  d = compile_stats.snapshot() - c0
  programs = {name: eng.program(name)._cache_size()
              for name in ("prefill", "insert", "generate", "append", "update")}
  emit("compile_schedule", False, model=model, layout=eng.cache_layout, attention=eng._attn,
       slots=slots, max_len=max_len, calls=calls, programs=programs,
       total_programs=sum(programs.values()), compiles=d.count, compile_s=d.seconds)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="smollm2-135m")
  ap.add_argument("--variants", default="stacked/xla,per_layer/pallas",
                  help="comma-separated layout/attention pairs")
  ap.add_argument("--slots", type=int, default=256)
  ap.add_argument("--max-len", type=int, default=2048)
  ap.add_argument("--rows", type=int, default=16, help="prompts prefilled and rows appended")
  ap.add_argument("--prompt-len", type=int, default=200)
  ap.add_argument("--chunk", type=int, default=256, help="appended tokens per row")
  ap.add_argument("--steps", type=int, default=8, help="decode steps per generate call")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--record", action="store_true")
  ap.add_argument("--schedule", type=int, default=0,
                  help="instead: replay this many rollout-like decode calls and count the "
                       "programs compiled per entry point")
  args = ap.parse_args()
  variants = [v.split("/") for v in args.variants.split(",")]
  bad = [v for v, parts in zip(args.variants.split(","), variants)
         if len(parts) != 2 or not all(parts)]
  if bad:  # raised ValueError (unpacking) after the variants before it had compiled
    ap.error(f"--variants: each entry is layout/attention, e.g. stacked/xla or "
             f"per_layer/pallas; got {bad}")
  compile_stats.install()
  if args.schedule:
    for layout, attention in variants:
      schedule(args.model, layout, attention, args.slots, args.max_len, args.steps,
               args.schedule)
    return
  for layout, attention in variants:
    v = f"{layout}/{attention}"
    try:
      run(args.model, layout, attention, args.slots, args.max_len, args.rows, args.prompt_len,
          args.chunk, args.steps, args.dtype, args.record)
    except Exception as e:  # one failing variant must not lose the others' numbers
      print(f"FAILED {v}: {type(e).__name__}: {str(e)[:2000]}", flush=True)


if __name__ == "__main__":
  main()
