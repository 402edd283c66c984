"""Test setup: 8 fake CPU devices (set before jax is imported) and shared fixtures."""
import atexit
import functools
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

# LLVM at -O0 (`--xla_backend_optimization_level=0`): this suite's programs are small and
# compiled far more often than they run long. Results agree with the optimised build to float
# rounding, not bitwise (a tiny-qwen3 loss and its gradients: at most 1e-8 apart in float32);
# the golden values and tolerances hold under either. Measured on the 2-core machine:
# decode_attention_test.py 168 -> 96 s. Tests that start their own processes pass it on.
#
# XLA:CPU's elemental emitters instead of its MLIR fusion emitters
# (`--xla_cpu_use_fusion_emitters=false`): the MLIR pipeline took most of each compile (a tiny
# qwen3 update step: 4.5 -> 1.4 s of CPU). The golden values hold; two programs that should
# agree (the update with and without TIS weights of exactly 1) agree to float rounding (3e-8
# on the tiny model's params), as under the fusion emitters they happened to agree bitwise.
# Measured on the 2-core machine, a whole default run: 27.2 -> 17.6 min of CPU;
# models/lora_edge_test.py 144 -> 62 s. Set on jaxlib 0.10 only (measured on 0.10.2, what the
# package index gives a fresh install): an XLA that does not know the flag stops at startup
# ("Unknown flag in XLA_FLAGS"), and XLA:CPU is retiring the elemental emitters.
CPU_TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
try:
  _jaxlib = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
except (importlib.metadata.PackageNotFoundError, ValueError):
  _jaxlib = (0, 0)
if (0, 10) <= _jaxlib < (0, 11):
  CPU_TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS",
                      f"--xla_force_host_platform_device_count=8 {CPU_TEST_XLA_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# A persistent compilation cache shared by the whole run (and the subprocesses tests start):
# many tests compile the same small programs (the tiny models' prefill, decode and update
# steps), and XLA's compile time is most of this suite's time on a CPU. A fresh directory per
# run, removed at exit; JAX keys entries on the program, its compile options and the jax
# version, so a hit is the executable the compile would have produced. Measured on the
# 2-core machine: engine_test.py + step_test.py 5m32s -> 3m57s from an empty cache.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="jaxagent-test-compile-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# Tokenizers rebuilt from GGUF files are cached on disk (`tokenizer_cache_dir`); the run keeps
# its own cache, shared with its workers and subprocesses, instead of writing to the home
# directory.
if "JAXAGENT_TOKENIZER_CACHE" not in os.environ:
  _tokenizers = tempfile.mkdtemp(prefix="jaxagent-test-tokenizer-cache-")
  atexit.register(shutil.rmtree, _tokenizers, ignore_errors=True)
  os.environ["JAXAGENT_TOKENIZER_CACHE"] = _tokenizers

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)


# The longest test files (about 0.5-3 minutes each on a 2-core CPU), scheduled first, longest
# first. pytest-xdist (`--dist loadfile`) hands whole files to its two workers, by default those
# with the most tests first (the verifier's 887 quick cases), so heavy files of few tests came
# last and one worker ran them alone while the other had finished (the two-process learner
# test, 39 s, was the very last). `--no-loadscope-reorder` (addopts) makes xdist keep this
# order; a worker takes the next file when its current one has two tests left, so the files
# after this list (each under about 25 s) fill the gaps and the two workers end together. The
# order is by each file's measured total in a whole default run (`--junitxml` times summed per
# file); re-measure when a file's tests grow. The order of the other files, and of the tests
# within every file, is unchanged.
HEAVY_FIRST = (
    "generate/engine_test.py", "trainer_test.py", "rl/losses_test.py",
    "models/decode_attention_test.py", "envs/configs_test.py", "plan/main_test.py",
    "launch_test.py", "plan/planner_test.py", "models/packed_attention_test.py",
    "models/logprobs_test.py", "off_policy_test.py", "rl/step_test.py",
    "models/tokenizer_test.py", "checkpoint_test.py", "generate/sampling_test.py",
    "generate/jetstream_test.py", "tools/sandbox_test.py", "lora_trainer_test.py",
    "models/lora_edge_test.py", "models/lora_test.py", "models/lora_unmerged_test.py",
)
_missing = [name for name in HEAVY_FIRST if not (Path(__file__).parent / name).is_file()]
assert not _missing, f"tests/conftest.py HEAVY_FIRST names no such test file: {_missing}"


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(HEAVY_FIRST)}

  def key(item):
    path = item.nodeid.split("::")[0]
    path = path[len("tests/"):] if path.startswith("tests/") else path
    return rank.get(path, len(rank))
  items.sort(key=key)  # stable: the other files keep their order, and every file its tests' order


@pytest.fixture
def bos_tokenizer(tmp_path):
  """The embedded SmolLM2 tokenizer made to add BOS (id 0) to every encoding, as Llama 3's
  post-processor does; its `bos_id` is 0."""
  import json

  from jaxagent import models
  out = models.load_tokenizer("smollm2-135m-instruct").save(tmp_path / "bos")
  data = json.loads((out / "tokenizer.json").read_text())
  data["post_processor"] = {  # BOS insertion as Llama 3's tokenizer.json writes it
      "type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
               {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
      "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                           "tokens": ["<|endoftext|>"]}}}
  (out / "tokenizer.json").write_text(json.dumps(data))
  config = json.loads((out / "tokenizer_config.json").read_text())
  (out / "tokenizer_config.json").write_text(json.dumps(config | {"bos_token": "<|endoftext|>"}))
  tok = models.load_tokenizer(out)
  assert tok.bos_id == 0
  return tok


_INST_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
    " [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


@functools.lru_cache(maxsize=None)
def _metaspace_first(corpus: str, vocab_size: int, special_tokens: tuple[str, ...],
                     initial_alphabet: str, chat_template: str | None):
  import tokenizers
  from tokenizers import decoders, models as tok_models, pre_tokenizers, trainers

  from jaxagent.models.tokenizer import Tokenizer
  backend = tokenizers.Tokenizer(tok_models.BPE(unk_token="<unk>"))
  backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
  backend.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
  backend.train_from_iterator([corpus] * 20, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(special_tokens),
      initial_alphabet=list(initial_alphabet), show_progress=False))
  return Tokenizer(backend, bos_token="<s>", eos_token="</s>", chat_template=chat_template)


@pytest.fixture(scope="session")
def metaspace_first_tokenizer():
  """Builds small BPE tokenizers with a Metaspace pre-tokenizer, prepend_scheme="first" (Mistral,
  Llama 2 without legacy spacing: "▁" at the start of the input only, not after other tokens):
  `metaspace_first_tokenizer()` is one trained on "[INST] ... [/INST] ..." text with that chat
  template; pass `corpus`, `vocab_size` and `special_tokens` for another (cached per arguments)."""
  def build(corpus: str = "[INST] what is this [/INST] the answer is here", vocab_size: int = 120,
            special_tokens: tuple[str, ...] = ("<unk>", "<s>", "</s>"),
            initial_alphabet: str = "</s>", chat_template: str | None = _INST_TEMPLATE):
    return _metaspace_first(corpus, vocab_size, tuple(special_tokens), initial_alphabet,
                            chat_template)
  return build
