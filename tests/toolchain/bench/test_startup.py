"""`mobc bench startup`: the three modes really differ (only unchecked ignores a damaged artifact),
and the table's rows are per-mode medians of real `mobc run` processes."""

from __future__ import annotations

import pytest

from toolchain.bench.startup import MODES, measure, run_once


def test_modes_differ_only_in_the_integrity_check(artifact_copy, tmp_path):
    with open(artifact_copy / "weights.bin", "r+b") as f:  # same size, different bytes
        f.seek(64)
        f.write(b"\x7f" * 64)
    cache = tmp_path / "cache"
    run_once("unchecked", artifact_copy, "hi", cache)  # the baseline does not look
    with pytest.raises(RuntimeError, match=r"weights.bin changed since the compile"):
        run_once("cold", artifact_copy, "hi", cache)


def test_measure_reports_every_mode(tiny_artifact):
    res = measure(tiny_artifact, "hi", rounds=1)
    rows = res["modes"]
    assert set(rows) == set(MODES)
    assert rows["unchecked"]["ratio"] == 1.0
    for r in rows.values():
        assert r["median_s"] > 0.2 and r["peak_rss_bytes"] > 50e6  # a real process that imported the runtime


def test_first_token_is_measured_before_exit(tiny_artifact, tmp_path):
    r = run_once("warm", tiny_artifact, "hi", tmp_path / "cache")
    assert 0.2 < r["first_token_s"] < r["seconds"]  # the process still tears down after its token


@pytest.mark.parametrize(("written", "expected"), [(b"hi", False), (b"hi there", True)])
def test_first_text_after_skips_the_echoed_prompt(written, expected):
    import os

    from toolchain.bench.startup import first_text_after

    read_end, write_end = os.pipe()
    os.write(write_end, written)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as stream:
        assert first_text_after(stream, len(b"hi")) is expected
