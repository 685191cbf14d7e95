"""ci/export.py's AI Hub step without a token, and what it collects for upload (tiny toy artifact)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.toolchain.hub.test_jobs import S24, make_artifact

ROOT = Path(__file__).resolve().parents[2]


def _export_module():
    spec = importlib.util.spec_from_file_location("ci_export", ROOT / "ci" / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hub_step_without_token_checks_the_plan_and_skips(tmp_path, monkeypatch):
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(tmp_path / "missing.ini"))
    export = _export_module()
    art = make_artifact(tmp_path / "toy" / "artifact")
    results: list[dict] = []
    log = tmp_path / "log.txt"
    assert export.hub_steps(art, S24, log, results, "toy")
    assert [(r["step"], r["status"]) for r in results] == [("hub (dry run)", "passed"), ("hub", "skipped")]
    assert "submit_link_job" in log.read_text()
    assert not (art / "hub").exists()  # a dry run writes nothing

    (art / "hub" / "dev" / "profiles").mkdir(parents=True)
    (art / "hub" / "dev" / "profiles" / "decode.json").write_text("{}")
    (art / "hub" / "dev" / "model.bin").write_bytes(b"big")
    export.collect(art, tmp_path / "toy")
    assert (tmp_path / "toy" / "manifest.json").is_file()
    assert (tmp_path / "toy" / "hub" / "dev" / "profiles" / "decode.json").is_file()
    assert not (tmp_path / "toy" / "hub" / "dev" / "model.bin").exists()  # binaries stay behind


def test_qnn_step_fails_where_onnxruntime_qnn_is_declared_and_missing(tmp_path, monkeypatch):
    from toolchain.qnn import context as qnn

    export = _export_module()
    art = make_artifact(tmp_path / "toy" / "artifact")
    monkeypatch.setattr(qnn, "availability", lambda: (False, "onnxruntime-qnn is not installed"))
    monkeypatch.setattr(qnn, "declared_here", lambda: True)  # Linux x86_64: a declared dependency
    status, detail = export.qnn_step(art, tmp_path / "qnn")
    assert status == "failed" and "not installed" in detail
    monkeypatch.setattr(qnn, "declared_here", lambda: False)  # e.g. macOS: no wheel, the step is optional
    assert export.qnn_step(art, tmp_path / "qnn")[0] == "skipped"
