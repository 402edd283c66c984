"""Run metrics: `metrics.jsonl`, TensorBoard events, a console progress bar and a curves PNG.

The trainer logs one flat dict per step (`{"reward/mean": ..., "eval/pass@1": ...}`); this
module fans it out. Only process 0 writes anything, so multi-host runs log once. A resumed run
rewinds these files (and the trainer's `compiles.jsonl`) to its checkpoint's step; a run that
starts from scratch moves an earlier run's files aside (`MetricsWriter.set_aside_earlier_run`).
"""
from __future__ import annotations

import json
import logging
import math
import pathlib
import re
import time
from typing import Any, Mapping

import jax
import numpy as np

log = logging.getLogger(__name__)

# What a run writes at the top of its workdir besides checkpoints: a run that starts from
# scratch in a workdir holding these moves them to `previous/<n>/` (`set_aside_earlier_run`).
RUN_OUTPUTS = ("metrics.jsonl", "tensorboard", "summary.json", "curves.png", "compiles.jsonl",
               "samples")


_TAG_CHARS = re.compile(r"[^-/\w.]")  # what a TensorBoard tag may not hold


def _scalar(v) -> float | None:
  try:
    a = np.asarray(v)
    # One value of any shape ((1,), (1, 1)): float() of an array of ndim > 0 is deprecated.
    f = float(a.reshape(()) if a.size == 1 else a)
  except (TypeError, ValueError):
    return None
  return f


def finite_json(record: Mapping[str, Any], **kwargs) -> str:
  """`json.dumps` of a flat record with non-finite floats as null (strict JSON: NaN and
  Infinity are not JSON, and many readers refuse them)."""
  return json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                     for k, v in record.items()}, **kwargs)


def append_line(path: str | pathlib.Path, line: str) -> None:
  """Appends `line` + "\n" to the file at `path` whole or not at all.

  A write that fails part way (a full disk, a quota) is cut back off the file before the error
  is raised: a partial last line would be glued to the next record, and readers of JSON lines
  (pandas, jq) refuse the file from that line on.
  """
  with open(path, "ab", buffering=0) as f:
    _append_whole(f, (line + "\n").encode())


def _append_whole(f, data: bytes) -> None:
  start = f.seek(0, 2)  # appends land at the end
  try:
    view = memoryview(data)
    while view:
      view = view[f.write(view):]
  except BaseException:
    try:
      f.truncate(start)
    except OSError:
      pass  # the write's error is the one to report
    raise


class _EventFile:
  """A TensorBoard event file whose scalars are on disk when `write` returns.

  tensorboardX's `SummaryWriter` queues events for a thread that writes them, and its `flush`
  does not wait for that thread: a run killed after logging a step (out of memory, a
  preemption without notice) lost that step's events, and a resume from the checkpoint of that
  step never logs it again. `purge_step`: TensorBoard drops the events of earlier files at
  steps >= it (the START record `SummaryWriter(purge_step=...)` writes).
  """

  def __init__(self, logdir: pathlib.Path, *, purge_step: int | None = None, suffix: str = ""):
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto import event_pb2, summary_pb2
    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    logdir.mkdir(parents=True, exist_ok=True)
    self._writer = EventsWriter(str(logdir / "events"), suffix)
    if purge_step is not None:
      self._writer.write_event(event_pb2.Event(
          wall_time=time.time(), step=purge_step,
          session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
    self._writer.flush()

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    now = time.time()
    for tag, value in scalars.items():
      # The summary proto is built here: tensorboardX's `scalar` logged "NaN or Inf found in
      # input tensor." for each non-finite value without naming the metric.
      summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value)])
      self._writer.write_event(self._event(wall_time=now, step=int(step), summary=summary))
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


class MetricsWriter:
  """Writes step metrics to JSONL and TensorBoard; keeps them for the final curves plot."""

  def __init__(self, workdir: str | pathlib.Path, *, tensorboard: bool = True,
               progress_total: int | None = None, progress: bool = True):
    self.workdir = pathlib.Path(workdir)
    self.is_lead = jax.process_index() == 0
    self.history: list[dict[str, Any]] = []
    self._unlogged: set[str] = set()  # keys warned about in `write`
    self._nonfinite: set[str] = set()  # keys whose NaN / Inf `write` has said
    self._tb = None
    self._bar = None
    self._jsonl = None
    if not self.is_lead:
      return
    self.workdir.mkdir(parents=True, exist_ok=True)
    # An earlier run's outputs, seen before this writer adds its own (see set_aside_earlier_run).
    self._earlier = [n for n in RUN_OUTPUTS if (self.workdir / n).exists()]
    self._jsonl = open(self.workdir / "metrics.jsonl", "ab", buffering=0)
    if tensorboard:
      try:
        self._tb = _EventFile(self.workdir / "tensorboard")
      except ImportError:  # optional: JSONL is always written
        log.warning("tensorboardX is not installed; writing metrics.jsonl only")
    if progress and progress_total:
      from tqdm.auto import tqdm
      self._bar = tqdm(total=progress_total, desc="train", dynamic_ncols=True)

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    clean = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
    # A value that is not one number (an array of several, a text) is not logged: said once
    # per key, where it was left out of metrics.jsonl and TensorBoard without a word.
    for k in metrics:
      if k not in clean and k not in self._unlogged and metrics[k] is not None:
        self._unlogged.add(k)
        if self.is_lead:
          v = metrics[k]
          what = f"shape {np.shape(v)}" if np.ndim(v) else type(v).__name__
          log.warning("metric %r is not a single number (%s, from step %s on): not logged",
                      k, what, step)
    for k, v in clean.items():
      if not math.isfinite(v) and k not in self._nonfinite:
        self._nonfinite.add(k)
        if self.is_lead:
          log.warning("metric %r is %s at step %s (null in metrics.jsonl); said once per metric",
                      k, v, step)
    rec = {"step": int(step), "time": time.time(), **clean}
    self.history.append(rec)
    if not self.is_lead:
      return
    _append_whole(self._jsonl, (finite_json(rec) + "\n").encode())
    if self._tb is not None:
      # TensorBoard tags allow [A-Za-z0-9_./-]: "eval/pass@1" is logged as "eval/pass_at_1",
      # other characters as "_".
      self._tb.write(step, {_TAG_CHARS.sub("_", k.replace("@", "_at_")).lstrip("/") or "_": v
                            for k, v in clean.items()})

  def progress(self, n: int = 1, **postfix) -> None:
    if self._bar is not None:
      # The postfix first: the update redraws the bar, so this step's values show with it
      # (set after, they showed one step late).
      if postfix:
        self._bar.set_postfix({k: (f"{v:.3g}" if isinstance(v, float) else v)
                               for k, v in postfix.items()}, refresh=False)
      self._bar.update(n)

  def message(self, text: str) -> None:
    """A line on the console that does not break the progress bar."""
    if not self.is_lead:
      return
    if self._bar is not None:
      self._bar.write(text)
    else:
      print(text, flush=True)

  def plot(self, path: str | pathlib.Path | None = None,
           keys=("reward/mean", "eval/pass@1")) -> pathlib.Path | None:
    """A PNG of the given curves over steps (one panel each); None when nothing to plot."""
    if not self.is_lead:
      return None
    series = {k: [(r["step"], r[k]) for r in self.history if k in r] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
      return None
    # A Figure with its own Agg canvas: no pyplot state, so notebooks keep their backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(5 * len(series), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(series), squeeze=False)
    for ax, (k, pts) in zip(axes[0], series.items()):
      xs, ys = zip(*pts)
      ax.plot(xs, ys, marker="o" if len(xs) < 40 else None)
      ax.set_title(k)
      ax.set_xlabel("step")
      ax.grid(alpha=0.3)
    fig.tight_layout()
    path = pathlib.Path(path) if path else self.workdir / "curves.png"
    fig.savefig(path, dpi=110)
    return path

  def rewind_tensorboard(self, step: int) -> None:
    """Hides the TensorBoard events of steps after `step` (a resumed run redoes them): the
    event files are reopened with `purge_step=step + 1`, which TensorBoard honours on load."""
    if self._tb is None:
      return
    self._tb.close()
    # Its own file name: one made in the same second as the last would replace that file.
    self._tb = _EventFile(self.workdir / "tensorboard", purge_step=int(step) + 1,
                          suffix=f".resumed-after-{int(step)}")

  def set_aside_earlier_run(self) -> pathlib.Path | None:
    """For a run that starts from scratch (nothing to resume): move the outputs an earlier run
    left in the workdir (`RUN_OUTPUTS`) to `<workdir>/previous/<n>/` and start them afresh.

    Appended to, metrics.jsonl held the records of both runs (steps 0, 1, ... twice) and
    TensorBoard drew both on the same curves. Returns the folder they went to, or None when
    there were none (or on processes other than 0).
    """
    if not self.is_lead or not self._earlier:
      return None
    names, self._earlier = self._earlier, []
    root = self.workdir / "previous"
    taken = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    dest = root / str(max(taken, default=0) + 1)
    dest.mkdir(parents=True)
    tb = self._tb is not None
    if tb:
      self._tb.close()
    self._jsonl.close()
    for name in names:
      if (self.workdir / name).exists():
        (self.workdir / name).rename(dest / name)
    self._jsonl = open(self.workdir / "metrics.jsonl", "ab", buffering=0)
    if tb:
      self._tb = _EventFile(self.workdir / "tensorboard")
    return dest

  def close(self) -> None:
    """Closes the files and the progress bar; closing again does nothing."""
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self._tb is not None:
      # (a second close of the event file raised "ValueError: flush of closed file", so that
      # `Trainer.close` could not be called twice)
      tb, self._tb = self._tb, None
      tb.close()
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
