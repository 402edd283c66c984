"""`benchmarks/plan_table.py`: the table from the planner's JSON, and rows checked before any
planner runs (the planner itself is minutes a row: see tests/plan/)."""
import pytest

from benchmarks import plan_table

# The fields a real row of `smollm2-135m:v5e:2x2:1,4,1` gave (planner JSON, programs dropped).
ROW = {"row": "smollm2-135m:v5e:2x2:1,4,1", "plan_s": 403.4, "rc": 0, "fits": True,
       "peak_bytes": 11156444936.0, "update_time_s": 19.6178564466105,
       "decode_step_time_s": 0.016180529950091574, "knobs": [],
       "chip": {"name": "v5e", "hbm_bytes": 16911433728.0}}


def test_table_line_of_a_planned_row():
  assert plan_table.table_line(ROW) == (
      "| smollm2-135m | v5e:2x2 | 1 x 4 x 1 | yes | 10.39 / 16 | 19.62 s | 16.18 ms |  |")


def test_table_line_of_a_chip_with_unknown_capacity():
  # fits None (the planner does not know the chip's HBM): the table raised TypeError after
  # every row had run.
  r = dict(ROW, fits=None, chip={"name": "cpu", "hbm_bytes": None}, update_time_s=None)
  assert plan_table.table_line(r).endswith("| ? | 10.39 / ? | - | 16.18 ms |  |")


def test_table_line_of_a_failed_row():
  line = plan_table.table_line({"row": ROW["row"], "error": "planner timed out after 5 s"})
  assert "error: planner timed out" in line


@pytest.mark.parametrize("row, message", [
    ("smollm2-135m:v5e:4x4", "expected model:generation:topology:data,fsdp,tensor"),
    ("smollm2-135m:v5e:4x4:1,16", "must be three counts >= 1"),
    ("smollm2-135m:v5e:4x4:1,x,1", "must be three counts >= 1"),
])
def test_a_malformed_row_is_refused_before_any_row_runs(monkeypatch, run_main, row,
                                                        message):
  # It raised ValueError (unpacking) when its turn came, after the rows before it had run.
  monkeypatch.setattr(plan_table, "run_row", lambda *a: pytest.fail("the planner ran"))
  with pytest.raises(SystemExit):
    run_main(plan_table, "--rows", ROW["row"], row)
  assert message in run_main.err


def test_rows_run_in_order_and_print_the_table(monkeypatch, run_main, tmp_path):
  monkeypatch.setattr(plan_table, "run_row", lambda row, timeout, extra: dict(ROW, row=row))
  run_main(plan_table, "--rows", ROW["row"], "qwen2.5-7b:v5p:4x4x4:4,16,1",
           "--out", str(tmp_path / "o.jsonl"))
  lines = run_main.out.splitlines()
  assert lines[-2].startswith("| smollm2-135m |") and lines[-1].startswith("| qwen2.5-7b |")
  assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2
