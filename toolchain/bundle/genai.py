"""`mobc bundle genai`: an artifact as an onnxruntime-genai decoder-pipeline bundle.

The bundle is what a phone app loads with onnxruntime-genai (`og.Model(folder)`): genai_config.json
lists the pipeline in order, per width (the prompt width runs on prompts, width 1 on generated
tokens): the position processor, the KV unpack stage, the artifact's own step-graph stages
(parts and lm_head, unchanged), the KV pack stage (toolchain/bundle/genai_stages.py says why the
cache and masks are translated). Weights are never copied: graph files, weights.bin and QNN context
binaries are hard links into the artifact (a copy only across filesystems, and the summary says
so). The bundle is written into a staging folder and renamed into place, like a compile.

Targets: cpu runs every stage on the CPU EP; qnn replaces each step-graph stage by the
artifact's EPContext model over its HTP context binary (built by a recipe's `qnn:` section),
with QNN session options, and keeps the small stages on the CPU.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from toolchain import kernels
from toolchain.artifact.manifest import ROPE, GraphRecord, Manifest
from toolchain.bundle import genai_stages as stages
from toolchain.compile.emit import staging
from toolchain.errors import ArtifactError
from toolchain.runtime.shared_weights import external_initializers
from toolchain.runtime.tokenizer import Tokenizer

CONFIG = "genai_config.json"
MARKER = "mobc_bundle.json"  # what mobc knows about the bundle (genai refuses unknown config keys)
FORMAT = "mobc-genai-bundle/1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
TARGETS = ("cpu", "qnn")
QNN_OPTIONS = {"backend_path": "libQnnHtp.so", "htp_performance_mode": "burst", "soc_model": "57",
               "htp_arch": "75", "enable_htp_fp16_precision": "1"}


@dataclass
class BundleSummary:
    folder: Path
    target: str
    prompt_width: int
    context: int
    stages: list[dict[str, Any]]
    linked_bytes: int = 0
    copied_bytes: int = 0
    written_bytes: int = 0
    notes: list[str] = field(default_factory=list)


def _families(manifest: Manifest, folder: Path) -> tuple[str, str]:
    """(prompt family, token family): the widest prefill graph and the width-1 decode graph."""
    if manifest.model.diffusion:
        raise ArtifactError(
            f"{folder} is a diffusion artifact: onnxruntime-genai decodes left to right only; bundle an "
            "autoregressive artifact (a recipe with decode and prefill graphs)")
    heads = {f: manifest.chain(f)[0] for f in manifest.families()}
    token = [f for f, g in heads.items() if g.role == "decode" and g.width == 1]
    prompt = [f for f, g in heads.items() if g.role == "prefill" and g.width > 1]
    missing = [what for what, found in (("a decode graph of width 1", token), ("a prefill graph", prompt))
               if not found]
    if missing:
        have = ", ".join(f"{f} ({g.role}, width {g.width})" for f, g in heads.items()) or "none"
        raise ArtifactError(
            f"{folder} has no {' and no '.join(missing)} (its graphs: {have}); an onnxruntime-genai pipeline "
            "runs prompts through one width and generated tokens through width 1: add e.g. "
            "decode: {width: 1, context: 512} and prefill: {width: 128, context: 512} to the recipe and recompile")
    p = max(prompt, key=lambda f: heads[f].width)
    t = token[0]
    _refuse_mobc_ops(manifest, folder, (p, t))
    w, cl = heads[p].width, heads[p].context
    if heads[t].context != cl:
        raise ArtifactError(f"{folder}: the prefill graph has context {cl}, the decode graph "
                            f"{heads[t].context}; compile both with one context")
    if cl < 2 * w:
        raise ArtifactError(f"{folder}: onnxruntime-genai needs context >= 2 x the prompt width "
                            f"({cl} < 2 x {w}); compile a narrower prefill graph or a longer context")
    for fam in (p, t):
        extra = sorted({n for g in manifest.chain(fam) for n in g.input_names
                        if n.startswith(("lora_", "forecast_"))})
        if extra:
            raise ArtifactError(
                f"{folder}: graph {fam} takes {extra[0]} (and {len(extra) - 1} more runtime inputs) that "
                "onnxruntime-genai cannot feed; bundle an artifact compiled without lora_inputs/forecast_inputs")
    return p, t


def _link(src: Path, dst: Path, summary: BundleSummary) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        return
    size = src.stat().st_size
    try:
        os.link(src, dst)
        summary.linked_bytes += size
    except OSError:  # another filesystem: one copy
        shutil.copyfile(src, dst)
        summary.copied_bytes += size
        if "copied" not in " ".join(summary.notes):
            summary.notes.append("the output is on another filesystem than the artifact: files were copied")


def _refuse_mobc_ops(manifest: Manifest, folder: Path, families: tuple[str, ...]) -> None:
    """onnxruntime-genai sessions do not load mobc's own CPU kernels (toolchain/kernels/)."""
    for family in families:
        for record in manifest.chain(family):
            graph = onnx.load(str(folder / record.file), load_external_data=False).graph
            if any(n.domain == kernels.DOMAIN for n in graph.node):
                raise ArtifactError(
                    f"{folder}: graph {record.file} uses mobc's own CPU op ({kernels.DOMAIN}), which "
                    "onnxruntime-genai does not load; bundle an artifact compiled without "
                    "`matmul_nbits: {kernel_rows: ...}`, `cache_attention`, `fuse_attention_prologue`, "
                    "`fuse_silu_mul` and `certified_lm_head: {activations: int16}` or `{certificate: op}` (mobc run "
                    "executes this one)")


def _external_files(path: Path) -> list[str]:
    """The external-data files a graph refers to, relative to its own folder (weights stay unread)."""
    return sorted({info["location"] for *_, info in external_initializers(path)})


def _qnn_contexts(manifest: Manifest, folder: Path) -> dict[str, dict[str, Any]]:
    records = {r["graph"]: r for r in (manifest.qnn or []) if r.get("context_model")}
    if not records:
        raise ArtifactError(
            f"{folder} has no QNN context binaries: compile a recipe with a qnn: section "
            "(e.g. recipes/smollm2-135m-qnn.yaml), or bundle --target cpu")
    return records


def _write_onnx(model: onnx.ModelProto, path: Path, summary: BundleSummary) -> None:
    onnx.save(model, str(path))
    summary.written_bytes += path.stat().st_size


def _entry(filename: str, graph_inputs: list[str], graph_outputs: list[str], prompt: bool,
           session_options: dict[str, Any] | None = None, lm_head: bool = False) -> dict[str, Any]:
    entry: dict[str, Any] = {"filename": filename, "inputs": graph_inputs, "outputs": graph_outputs,
                             "run_on_prompt": prompt, "run_on_token_gen": not prompt}
    if lm_head:
        entry["is_lm_head"] = True  # genai skips it on all but the last prompt window
    entry["session_options"] = session_options or {"provider_options": []}
    return entry


def _io(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    return [i.name for i in model.graph.input], [o.name for o in model.graph.output]


def _family_stages(manifest: Manifest, artifact: Path, out: Path, family: str, prompt: bool, target: str,
                   rope: dict[str, np.ndarray], summary: BundleSummary,
                   kinds: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The family's pipeline entries in order; `kinds` gets each stage's kind (small / graph /
    epcontext), which the bundle record keeps for the structure check."""
    chain = manifest.chain(family)
    head = chain[0]
    layout = manifest.model.layout(head.width, head.context)
    tag = "prompt" if prompt else "token"
    pipeline: dict[str, dict[str, Any]] = {}

    def small(name: str, model: onnx.ModelProto) -> None:
        filename = f"{tag}_{name}.onnx"
        _write_onnx(model, out / filename, summary)
        pipeline[f"{tag}_{name}"] = _entry(filename, *_io(model), prompt)
        kinds[f"{tag}_{name}"] = "small"

    small("position_processor", stages.position_processor(layout, rope))
    small("kv_unpack", stages.kv_unpack(layout))
    contexts = _qnn_contexts(manifest, artifact) if target == "qnn" else {}
    for stage in chain:
        pipeline[f"{tag}_{stage.name}"] = _graph_stage(stage, artifact, out, prompt, contexts, summary)
        kinds[f"{tag}_{stage.name}"] = "epcontext" if contexts else "graph"
    small("kv_pack", stages.kv_pack(layout))
    return pipeline


def _graph_stage(stage: GraphRecord, artifact: Path, out: Path, prompt: bool,
                 contexts: dict[str, dict[str, Any]], summary: BundleSummary) -> dict[str, Any]:
    lm_head = stage.role == "lm_head"
    if contexts:
        record = contexts.get(stage.name)
        if record is None:
            raise ArtifactError(f"{artifact}: graph {stage.name} has no QNN context binary; recompile the recipe "
                                "with its qnn: section covering every graph")
        qnn_dir = artifact / "qnn"
        _link(qnn_dir / record["context_model"], out / "qnn" / record["context_model"], summary)
        for name in record["binaries"]:
            _link(qnn_dir / name, out / "qnn" / name, summary)
        options = {"provider_options": [{"qnn": dict(QNN_OPTIONS)}]}
        return _entry(f"qnn/{record['context_model']}", stage.input_names, stage.output_names, prompt,
                      options, lm_head)
    src = artifact / stage.file
    _link(src, out / stage.file, summary)
    for rel in _external_files(src):
        _link(src.parent / rel, (out / stage.file).parent / rel, summary)
    return _entry(stage.file, stage.input_names, stage.output_names, prompt, lm_head=lm_head)


def _special_ids(manifest: Manifest, artifact: Path) -> dict[str, int]:
    """bos, eos and the pad token genai pads prompts with: the tokenizer's own pad token unless it is
    missing or the bos token (genai would take a leading bos for padding), else the first eos."""
    model = manifest.model
    eos = list(model.eos_token_ids) or [0]
    tok = Tokenizer(artifact / "tokenizer")
    found = tok.convert_tokens_to_ids(tok.pad_token) if tok.pad_token else None
    pad = found if found is not None and found != model.bos_token_id else eos[0]
    bos = model.bos_token_id if model.bos_token_id is not None else eos[0]
    return {"bos": int(bos), "eos": [int(e) for e in eos], "pad": int(pad)}


def genai_config(manifest: Manifest, prompt_width: int, context: int, pipeline: dict[str, Any],
                 ids: dict[str, int]) -> dict[str, Any]:
    model = manifest.model
    return {
        "model": {
            "bos_token_id": ids["bos"],
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "head_size": model.head_dim,
                "hidden_size": model.hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": stages.GENAI_MASK,
                    "position_ids": stages.GENAI_POSITIONS,
                    "past_key_names": stages.genai_kv_pattern("key", "past"),
                    "past_value_names": stages.genai_kv_pattern("value", "past"),
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": stages.genai_kv_pattern("key", "present"),
                    "present_value_names": stages.genai_kv_pattern("value", "present"),
                },
                "num_attention_heads": model.n_heads,
                "num_hidden_layers": model.n_layers,
                "num_key_value_heads": model.n_kv,
                # prompts in windows of the prefill width; the float cache stays genai's default one
                # (its sliding cache holds uint8 only, toolchain/bundle/genai_stages.py)
                "sliding_window": {"window_size": prompt_width, "pad_value": 0, "slide_key_value_cache": False},
                "pipeline": [pipeline],
            },
            "eos_token_id": ids["eos"] if len(ids["eos"]) > 1 else ids["eos"][0],
            "pad_token_id": ids["pad"],
            "type": "decoder-pipeline",
            "vocab_size": model.vocab,
        },
        "search": {
            "do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context,
            "min_length": 0, "top_k": 1, "top_p": 1.0, "temperature": 1.0, "repetition_penalty": 1.0,
            "length_penalty": 1.0, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0,
            "early_stopping": True, "past_present_share_buffer": True,
        },
    }


def default_out(artifact: Path, target: str) -> Path:
    """ARTIFACT-genai beside the artifact; a quantized/ artifact's bundle goes beside its float
    artifact as NAME-quantized-genai (never inside an artifact folder)."""
    folder = Path(os.path.abspath(artifact))
    base = folder.name
    if base == "quantized" and (folder.parent / "manifest.json").is_file():
        base, folder = f"{folder.parent.name}-quantized", folder.parent
    return folder.parent / f"{base}-genai{'-qnn' if target == 'qnn' else ''}"


def write_bundle(artifact: str | Path, out: str | Path | None = None, target: str = "cpu",
                 force: bool = False) -> BundleSummary:
    artifact = Path(artifact)
    if target not in TARGETS:
        raise ArtifactError(f"--target {target!r}: choose one of {', '.join(TARGETS)}")
    manifest = Manifest.load(artifact)
    prompt_family, token_family = _families(manifest, artifact)
    head = manifest.chain(prompt_family)[0]
    out = Path(out) if out is not None else default_out(artifact, target)
    with np.load(artifact / ROPE) as z:
        rope = {k: z[k] for k in z.files}
    if int(next(iter(rope.values())).shape[0]) < head.context:
        raise ArtifactError(f"{artifact}/{ROPE} holds fewer positions than the context {head.context}; recompile")
    with staging(out, force, is_bundle) as tmp:
        summary = BundleSummary(folder=out, target=target, prompt_width=head.width, context=head.context, stages=[])
        pipeline, kinds = {}, {}
        for family, prompt in ((prompt_family, True), (token_family, False)):
            pipeline.update(_family_stages(manifest, artifact, tmp, family, prompt, target, rope, summary, kinds))
        if manifest.quantization:
            # QDQ graphs: onnxruntime's fused integer kernels are not the QDQ arithmetic mobc checks
            # against (artifact/qdq_arithmetic.py QDQ_EXACT); below EXTENDED it runs them unfused, exactly
            for entry in pipeline.values():
                if not entry["session_options"].get("provider_options"):
                    entry["session_options"]["graph_optimization_level"] = "ORT_ENABLE_BASIC"
        ids = _special_ids(manifest, artifact)
        config = genai_config(manifest, head.width, head.context, pipeline, ids)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (artifact / "tokenizer" / name).is_file():
                shutil.copyfile(artifact / "tokenizer" / name, tmp / name)
        summary.stages = [{"name": k, "file": v["filename"], "prompt": v["run_on_prompt"], "kind": kinds[k]}
                          for k, v in pipeline.items()]
        marker = {"format": FORMAT, "artifact": str(artifact.resolve()), "artifact_name": manifest.name,
                  "target": target, "prompt_family": prompt_family, "token_family": token_family,
                  "prompt_width": head.width, "context": head.context, "head_dim": manifest.model.head_dim,
                  "pad_token_id": ids["pad"], "stages": summary.stages,
                  "linked_bytes": summary.linked_bytes, "copied_bytes": summary.copied_bytes}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last: marks a complete bundle
    return summary


def load_marker(bundle: str | Path) -> dict[str, Any]:
    bundle = Path(bundle)
    path = bundle / MARKER
    if not path.is_file() or not (bundle / CONFIG).is_file():
        raise ArtifactError(f"{bundle} is not a bundle written by `mobc bundle genai` (no {MARKER} or {CONFIG})")
    try:
        marker = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); write the bundle again") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a mobc bundle record; write the bundle again")
    return marker


def is_bundle(folder: Path) -> bool:
    """A real folder holding a mobc bundle record (what --force may replace)."""
    try:
        return not folder.is_symlink() and load_marker(folder) is not None
    except ArtifactError:
        return False
