"""One train/held-out split of the stdlib corpus for every consumer."""

from __future__ import annotations

import pytest

from tests.tiny import tiny_tokenizer
from toolchain.errors import MobcError
from toolchain.train import corpus


def _rel(paths) -> set[str]:
    return {p.relative_to(corpus.STDLIB).as_posix() for p in paths}


def test_the_split_is_disjoint_fixed_and_pins_the_quantize_sets():
    train, held = _rel(corpus.files("train")), _rel(corpus.files("held_out"))
    assert train and held and not train & held
    assert 0.05 < len(held) / (len(train) + len(held)) < 0.25
    assert set(corpus.CALIBRATION_FILES) <= train and set(corpus.EVALUATION_FILES) <= held
    assert corpus.VERIFICATION_FILE not in train | held  # the compile's verification prompt
    # a seed orders files, it never moves one across the split
    assert _rel(corpus.files("held_out", seed=7)) == held and corpus.files("train", seed=7) != corpus.files("train")


def test_train_and_held_out_tokens_come_from_their_own_files():
    tok = tiny_tokenizer()
    train, held = corpus.train_and_held_out(tok, 3000, 1000, seed=3)
    assert len(train) == 3000 and len(held) == 1000
    first_held = next(corpus.texts("held_out"))
    assert list(held[:50]) == tok(first_held).input_ids[:50]
    first_train = next(corpus.texts("train", seed=3))
    assert list(train[:50]) == tok(first_train).input_ids[:50]


def test_module_text_names_the_fix():
    assert "def wrap(" in corpus.module_text("textwrap")
    with pytest.raises(MobcError, match="neither a file nor a standard-library module"):
        corpus.module_text("no_such_module_here")
