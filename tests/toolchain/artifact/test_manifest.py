"""The typed manifest: what the writer writes the reader reads back; damaged ones are refused clearly."""

from __future__ import annotations

import json

import pytest

from toolchain.artifact.manifest import MANIFEST, GraphRecord, IOSpec, Manifest, ModelInfo
from toolchain.errors import ArtifactError


def _manifest() -> Manifest:
    model = ModelInfo(family="llama", n_layers=2, n_heads=4, n_kv=2, head_dim=16, hidden=64, vocab=512,
                      layer_kinds=["full", "sliding"], rope_per_kind=True, sliding_window=8, eos_token_ids=[2])
    graphs = [
        GraphRecord(name="decode_lm_head", file="decode_lm_head.onnx", family="decode", role="lm_head", width=1,
                    context=32, stage=1, inputs=[IOSpec("hidden", [1, 1, 64], "float")],
                    outputs=[IOSpec("logits", [1, 1, 512], "float")]),
        GraphRecord(name="decode", file="decode.onnx", family="decode", role="decode", width=1, context=32, stage=0,
                    inputs=[IOSpec("input_ids", [1, 1], "int32"), IOSpec("lora_rows", [1, 1, 4], "float")],
                    outputs=[IOSpec("hidden", [1, 1, 64], "float")]),
    ]
    return Manifest(name="toy", source={"description": "toy"}, model=model, graphs=graphs,
                    weights={"file": "weights.bin", "bytes": 3}, rope={"file": "rope.npz"})


def test_round_trip_and_checksums(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"abc")
    m = _manifest()
    m.write(tmp_path)
    back = Manifest.load(tmp_path)
    assert back == m and set(back.files) == {"weights.bin"}
    assert [g.name for g in back.chain("decode")] == ["decode", "decode_lm_head"]
    decode = back.chain("decode")[0]
    assert decode.input_shape("lora_rows") == ([1, 1, 4], "float32")
    layout = back.model.layout(width=4, context=32)
    assert layout.rope_kinds == ["full", "sliding"] and layout.inputs()[1][0] == "attention_mask"
    assert back.changed_files(tmp_path) == []
    (tmp_path / "weights.bin").write_bytes(b"abd")
    assert back.changed_files(tmp_path) == ["weights.bin"]


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: d.update(extra_key=1), "keys mobc does not know \\(extra_key\\)"),
    (lambda d: d.pop("model"), "not a complete mobc manifest"),
    (lambda d: d.update(format="mobc-artifact/0"), "has format 'mobc-artifact/0'"),
])
def test_damaged_manifests_name_the_problem(tmp_path, damage, message):
    _manifest().write(tmp_path)
    data = json.loads((tmp_path / MANIFEST).read_text())
    damage(data)
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match=message):
        Manifest.load(tmp_path)


def test_missing_or_unreadable_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="not a finished mobc artifact"):
        Manifest.load(tmp_path)
    (tmp_path / MANIFEST).write_text("{")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        Manifest.load(tmp_path)
    with pytest.raises(ArtifactError, match="is not a folder"):
        Manifest.load(tmp_path / "nope")
