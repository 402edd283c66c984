"""The planner over presets x TPU topologies x parallelism: fits?, HBM per chip, estimated times.

    python benchmarks/plan_table.py [--rows smollm2-135m:v5e:4x4:1,16,1 ...] [--out plan.jsonl]

Each row runs `python -m jaxagent.plan` (in its own process, so one row's compile memory is
freed before the next) on `configs/math_tool.py:qwen` (256 slots x 2048 tokens, 256 update
rows in 16 micro-batches at 2048 / 4096 tokens) with the model and mesh of the row, and prints
a markdown table (appends of `--append_len` tokens into all slots at once): model, topology, mesh (data x fsdp x tensor), the verdict, peak HBM per chip,
the estimated update step (longest bucket) and decode step, and the first knob when it does not
fit. A row is `model:topology:data,fsdp,tensor`. Results also go to `--out` (JSON lines), so a
partial run keeps what finished.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_ROWS = (
    "smollm2-135m:v5e:4x4:1,16,1",
    "qwen2.5-0.5b:v5e:4x4:1,16,1",
    "qwen2.5-1.5b:v5e:4x4:1,16,1",
    "qwen2.5-3b:v5e:4x4:1,8,2",
    "qwen2.5-7b:v5e:4x4:1,16,1",
    "qwen2.5-7b:v6e:4x4:1,8,2",
    "qwen2.5-7b:v5p:4x4x4:4,16,1",
    "qwen2.5-7b:v5e:2x2:4,1,1",
)


def check_row(row: str) -> str | None:
  """Why `row` is not `model:topology:data,fsdp,tensor` (None when it is)."""
  parts = row.split(":")
  if len(parts) != 4 or not all(parts):
    return (f"{row!r}: expected model:generation:topology:data,fsdp,tensor, "
            f"e.g. {DEFAULT_ROWS[0]!r}")
  mesh = parts[3].split(",")
  if len(mesh) != 3 or not all(m.isdigit() and int(m) >= 1 for m in mesh):
    return f"{row!r}: the mesh {parts[3]!r} must be three counts >= 1, data,fsdp,tensor"
  return None


def run_row(row: str, timeout: float, extra: list[str]) -> dict:
  model, gen, topo, mesh = row.split(":")
  data, fsdp, tensor = mesh.split(",")
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "plan.json"
    cmd = [sys.executable, "-m", "jaxagent.plan", "--config=configs/math_tool.py:qwen",
           f"--config.model.path={model}", f"--topology={gen}:{topo}",
           f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}",
           f"--config.mesh.tensor={tensor}", f"--json={out}", *extra]
    t0 = time.time()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    try:
      proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env=env)
    except subprocess.TimeoutExpired:
      return {"row": row, "error": f"planner timed out after {timeout:.0f} s"}
    res = {"row": row, "plan_s": time.time() - t0, "rc": proc.returncode}
    if out.exists():
      res.update(json.loads(out.read_text()))
    else:
      res["error"] = (proc.stderr or proc.stdout)[-800:]
    return res


def table_line(r: dict) -> str:
  model, gen, topo, mesh = r["row"].split(":")
  head = f"| {model} | {gen}:{topo} | {mesh.replace(',', ' x ')} |"
  if "fits" not in r:
    return f"{head} error: {r.get('error', '')[:80]} | | | | |"
  fits = {True: "yes", False: "**no**", None: "?"}[r["fits"]]
  ut, dt = r.get("update_time_s"), r.get("decode_step_time_s")
  ut = f"{ut:.2f} s" if ut else "-"
  dt = f"{dt * 1e3:.2f} ms" if dt else "-"
  knob = r["knobs"][0] if r.get("knobs") else ""
  cap = (r.get("chip") or {}).get("hbm_bytes")  # None: the planner does not know the chip's HBM
  peak = f"{r['peak_bytes'] / 2**30:.2f} / {f'{cap / 2**30:.0f}' if cap else '?'}"
  return f"{head} {fits} | {peak} | {ut} | {dt} | {knob} |"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", nargs="*", default=list(DEFAULT_ROWS))
  ap.add_argument("--timeout", type=float, default=1200)
  ap.add_argument("--out", default="")
  ap.add_argument("--append_len", type=int, default=64,
                  help="tokens appended into every slot at once (the planner's worst case)")
  args = ap.parse_args()
  bad = [why for why in map(check_row, args.rows) if why]
  if bad:  # before any row runs: one bad row at the end would otherwise fail after the rest
    ap.error("--rows: " + "; ".join(bad))
  results = []
  for row in args.rows:
    r = run_row(row, args.timeout, [f"--append_len={args.append_len}"])
    results.append(r)
    print(f"{row}: fits={r.get('fits')} in {r.get('plan_s', 0):.0f} s", flush=True)
    if args.out:
      with open(args.out, "a") as f:
        f.write(json.dumps(r) + "\n")
  print("| model | topology | data x fsdp x tensor | fits | peak GiB / chip | update step (est) "
        "| decode step (est) | knob |")
  print("|---|---|---|---|---|---|---|---|")
  for r in results:
    print(table_line(r))


if __name__ == "__main__":
  main()
