"""One tiny compiled artifact with a quantize section, shared by the quantization tests.

Compiling once (two small graph families) keeps the suite fast; other schemes re-quantize a copy
of its float graphs with `quantize_artifact`, which takes about a second on tiny graphs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.tiny import save_tiny, write_recipe

GRAPHS = "  decode: {width: 1, context: 64}\n  prefill: {width: 8, context: 64}\n"
QUANT = """quantize:
  weights: int4
  activations: int16
  kv_cache: int8
  overrides:
    "lm_head*": {weights: int8}
  calibration: {samples: 4}
  eval_tokens: 192
"""


@pytest.fixture(scope="session")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("qmodel") / "llama", "llama")


@pytest.fixture(scope="session")
def compiled(tmp_path_factory: pytest.TempPathFactory, tiny_src: Path) -> Path:
    from toolchain.compile.pipeline import compile_recipe

    root = tmp_path_factory.mktemp("qart")
    recipe = write_recipe(root / "tiny.yaml", tiny_src, name="tinyq", graphs=GRAPHS,
                          extra=QUANT)
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 4"))
    return compile_recipe(recipe).out_dir


@pytest.fixture
def artifact(compiled: Path, tmp_path: Path) -> Path:
    """A private copy of the float artifact (so each test may write its own quantized/)."""
    dst = tmp_path / "art"
    shutil.copytree(compiled, dst, ignore=shutil.ignore_patterns("quantized"))
    # the float manifest lists quantized/'s files too, and artifacts are checked at load: the copy is
    # the float artifact as compiled without a quantize section
    manifest = json.loads((dst / "manifest.json").read_text())
    for key in ("files", "sizes"):
        manifest[key] = {k: v for k, v in manifest[key].items() if not k.startswith("quantized/")}
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return dst


@pytest.fixture(scope="session")
def tokenizer(compiled: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(compiled / "tokenizer")


@pytest.fixture(scope="session", autouse=True)
def _calibration_cache(tmp_path_factory: pytest.TempPathFactory):
    """Calibration ranges are cached by content hash; keep the tests' cache out of ~/.cache."""
    from toolchain.quantize import calibrate

    old = calibrate.CACHE_DIR
    calibrate.CACHE_DIR = tmp_path_factory.mktemp("calib-cache")
    yield
    calibrate.CACHE_DIR = old
