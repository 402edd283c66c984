"""`benchmarks/common.py`: the decode roofline's bytes by hand, and the chip peaks."""
import pytest

from benchmarks import common
from jaxagent import models


def test_kv_bytes_per_token_are_bf16_keys_and_values_of_every_layer():
  cfg = models.get_config("qwen2.5-1.5b")  # 28 layers, 2 KV heads of 128
  assert common.kv_bytes_per_token(cfg) == 2 * 28 * 2 * 128 * 2 == 28672


def test_decode_roofline_of_a_tied_model_reads_every_weight_once():
  cfg = models.get_config("qwen2.5-1.5b")
  assert cfg.tie_embeddings
  assert common.decode_roofline_bytes(cfg, 256, 300.0) == (
      2 * cfg.num_params() + 256 * 300.0 * 28672)


def test_decode_roofline_of_an_untied_model_reads_only_the_embedding_rows_it_looks_up():
  # The input table of an untied model (qwen2.5-7b: 152064 x 3584, 1.09 GB in bf16) is not
  # read by a decode step, only `slots` rows of it; counting it overstated the bytes a step
  # must read, and so the roofline fraction, by about 7% at small batch.
  cfg = models.get_config("qwen2.5-7b")
  assert not cfg.tie_embeddings
  table = cfg.vocab_size * cfg.d_model
  want = 2 * (cfg.num_params() - table + 64 * cfg.d_model) + 64 * 100 * common.kv_bytes_per_token(cfg)
  assert common.decode_roofline_bytes(cfg, 64, 100) == want


@pytest.mark.parametrize("chip, flops, bw", [("H100", 989e12, 3.35e12), ("H200", 989e12, 4.8e12)])
def test_peaks_are_the_dense_bf16_datasheet_numbers(chip, flops, bw):
  assert common.PEAKS[chip] == {"bf16_flops": flops, "hbm_bytes_s": bw}


@pytest.mark.parametrize("kind, chip, flops, bw", [
    ("NVIDIA H100 80GB HBM3", "H100", 989e12, 3.35e12),
    ("NVIDIA H200", "H200", 989e12, 4.8e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12, 2.0e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835e12, 3.9e12),
    ("NVIDIA H200 NVL", "H200 NVL", 835e12, 4.8e12),
])
def test_a_device_kind_takes_its_own_cards_peaks(monkeypatch, kind, chip, flops, bw):
  # The PCIe and NVL cards matched "H100" / "H200" and took the SXM parts' figures: on an H100
  # PCIe the roofline assumed 3.35 TB/s for a card of 2.0 TB/s.
  class Device:
    device_kind, platform = kind, "gpu"
  monkeypatch.setattr(common.jax, "devices", lambda: [Device()])
  assert common.device_info()["chip"] == chip
  assert common.peaks() == {"bf16_flops": flops, "hbm_bytes_s": bw}
