"""`benchmarks/scaling.py`: the parent's efficiency from its children's rows, the child's MFU
formula, option checks, and (slow) the --tiny CPU smoke test of the whole script."""
import pytest

from benchmarks import scaling


def _fake_children(monkeypatch, step_s, failed=()):
  def run_child(n, platform, timeout):
    if n in failed:
      return {}, "out of memory"
    return {p: {"part": p, "device": "cpu", "chip": "cpu", "step_s": step_s[n],
                "tokens_per_s": 1.0 / step_s[n], "mfu": 0.5} for p in ("update", "decode")}, None
  monkeypatch.setattr(scaling, "run_child", run_child)


def test_efficiency_is_t1_over_n_tn_against_the_smallest_count_that_ran(monkeypatch, run_main):
  _fake_children(monkeypatch, {1: 8.0, 2: 5.0, 4: 4.0}, failed={1})
  rows = run_main(scaling, "--tiny", "--gpus", "1,2,4", "--parts", "update")
  by_n = {r["n"]: r for r in rows}
  assert by_n[1]["status"] == "failed" and by_n[1]["error"] == "out of memory"
  # No 1-device run: t1 = 2 x t2 = 10 s.
  assert by_n[2]["efficiency"] == 1.0 and by_n[2]["baseline_n"] == 2
  assert by_n[4]["efficiency"] == pytest.approx(2 * 5.0 / (4 * 4.0))


def test_the_child_counts_6n_plus_causal_attention_per_token(monkeypatch, run_main):
  # The test process has 8 host devices (tests/conftest.py): the child for n = 8.
  monkeypatch.setattr(scaling, "time_update", lambda cfg, mesh, args: 2.0)
  monkeypatch.setattr(scaling, "peaks", lambda: {"bf16_flops": 1e12})
  [r] = run_main(scaling, "--tiny", "--gpus", "8", "--parts", "update", "--child", "8")
  cfg = scaling.models.get_config("tiny-qwen3")
  length = 16 + 32  # --tiny: prompt 16 + gen 32, batch 8
  per_tok = 6 * (cfg.num_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model))
  per_tok += 3 * 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * length
  assert r["mfu"] == pytest.approx(per_tok * 8 * length / 2.0 / (8 * 1e12))  # per device
  assert r["tokens_per_s"] == 8 * length / 2.0


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "1,x"], "comma-separated list of device counts"),
    (["--gpus", "3"], "must divide into 3 devices"),
    (["--parts", "update,decod"], "--parts takes update and/or decode"),
])
def test_bad_options_are_refused(monkeypatch, run_main, flags, message):
  monkeypatch.setattr(scaling, "run_child", lambda *a: pytest.fail("a child ran"))
  with pytest.raises(SystemExit):
    run_main(scaling, "--tiny", *flags)
  assert message in run_main.err


@pytest.mark.slow  # two child processes, each compiling an update and a decode (~45 s)
def test_tiny_cpu_smoke_run(run_main):
  rows = run_main(scaling, "--tiny", "--gpus", "1,2", "--timeout", "300")
  final = [r for r in rows if r["bench"] == "scaling"]
  assert [(r["part"], r["n"], r["status"]) for r in final] == [
      ("update", 1, "ok"), ("update", 2, "ok"), ("decode", 1, "ok"), ("decode", 2, "ok")]
