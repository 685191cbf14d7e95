"""QNN HTP context binaries, built and run on this machine through onnxruntime-qnn.

onnxruntime-qnn is an execution-provider *plugin*: the library is registered once per process,
then sessions ask for it through `add_provider_for_devices`. Its HTP backend compiles ("finalizes")
a graph exactly as a phone would and runs it by emulation, so a context binary built here is the
proof that a graph is a real NPU graph, and its outputs can be compared with the CPU EP.

Float graphs run in the backend's fp16 mode, which needs `soc_model` set (without it the backend
refuses fp16, and LLM graphs also fail to allocate). The offline compile is the EP's context cache:
`ep.context_enable=1` writes an EPContext model (`<name>_ctx.onnx`) plus the `<name>_ctx_qnn.bin` it points to.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from toolchain.artifact.qdq_arithmetic import QDQ_EXACT
from toolchain.errors import MobcError, VerificationError
from toolchain.qnn.diagnose import captured_stderr, explain_failure

log = logging.getLogger(__name__)

EP_NAME = "QNNExecutionProvider"
# HTP generations QAIRT 2.40 prepares for (v68 = SM8350 ... v81); others are typos, not new chips.
HTP_ARCHS = (68, 69, 73, 75, 79, 81)
# Platforms onnxruntime-qnn publishes wheels for: x86_64 Linux/Windows (offline prepare + emulation)
# and Windows on ARM (the real NPU).
WHEEL_PLATFORMS = {("Linux", "x86_64"), ("Windows", "AMD64"), ("Windows", "ARM64")}


class QnnUnavailableError(MobcError):
    """onnxruntime-qnn cannot be used on this machine."""


class QnnCompileError(MobcError):
    """The QNN HTP backend rejected a graph (unsupported node, or the graph failed to finalize)."""


class QnnMismatchError(VerificationError):
    """A context binary runs, but its outputs differ from the CPU EP beyond the recipe tolerance."""


class QnnSpec(BaseModel):
    """Recipe section `qnn:`: which HTP to compile for and how to verify the binaries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    soc_model: int = Field(57, ge=0, description="QNN SoC model id (57 compiled and ran here; see FINDINGS)")
    htp_arch: int = Field(75, description=f"HTP architecture version, one of {HTP_ARCHS}")
    fp16: bool = Field(True, description="run float graphs in the HTP's fp16 mode (false for QDQ graphs)")
    verify: bool = Field(True, description="run each binary on the emulated HTP and compare with the CPU EP")
    max_abs: float | None = Field(
        None, gt=0, description="fail when any output differs from CPU by more; unset = record only"
    )
    # the gate that carries across models: scale-free bounds and the tokens a user would get
    max_rel: float | None = Field(
        0.05, gt=0, description="fail when a non-logits output (KV rows, hidden states) differs from CPU by "
        "more than this fraction of its own largest |value| (SmolLM2's residual stream reaches 2e4, its "
        "K/V rows ~10: one absolute bound fits neither); unset = record only",
    )
    min_top1: float = Field(
        0.95, ge=0, le=1, description="fail when fewer logits rows than this keep the CPU EP's argmax"
    )
    top1_tie: float = Field(
        0.02, ge=0, description="a row whose HTP argmax the CPU scores within this of its own top logit "
        "counts as kept: a near tie that fp16 or integer rounding may resolve either way",
    )
    lockstep_tokens: int = Field(
        8, ge=0, description="greedy tokens decoded through the HTP decode binaries in lockstep with the "
        "CPU graphs (the CPU picks each token, both are fed it); 0 = skip. `mobc eval qnn` runs the long one",
    )
    min_lockstep: float = Field(
        0.95, ge=0, le=1, description="fail when fewer lockstep tokens than this have the CPU's argmax on the HTP"
    )
    on_unavailable: Literal["error", "skip"] = Field(
        "error", description="without onnxruntime-qnn for this platform: fail, or record the skip"
    )
    options: dict[str, str] = Field(
        default_factory=dict, description="extra QNN EP provider options, e.g. {vtcm_mb: '8'}"
    )

    @field_validator("htp_arch")
    @classmethod
    def _known_arch(cls, v: int) -> int:
        if v not in HTP_ARCHS:
            raise ValueError(f"unknown htp_arch {v}; use one of {', '.join(map(str, HTP_ARCHS))}")
        return v

    def provider_options(self) -> dict[str, str]:
        return provider_options(self.soc_model, self.htp_arch, self.fp16, self.options)


# ---------------------------------------------------------------- availability and registration


def availability() -> tuple[bool, str]:
    """(usable, reason): whether the onnxruntime-qnn plugin can be registered here."""
    plat = (platform.system(), platform.machine())
    try:
        import onnxruntime as ort
        import onnxruntime_qnn
    except ImportError as exc:
        where = "" if plat in WHEEL_PLATFORMS else f" (no wheel is published for {plat[0]} {plat[1]})"
        return False, f"onnxruntime-qnn is not installed{where}: {exc}"
    if not hasattr(ort, "register_execution_provider_library"):
        return False, f"onnxruntime {ort.__version__} cannot load EP plugins; onnxruntime-qnn needs >= 1.24.2"
    lib = Path(onnxruntime_qnn.get_library_path())
    if not lib.exists():
        return False, f"onnxruntime-qnn is installed but its library {lib} is missing"
    return True, f"onnxruntime-qnn {onnxruntime_qnn.__version__} on {plat[0]} {plat[1]}"


def declared_here() -> bool:
    """Whether onnxruntime-qnn is a declared dependency on this platform (pyproject.toml: Linux
    x86_64). There a missing or broken backend is an installation fault to report, not a skip."""
    return (platform.system(), platform.machine()) == ("Linux", "x86_64")


def require() -> None:
    ok, reason = availability()
    if not ok:
        raise QnnUnavailableError(
            f"QNN HTP context binaries need onnxruntime-qnn: {reason}. Install it (Linux x86_64 or "
            "Windows) with `pip install onnxruntime-qnn`, or set `qnn: {on_unavailable: skip}`"
        )


_lock = threading.Lock()
_registered = False


def register() -> list[Any]:
    """Registers the QNN EP plugin (once per process) and returns its EP devices."""
    global _registered
    require()
    import onnxruntime as ort
    import onnxruntime_qnn

    with _lock:
        if not _registered:
            try:
                ort.register_execution_provider_library(EP_NAME, onnxruntime_qnn.get_library_path())
            except Exception as exc:  # someone else in the process registered it first: fine
                if "already" not in str(exc).lower():
                    raise QnnUnavailableError(f"registering the QNN EP plugin failed: {exc}") from exc
            _registered = True
    devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
    if not devices:
        raise QnnUnavailableError("the QNN EP plugin registered but offers no device on this machine")
    return devices


def provider_options(
    soc_model: int, htp_arch: int, fp16: bool, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    opts = {"backend_type": "htp", "soc_model": str(soc_model), "htp_arch": str(htp_arch)}
    if fp16:
        opts["enable_htp_fp16_precision"] = "1"
    opts.update({k: str(v) for k, v in (extra or {}).items()})
    return opts


# ---------------------------------------------------------------- sessions


def session(
    onnx_path: str | Path,
    provider: Literal["cpu", "qnn"] = "cpu",
    options: Mapping[str, str] | None = None,
    config: Mapping[str, str] | None = None,
    base: Any = None,
) -> Any:
    """An InferenceSession on the CPU EP, or on QNN HTP alone (no silent CPU fallback).

    options: QNN provider options (see `provider_options`); config: session config entries; base:
    SessionOptions to start from (the runtime's, with its thread pool).
    A backend rejection is raised as QnnCompileError naming the nodes and the pass that fixes them.
    """
    import onnxruntime as ort

    so = base if base is not None else ort.SessionOptions()
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    if provider == "cpu":
        so.add_session_config_entry(*QDQ_EXACT)  # the QDQ arithmetic, not fused integer kernels
        return ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    devices = register()
    so.add_provider_for_devices(devices, dict(options or provider_options(57, 75, True)))
    # A graph that only half runs on the NPU is not what we claim to build: fail instead.
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.log_severity_level = 2  # warnings carry "Unsupported nodes in QNN EP: {...}"
    with captured_stderr() as log_text:
        try:
            sess = ort.InferenceSession(str(onnx_path), so)
        except Exception as exc:
            raise QnnCompileError(explain_failure(Path(onnx_path), str(exc), log_text())) from None
    return sess


def run(sess: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(names, {k: v for k, v in feeds.items() if k in wanted}), strict=True))


# ---------------------------------------------------------------- context binaries


@dataclass
class ContextBinary:
    model: Path  # the EPContext .onnx (what a runtime loads)
    binaries: list[Path]  # the QNN context binaries it references
    seconds: float

    @property
    def bytes(self) -> int:
        return sum(p.stat().st_size for p in self.binaries) + self.model.stat().st_size


def build_context_binary(
    onnx_path: str | Path,
    out_dir: str | Path,
    soc_model: int = 57,
    htp_arch: int = 75,
    fp16: bool = True,
    options: Mapping[str, str] | None = None,
    name: str | None = None,
) -> ContextBinary:
    """Compiles onnx_path into out_dir/<name>_ctx.onnx (EPContext model, ORT naming) + its QNN context binary.

    Written into a temporary folder and moved into place, so an interrupted build never leaves a
    context model without its binary. The EPContext node refers to the binary by file name, so the
    pair stays valid as long as it is moved together.
    """
    onnx_path, out_dir = Path(onnx_path), Path(out_dir)
    name = name or onnx_path.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    opts = provider_options(soc_model, htp_arch, fp16, options)
    with tempfile.TemporaryDirectory(prefix=f".{name}-qnn-", dir=out_dir) as tmp:
        ctx = Path(tmp) / f"{name}_ctx.onnx"
        config = {
            "ep.context_enable": "1",
            "ep.context_file_path": str(ctx),
            "ep.context_embed_mode": "0",  # binary beside the model: no 2 GB protobuf limit
        }
        start = time.perf_counter()
        sess = session(onnx_path, "qnn", opts, config)
        seconds = time.perf_counter() - start
        del sess
        if not ctx.exists():
            raise QnnCompileError(f"QNN EP built a session for {onnx_path.name} but wrote no context model")
        made = sorted(Path(tmp).iterdir())
        for p in made:
            shutil.move(str(p), out_dir / p.name)
    model = out_dir / ctx.name
    binaries = [out_dir / p.name for p in made if p.name != ctx.name]
    log.info("qnn: %s -> %s (%.1f s)", onnx_path.name, model.name, seconds)
    return ContextBinary(model=model, binaries=binaries, seconds=seconds)


# ---------------------------------------------------------------- verification


@dataclass
class Comparison:
    max_abs: dict[str, float]  # per output: max |qnn - cpu|
    max_rel: dict[str, float] = field(default_factory=dict)  # per output: max |qnn - cpu| / max |cpu|
    argmax_agreement: dict[str, float] = field(default_factory=dict)  # logits outputs only
    cpu_seconds: float = 0.0
    qnn_seconds: float = 0.0
    qnn_outputs: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    cpu_outputs: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    # with a float reference (a quantized graph's float original, same inputs):
    # per output, how much farther the HTP is from the float graph than the CPU simulation is, over the
    # float tensor's largest |value| (<= 0: as accurate as the simulation)
    excess_rel: dict[str, float] = field(default_factory=dict)
    argmax_vs_cpu: dict[str, float] = field(default_factory=dict)  # rows with the CPU's pick (tie rule) alone
    argmax_vs_float: dict[str, dict[str, float]] = field(default_factory=dict)  # {cpu, htp}: rows with float's pick

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.max_abs, key=lambda k: self.max_abs[k])
        return name, self.max_abs[name]


def compare(cpu: Mapping[str, np.ndarray], qnn: Mapping[str, np.ndarray], tie: float = 0.0,
            reference: Mapping[str, np.ndarray] | None = None) -> Comparison:
    """Per output: max |diff|, that relative to the CPU tensor's largest |value|, and for logits the
    share of rows whose HTP argmax the CPU scores within `tie` of its own top logit.

    reference: the float graph's outputs on the same inputs, for a quantized graph. The CPU simulation
    and the HTP are then two roundings of one model: a logits row also counts as kept when the HTP
    picks the float graph's token (the CPU's pick was a near tie the simulation's own rounding
    decided), and `excess_rel` says how much farther from the float graph the HTP is than the CPU."""
    diffs, rel, agree = {}, {}, {}
    excess, vs_cpu, vs_float = {}, {}, {}
    for name, ref in cpu.items():
        got = np.asarray(qnn[name], dtype=np.float64)
        ref64 = np.asarray(ref, dtype=np.float64)
        # non-finite on the NPU (fp16 overflow) is the worst possible difference, not a NaN to ignore
        finite = np.isfinite(got).all()
        diffs[name] = float("inf") if not finite else float(np.abs(got - ref64).max())
        rel[name] = diffs[name] / max(float(np.abs(ref64).max()) if ref64.size else 0.0, 1e-6)
        flt = None if reference is None or name not in reference else np.asarray(reference[name], np.float64)
        if flt is not None:
            scale = max(float(np.abs(flt).max()) if flt.size else 0.0, 1e-6)
            htp_err = float(np.abs(got - flt).max()) if finite else float("inf")
            excess[name] = (htp_err - float(np.abs(ref64 - flt).max())) / scale
        if name.startswith("logits"):
            rows, mine = ref64.reshape(-1, ref64.shape[-1]), got.reshape(-1, ref64.shape[-1]).argmax(-1)
            kept = mine == rows.argmax(-1)
            if tie > 0:
                kept |= np.take_along_axis(rows, mine[:, None], -1)[:, 0] >= rows.max(-1) - tie
            if flt is not None:
                vs_cpu[name] = float(kept.mean())
                picks = flt.reshape(rows.shape).argmax(-1)
                vs_float[name] = {"cpu": float((rows.argmax(-1) == picks).mean()), "htp": float((mine == picks).mean())}
                kept |= mine == picks
            agree[name] = float(kept.mean())
    return Comparison(max_abs=diffs, max_rel=rel, argmax_agreement=agree, excess_rel=excess,
                      argmax_vs_cpu=vs_cpu, argmax_vs_float=vs_float)


FP16_HINT = ("If it is inf or very large, activations overflow fp16: add `scale_rmsnorm` (and "
             "`rescale_residual` for residual streams above 65504) to the recipe's passes")
QUANT_HINT = ("The HTP runs the integer kernels the CPU EP simulates: a gap this large points at an encoding "
              "the HTP treats differently; `mobc eval qnn` compares the quantized graphs call by call")


def gate_hint(spec: QnnSpec) -> str:
    return FP16_HINT if spec.fp16 else QUANT_HINT


def check_gate(graph: str, cmp: Comparison, spec: QnnSpec) -> None:
    """Raises QnnMismatchError naming the graph, the output and the bound it broke."""
    where = f"QNN HTP binary of graph {graph!r}"
    for name, agree in cmp.argmax_agreement.items():
        if agree < spec.min_top1:
            picks = "the CPU EP's (or the float graph's) argmax" if name in cmp.argmax_vs_float else "the CPU EP's argmax"
            raise QnnMismatchError(
                f"{where}: {name} keeps {picks} on {agree:.1%} of its rows < qnn.min_top1 "
                f"{spec.min_top1:.0%} (max |diff| {cmp.max_abs[name]:.3g}). {gate_hint(spec)}; lower qnn.min_top1 "
                "only if you accept different tokens on the phone"
            )
    if spec.max_rel is not None:
        for name, rel in cmp.max_rel.items():
            if name.startswith("logits") or rel <= spec.max_rel:
                continue
            excess = cmp.excess_rel.get(name)
            # a quantized output may differ from the CPU simulation by more, as long as it is no farther
            # from the float graph than the simulation is (within the same bound)
            if excess is not None and excess <= spec.max_rel:
                continue
            beyond = "" if excess is None else f", and is {excess:.3g} farther from the float graph than the CPU is"
            raise QnnMismatchError(
                f"{where}: output {name!r} differs from the CPU EP by {rel:.3g} of its largest |value|{beyond} "
                f"> qnn.max_rel {spec.max_rel:g} (max |diff| {cmp.max_abs[name]:.4g}). {gate_hint(spec)}"
            )
    worst_name, worst = cmp.worst
    if spec.max_abs is not None and not worst <= spec.max_abs:
        raise QnnMismatchError(
            f"{where}: output {worst_name!r} differs from the CPU EP by {worst:.4g} > qnn.max_abs "
            f"{spec.max_abs:g}. {gate_hint(spec)}"
        )


def worst_of(comparisons: list[Comparison]) -> Comparison:
    """The gate's view of several calls of one graph: per output the largest difference and the
    lowest argmax agreement among them; seconds summed."""
    first = comparisons[0]
    return Comparison(
        max_abs={k: max(c.max_abs[k] for c in comparisons) for k in first.max_abs},
        max_rel={k: max(c.max_rel[k] for c in comparisons) for k in first.max_rel},
        argmax_agreement={k: min(c.argmax_agreement[k] for c in comparisons) for k in first.argmax_agreement},
        cpu_seconds=sum(c.cpu_seconds for c in comparisons),
        qnn_seconds=sum(c.qnn_seconds for c in comparisons),
        excess_rel={k: max(c.excess_rel[k] for c in comparisons) for k in first.excess_rel},
        argmax_vs_cpu={k: min(c.argmax_vs_cpu[k] for c in comparisons) for k in first.argmax_vs_cpu},
        argmax_vs_float={k: {who: min(c.argmax_vs_float[k][who] for c in comparisons) for who in ("cpu", "htp")}
                         for k in first.argmax_vs_float},
    )


def run_and_compare(
    onnx_path: str | Path,
    ctx_path: str | Path,
    feeds: Mapping[str, np.ndarray],
    options: Mapping[str, str] | None = None,
    tie: float = 0.0,
    reference: Mapping[str, np.ndarray] | None = None,
) -> Comparison:
    """Runs the source graph on the CPU EP and its context binary on the (emulated) HTP; `reference`:
    the float graph's outputs on the same feeds, for a quantized graph (see `compare`)."""
    cpu_sess = session(onnx_path, "cpu")
    start = time.perf_counter()
    cpu_out = run(cpu_sess, feeds)
    cpu_s = time.perf_counter() - start
    del cpu_sess
    qnn_sess = session(ctx_path, "qnn", options)
    start = time.perf_counter()
    qnn_out = run(qnn_sess, feeds)
    qnn_s = time.perf_counter() - start
    result = compare(cpu_out, qnn_out, tie, reference)
    result.cpu_seconds, result.qnn_seconds = cpu_s, qnn_s
    result.qnn_outputs, result.cpu_outputs = qnn_out, cpu_out
    return result


def random_feeds(onnx_path: str | Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs from a graph's declared shapes, for graphs the caller gave none for.

    Step-graph inputs get plausible values: token ids in range, zero masks (attend everything),
    small cache values; anything else is N(0, 1).
    """
    sess = session(onnx_path, "cpu")
    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in sess.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in inp.shape]
        if "int" in inp.type:
            dtype = np.int64 if "int64" in inp.type else np.int32
            feeds[inp.name] = rng.integers(0, 100, shape).astype(dtype)
        elif inp.name.startswith("attention_mask"):
            feeds[inp.name] = np.zeros(shape, np.float32)
        elif inp.name.startswith(("past_", "position_")):
            feeds[inp.name] = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


# per graph name: one call's inputs, or several calls' (the gate holds for each)
Feeds = Mapping[str, np.ndarray] | list[Mapping[str, np.ndarray]]
FeedSource = Mapping[str, Feeds] | Callable[[str], Feeds] | None


def emit_qnn(
    graph_files: Mapping[str, str | Path],
    out_dir: str | Path,
    qnn_cfg: QnnSpec,
    feeds: FeedSource = None,
    references: Mapping[str, list[Mapping[str, np.ndarray]]] | None = None,
) -> list[dict[str, Any]]:
    """Pipeline stage: a context binary per emitted graph, verified against the CPU EP.

    graph_files: graph name -> .onnx path; feeds: per graph name (mapping or callable) one call's
    inputs or a list of calls', falling back to `random_feeds`; references: per graph name, the float
    graph's outputs on each call (quantized graphs; see `compare`). Returns one manifest record per graph (paths relative to out_dir).
    Raises QnnCompileError when the backend rejects a graph, QnnMismatchError when a binary's
    outputs exceed `qnn_cfg.max_abs`.
    """
    out_dir = Path(out_dir)
    ok, reason = availability()
    if not ok and qnn_cfg.on_unavailable == "skip":
        log.warning("qnn: skipped (%s)", reason)
        return [{"graph": g, "status": "skipped", "reason": reason} for g in graph_files]
    require()
    opts = qnn_cfg.provider_options()
    records = []
    for name, path in graph_files.items():
        binary = build_context_binary(
            path, out_dir, qnn_cfg.soc_model, qnn_cfg.htp_arch, qnn_cfg.fp16, qnn_cfg.options, name=name
        )
        record: dict[str, Any] = {
            "graph": name,
            "status": "built",
            "source": os.path.relpath(path, out_dir),
            "context_model": binary.model.name,
            "binaries": [p.name for p in binary.binaries],
            "bytes": binary.bytes,
            "build_seconds": round(binary.seconds, 2),
            "soc_model": qnn_cfg.soc_model,
            "htp_arch": qnn_cfg.htp_arch,
            "fp16": qnn_cfg.fp16,
        }
        if qnn_cfg.verify:
            if callable(feeds):
                graph_feeds = feeds(name)
            elif feeds is not None and name in feeds:
                graph_feeds = feeds[name]
            else:
                graph_feeds = random_feeds(path)
            calls = graph_feeds if isinstance(graph_feeds, list) else [graph_feeds]
            refs = (references or {}).get(name) or [None] * len(calls)
            cmp = worst_of([run_and_compare(path, binary.model, f, opts, qnn_cfg.top1_tie, r)
                            for f, r in zip(calls, refs, strict=True)])
            worst_name, worst = cmp.worst
            record["status"] = "verified"
            record["verify"] = {
                "max_abs": {k: float(f"{v:.4g}") for k, v in cmp.max_abs.items()},
                "max_rel": {k: float(f"{v:.4g}") for k, v in cmp.max_rel.items()},
                "worst_output": worst_name,
                "worst_max_abs": worst,
                "argmax_agreement": cmp.argmax_agreement,
                "calls": len(calls),
                **({"excess_rel": {k: float(f"{v:.4g}") for k, v in cmp.excess_rel.items()},
                    "argmax_vs_cpu": cmp.argmax_vs_cpu, "argmax_vs_float": cmp.argmax_vs_float}
                   if cmp.excess_rel else {}),
                "cpu_seconds": round(cmp.cpu_seconds, 3),
                "htp_emulated_seconds": round(cmp.qnn_seconds, 3),
            }
            check_gate(name, cmp, qnn_cfg)
        records.append(record)
    return records
