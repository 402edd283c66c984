"""Overlay the step curves of several runs (their `metrics.jsonl`) in one PNG.

    python benchmarks/plot_runs.py --runs masked=runs/a/metrics.jsonl,unmasked=runs/b/metrics.jsonl \
        --keys reward/exact_match,reward/f1 --out ablation.png

Only RL steps (step >= 1) with the key are drawn; the SFT steps and evals before RL are not.
"""
import argparse
import json
import pathlib


def load(path: str, key: str) -> tuple[list[int], list[float]]:
  xs, ys = [], []
  for line in pathlib.Path(path).read_text().splitlines():
    rec = json.loads(line)
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
