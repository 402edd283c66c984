"""Host cost of many live sandboxes: what supervising N running Python cells takes from the
process that drives the rollout.

    python benchmarks/sandbox_scale.py --sessions 64 --background 600 --cell-s 3

Starts N persistent sandboxed interpreters (`jaxagent.tools.PythonSession`), plus `--background`
idle processes (a busy host: several trainers' sandboxes), then runs a cell that sleeps
`--cell-s` seconds in every interpreter at once, from N threads, while a pure-Python probe thread
counts loop iterations. Reports the wall time of the round (ideal: `--cell-s`) and the probe's
rate (the GIL time left for decode scheduling, parsing and rewards; compare with --sessions 1).
"""
import argparse
import concurrent.futures as cf
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import emit
from jaxagent.tools.sandbox import PythonSession, SandboxConfig


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sessions", type=int, default=64)
  ap.add_argument("--background", type=int, default=600)
  ap.add_argument("--cell-s", type=float, default=3.0)
  ap.add_argument("--record", action="store_true")
  args = ap.parse_args()
  if args.sessions < 1 or args.background < 0 or not args.cell_s > 0:
    ap.error("need --sessions >= 1, --background >= 0 and --cell-s > 0")
  bg = [subprocess.Popen(["sleep", str(10 * args.cell_s + 60)]) for _ in range(args.background)]
  sessions = [PythonSession(SandboxConfig(timeout_s=args.cell_s + 5, memory_mb=512))
              for _ in range(args.sessions)]
  try:
    with cf.ThreadPoolExecutor(args.sessions) as ex:  # start every interpreter first
      list(ex.map(lambda s: s.run("x = 1"), sessions))
    stop, count = threading.Event(), [0]

    def probe():
      while not stop.is_set():
        sum(range(10000))
        count[0] += 1

    t0 = time.monotonic()
    th = threading.Thread(target=probe)
    th.start()
    with cf.ThreadPoolExecutor(args.sessions) as ex:
      res = list(ex.map(lambda s: s.run(f"import time\ntime.sleep({args.cell_s})"), sessions))
    stop.set()
    th.join()
    wall = time.monotonic() - t0
    emit("sandbox_scale", args.record, sessions=args.sessions, background=args.background,
         cell_s=args.cell_s, wall_s=wall, probe_iters_per_s=count[0] / wall,
         ok=sum(r.ok for r in res))
  finally:
    for s in sessions:
      s.close()
    for p in bg:
      p.kill()
      p.wait()


if __name__ == "__main__":
  main()
