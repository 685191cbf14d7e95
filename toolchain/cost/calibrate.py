"""Turn measured graph latencies into a device profile the cost model reads.

Inputs, one per graph call measured (auto-detected by `read_latency`):
- an AI Hub profile JSON (`InferenceJob.download_profile(filename)`). Its shape is qai_hub
  0.56's `client._profile_pb_to_python_dict`: {"execution_summary": {"estimated_inference_time"
  (microseconds), "all_inference_times": [...], ...}, "execution_detail": [{"name", "type",
  "compute_unit" (NPU/GPU/CPU), "execution_time", "execution_cycles"}, ...]}. ai-hub-models
  reads it the same way (estimated_inference_time / 1000 = ms).
- an onnxruntime profile (SessionOptions.enable_profiling): a Chrome-trace JSON list whose
  {"cat": "Session", "name": "model_run", "dur": us} events time each run.
- the QNN EP's profiling CSV (provider options profiling_level + profiling_file_path), header
  "Msg Timestamp,Message,Time,Unit of Measurement,Timing Source,Event Level,Event Identifier",
  one block of ROOT events per run: "QNN (execute) time" (us, includes the RPC to the NPU)
  or else "Accelerator (execute) time".
The first of several runs is dropped (warm-up) and the median of the rest is the latency.

Fit: a profiled graph runs with all weights in DRAM, so under the base profile each
measurement is either DRAM-bound or compute-bound. Memory-bound graphs (decode, width 1)
give dram_efficiency = bytes / ((t - overhead) x peak); compute-bound ones (prefill) give
npu_efficiency = FLOPs / ((t - overhead) x TOPS x precision scale). The median over the
graphs is written; flash speed is not observable this way and stays as in the base profile.
"""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from toolchain.cost.model import CostModel, DeviceProfile, DeviceProfileError, GraphCost

_QNN_CSV_HEADER = "Msg Timestamp,Message,Time,Unit of Measurement"
_QNN_TOTAL_IDS = ("QNN (execute) time", "Accelerator (execute) time")


@dataclass
class Measurement:
    graph: str
    latency_s: float
    cost: GraphCost
    source: str = ""
    runs: int = 1
    compute_units: dict[str, int] = field(default_factory=dict)  # ops per unit, from AI Hub


def _steady(values_us: list[float]) -> float:
    vals = [float(v) for v in values_us if v is not None and float(v) > 0]
    if len(vals) > 1:
        vals = vals[1:]  # the first run pays warm-up (caches, clocks ramping)
    if not vals:
        raise ValueError("no positive timings")
    return statistics.median(vals) * 1e-6


def read_aihub_profile(data: dict[str, Any]) -> tuple[float, int, dict[str, int]]:
    summary = data["execution_summary"]
    # AI Hub's estimate already summarizes its repeated runs (all_inference_times)
    latency = float(summary["estimated_inference_time"]) * 1e-6
    if latency <= 0:
        raise ValueError("estimated_inference_time is not positive")
    runs = len(summary.get("all_inference_times") or [0])
    units: dict[str, int] = {}
    for op in data.get("execution_detail", []):
        unit = str(op.get("compute_unit", "?"))
        units[unit] = units.get(unit, 0) + 1
    return latency, runs, units


def read_ort_trace(events: list[dict[str, Any]]) -> tuple[float, int]:
    runs = [e["dur"] for e in events if e.get("name") == "model_run" and e.get("cat") == "Session"]
    return _steady(runs), len(runs)


def read_qnn_csv(text: str) -> tuple[float, int]:
    rows = list(csv.DictReader(text.splitlines()))
    for ident in _QNN_TOTAL_IDS:
        runs = [
            float(r["Time"])
            for r in rows
            if (r.get("Event Identifier") or "").strip().strip('"') == ident
            and (r.get("Unit of Measurement") or "").strip().upper() == "US"
        ]
        if runs:
            return _steady(runs), len(runs)
    raise ValueError(f"no ROOT event named {' or '.join(_QNN_TOTAL_IDS)} in microseconds")


def read_latency(path: str | Path) -> tuple[float, int, dict[str, int]]:
    """(steady per-call latency in s, runs, compute-unit op counts) from any supported profile file."""
    path = Path(path)
    if not path.is_file():
        raise DeviceProfileError(f"profile file {path} does not exist")
    text = path.read_text()
    try:
        if text.lstrip().startswith(_QNN_CSV_HEADER):
            return (*read_qnn_csv(text), {})
        data = json.loads(text)
        if isinstance(data, dict) and "execution_summary" in data:
            return read_aihub_profile(data)
        if isinstance(data, list):
            return (*read_ort_trace(data), {})
        if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
            return (*read_ort_trace(data["traceEvents"]), {})
    except (ValueError, KeyError, TypeError) as e:
        raise DeviceProfileError(f"{path}: cannot read a latency from this profile ({e})") from None
    raise DeviceProfileError(
        f"{path}: not an AI Hub profile JSON, an onnxruntime profile JSON or a QNN profiling CSV; "
        "download it with `mobc hub profile` or enable onnxruntime/QNN EP profiling"
    )


def measure(graph: str, profile_path: str | Path, cost: GraphCost) -> Measurement:
    latency, runs, units = read_latency(profile_path)
    return Measurement(graph, latency, cost, str(profile_path), runs, units)


def calibrate(base: DeviceProfile, measurements: list[Measurement], name: str | None = None) -> DeviceProfile:
    """A profile whose DRAM/NPU efficiencies reproduce the measured latencies (see module doc)."""
    if not measurements:
        raise DeviceProfileError("nothing to calibrate from: no profiled graphs were given")
    model = CostModel(base, dram_budget=1.0)  # profiled graphs hold every weight in DRAM
    overhead = base.call_overhead_ms * 1e-3
    dram_fits: list[float] = []
    npu_fits: list[float] = []
    notes: list[str] = []
    records: list[dict[str, Any]] = []
    for m in measurements:
        pred = model.call_latency(m.cost)
        busy = m.latency_s - overhead * m.cost.calls
        rec: dict[str, Any] = {
            "graph": m.graph,
            "source": m.source,
            "measured_ms": round(m.latency_s * 1e3, 4),
            "predicted_before_ms": round(pred.total_s * 1e3, 4),
            "bound": "dram" if pred.dram_s >= pred.compute_s else "compute",
        }
        if m.compute_units and set(m.compute_units) - {"NPU"}:
            notes.append(f"{m.graph}: ops ran on {m.compute_units}, not only the NPU; the fit blames the NPU")
        if busy <= 0:
            notes.append(
                f"{m.graph}: measured {m.latency_s * 1e3:.3f} ms is below the call overhead; skipped"
            )
            records.append(rec)
            continue
        if rec["bound"] == "dram" and pred.dram_bytes:
            fit = pred.dram_bytes / busy / (base.dram_peak_gbps * 1e9)
            rec["dram_efficiency"] = round(fit, 4)
            dram_fits.append(fit)
        elif pred.compute_s > 0:
            fit = m.cost.flops / busy / (base.npu_int8_tops * 1e12 * base.precision_scale[m.cost.precision])
            rec["npu_efficiency"] = round(fit, 4)
            npu_fits.append(fit)
        records.append(rec)

    def settle(fits: list[float], what: str, default: float) -> float:
        if not fits:
            return default
        value = statistics.median(fits)
        if value > 1.0:
            notes.append(
                f"fitted {what} {value:.2f} exceeds the peak: the base profile's peak is too low or the "
                "on-device graph reads fewer bytes than the artifact (e.g. AI Hub quantized it); capped at 1"
            )
            value = 1.0
        return round(value, 4)

    fitted = replace(
        base,
        name=name or f"{base.name}-calibrated",
        dram_efficiency=settle(dram_fits, "dram_efficiency", base.dram_efficiency),
        npu_efficiency=settle(npu_fits, "npu_efficiency", base.npu_efficiency),
    )
    after = CostModel(fitted, dram_budget=1.0)
    for m, rec in zip(measurements, records, strict=True):
        rec["predicted_after_ms"] = round(after.call_latency(m.cost).total_s * 1e3, 4)
    calibration = {"base": base.name, "measurements": records}
    if notes:
        calibration["notes"] = notes
    if not dram_fits:
        calibration.setdefault("notes", []).append("no DRAM-bound graph measured: dram_efficiency kept")
    if not npu_fits:
        calibration.setdefault("notes", []).append("no compute-bound graph measured: npu_efficiency kept")
    return replace(fitted, calibration=calibration)
