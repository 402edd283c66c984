"""Overlay the step curves of several runs (their `metrics.jsonl`) in one PNG.

    python benchmarks/plot_runs.py --runs masked=runs/a/metrics.jsonl,unmasked=runs/b/metrics.jsonl \
        --keys reward/exact_match,reward/f1 --out ablation.png

Only RL steps (step >= 1) with the key are drawn; the SFT steps and evals before RL are not.
"""
import argparse
import json
import pathlib
import sys


def load(path: str, key: str) -> tuple[list[int], list[float]]:
  """Steps >= 1 and values of `key` in one `metrics.jsonl`. Blank lines are skipped, and so is
  a line that is not a JSON object (the torn last line of a run killed while writing), with a
  warning naming the file and line, so the other records of the run are still drawn."""
  xs, ys = [], []
  for i, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      rec = e
    if not isinstance(rec, dict):
      print(f"warning: {path}:{i} is not a JSON record; skipped: {line[:80]!r}",
            file=sys.stderr)
      continue
    if rec.get("step", 0) >= 1 and rec.get(key) is not None:
      xs.append(rec["step"])
      ys.append(rec[key])
  return xs, ys


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--runs", required=True, help="comma-separated name=metrics.jsonl pairs")
  ap.add_argument("--keys", default="reward/mean")
  ap.add_argument("--title", default="")
  ap.add_argument("--color-by-first-word", action="store_true",
                  help="runs whose names share the first word (e.g. 'masked seed 0', 'masked "
                       "seed 1') share a colour and differ in line style")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  runs = [r.split("=", 1) for r in args.runs.split(",")]
  bad = [r for r, pair in zip(args.runs.split(","), runs) if len(pair) != 2 or not all(pair)]
  if bad:
    ap.error(f"--runs: each entry is name=path/to/metrics.jsonl; got {bad}")
  missing = [path for _, path in runs if not pathlib.Path(path).is_file()]
  if missing:
    ap.error(f"--runs: no such file {missing}")
  keys = args.keys.split(",")
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(5 * len(keys), 3.6))
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, len(keys), squeeze=False)[0]
  styles = [{} for _ in runs]
  if args.color_by_first_word:  # colour per first word, line style per run within it
    groups = list(dict.fromkeys(name.split()[0] for name, _ in runs))
    seen: dict[str, int] = {}
    for style, (name, _) in zip(styles, runs):
      g = name.split()[0]
      style.update(color=f"C{groups.index(g)}",
                   linestyle=("-", "--", ":", "-.")[seen.get(g, 0) % 4])
      seen[g] = seen.get(g, 0) + 1
  for ax, key in zip(axes, keys):
    for style, (name, path) in zip(styles, runs):
      xs, ys = load(path, key)
      if not xs:  # a misspelt key would otherwise draw an empty panel without a word
        print(f"warning: run {name!r} ({path}) has no RL step with {key!r}", file=sys.stderr)
      ax.plot(xs, ys, marker="o", markersize=4, label=name, **style)
    ax.set_title(key)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend()
  if args.title:
    fig.suptitle(args.title)
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(args.out)


if __name__ == "__main__":
  main()
