"""Phone latency model: predicts one graph call's latency on a Snapdragon NPU.

A call reads weights (from DRAM when the layer is resident, else from flash and then DRAM),
reads and writes activations and KV rows in DRAM, and does FLOPs on the NPU:

    flash_s   = streamed weight bytes / flash bandwidth
    dram_s    = (all weight bytes + KV bytes + other I/O bytes) / (DRAM peak x efficiency)
    compute_s = FLOPs / (INT8 TOPS x precision scale x NPU efficiency)
    on_chip   = max(dram_s, compute_s)            # roofline: the NPU's DMA overlaps the two
    total     = overhead + (1 - f) x flash_s + max(on_chip, f x flash_s)

where f = flash_overlap is the fraction of flash reading hidden behind compute by
prefetching (0 = Lever's Flash-AR baseline: layers stream synchronously every call).
Streamed bytes are counted in DRAM too: the NPU reads them from the staging buffer the
flash DMA wrote. The DRAM budget decides which layers are resident: shared (non-layer)
weights first because every call needs them, then decoder layers in index order, whole
layers only. Numbers live in toolchain/cost/devices.yaml (with sources); a measured
profile YAML (`base: <device>` plus fields) overrides them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from toolchain.errors import MobcError

GB = 1e9


class DeviceProfileError(MobcError):
    """A device profile name or file is unknown or malformed."""


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flash_read_gbps: float
    dram_peak_gbps: float
    dram_efficiency: float
    npu_int8_tops: float
    npu_efficiency: float
    call_overhead_ms: float
    precision_scale: dict[str, float] = field(default_factory=lambda: {"int8": 1.0})
    flash_overlap: float = 0.0
    dram_total_gb: float = 0.0
    dram_app_budget_gb: float = 0.0
    description: str = ""
    soc_model: int | None = None
    htp_arch: int | None = None
    aliases: tuple[str, ...] = ()
    calibration: dict[str, Any] = field(default_factory=dict)  # provenance of measured numbers

    @property
    def dram_bytes_per_s(self) -> float:
        return self.dram_peak_gbps * GB * self.dram_efficiency

    @property
    def flash_bytes_per_s(self) -> float:
        return self.flash_read_gbps * GB

    def ops_per_s(self, precision: str) -> float:
        if precision not in self.precision_scale:
            raise DeviceProfileError(
                f"device profile {self.name!r} has no throughput for precision {precision!r} "
                f"(known: {', '.join(sorted(self.precision_scale))}); add it under precision_scale"
            )
        return self.npu_int8_tops * 1e12 * self.precision_scale[precision] * self.npu_efficiency


_REQUIRED = (
    "flash_read_gbps",
    "dram_peak_gbps",
    "dram_efficiency",
    "npu_int8_tops",
    "npu_efficiency",
    "call_overhead_ms",
)
_FIELDS = {f.name for f in fields(DeviceProfile)}


def _builtin() -> dict[str, dict[str, Any]]:
    text = resources.files("toolchain.cost").joinpath("devices.yaml").read_text()
    return yaml.safe_load(text)["devices"]


def available_profiles() -> list[str]:
    return sorted(_builtin())


def _resolve_name(name: str, table: dict[str, dict[str, Any]]) -> str | None:
    key = name.strip().lower()
    for dev, spec in table.items():
        if key == dev or key in (a.lower() for a in spec.get("aliases", [])):
            return dev
    return None


def profile_from_dict(data: dict[str, Any], origin: str) -> DeviceProfile:
    """Build a profile from a mapping; `base:` names a built-in profile whose fields it overrides."""
    if not isinstance(data, dict):
        raise DeviceProfileError(f"{origin}: a device profile must be a mapping of fields")
    data = dict(data)
    base = data.pop("base", None)
    merged: dict[str, Any] = {}
    if base is not None:
        table = _builtin()
        dev = _resolve_name(str(base), table)
        if dev is None:
            raise DeviceProfileError(
                f"{origin}: base {base!r} is not a known device; use one of {', '.join(sorted(table))}"
            )
        merged.update(table[dev], name=dev)
    merged.update(data)
    unknown = sorted(set(merged) - _FIELDS)
    if unknown:
        raise DeviceProfileError(
            f"{origin}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_FIELDS))}"
        )
    missing = [k for k in _REQUIRED if k not in merged]
    if missing:
        raise DeviceProfileError(
            f"{origin}: missing {', '.join(missing)}; set them or add `base: <device>` "
            f"(one of {', '.join(available_profiles())})"
        )
    merged.setdefault("name", Path(origin).stem)
    merged["aliases"] = tuple(merged.get("aliases", ()))
    for k in _REQUIRED + ("flash_overlap",):
        v = merged[k] if k in merged else 0.0
        if not isinstance(v, int | float) or v < 0:
            raise DeviceProfileError(f"{origin}: {k} must be a non-negative number, got {v!r}")
    if not 0.0 <= float(merged.get("flash_overlap", 0.0)) <= 1.0:
        raise DeviceProfileError(f"{origin}: flash_overlap must be between 0 and 1")
    return DeviceProfile(**merged)


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """A built-in device by name or alias, or a YAML file (optionally `base:` + overrides)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise DeviceProfileError(f"device profile file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise DeviceProfileError(f"{path}: not valid YAML ({e})") from None
        return profile_from_dict(data, str(path))
    table = _builtin()
    dev = _resolve_name(str(name_or_path), table)
    if dev is None:
        raise DeviceProfileError(
            f"unknown device profile {str(name_or_path)!r}; use one of {', '.join(sorted(table))} "
            "or the path of a profile YAML (e.g. one written by `mobc hub calibrate`)"
        )
    return profile_from_dict({"base": dev}, dev)


def save_profile(profile: DeviceProfile, path: str | Path, base: str | None = None) -> Path:
    """Write a profile YAML; with `base`, only the fields that differ from that device."""
    data: dict[str, Any] = {f.name: getattr(profile, f.name) for f in fields(DeviceProfile)}
    data["aliases"] = list(profile.aliases)
    if base is not None:
        ref = load_profile(base)
        data = {
            k: v
            for k, v in data.items()
            if k in ("name", "calibration") or (k != "aliases" and v != getattr(ref, k))
        }
        data = {"base": ref.name, **data}
    path = Path(path)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---- what one call costs ---------------------------------------------------------------------


@dataclass(frozen=True)
class GraphCost:
    """The work of one graph call (or a chain of calls, when summed).

    layer_weight_bytes: bytes of weights read per decoder layer index.
    shared_weight_bytes: weights outside any layer (lm_head, final norm, embedding rows).
    flops_per_token: FLOPs per token position; a call does flops_per_token x width.
    kv_bytes: KV cache bytes read and written; io_bytes: other graph inputs/outputs.
    precision: NPU arithmetic ("int8", "int16", "fp16"), a key of precision_scale.
    calls: graph executions this cost stands for (each pays the call overhead).
    """

    layer_weight_bytes: dict[int, int] = field(default_factory=dict)
    shared_weight_bytes: int = 0
    flops_per_token: float = 0.0
    width: int = 1
    kv_bytes: int = 0
    io_bytes: int = 0
    precision: str = "int8"
    calls: int = 1
    name: str = ""

    @property
    def flops(self) -> float:
        return self.flops_per_token * self.width

    @property
    def weight_bytes(self) -> int:
        return self.shared_weight_bytes + sum(self.layer_weight_bytes.values())

    def __add__(self, other: GraphCost) -> GraphCost:
        """Chain two calls of one forward pass (parts of a split graph). The result keeps this call's
        width; a later stage at another width (a prefill's lm_head on its last row only) adds its
        own total FLOPs."""
        if other.precision != self.precision:
            raise ValueError(f"cannot chain precisions {self.precision} and {other.precision}")
        layers = dict(self.layer_weight_bytes)
        for k, v in other.layer_weight_bytes.items():
            layers[k] = layers.get(k, 0) + v
        return replace(
            self,
            layer_weight_bytes=layers,
            shared_weight_bytes=self.shared_weight_bytes + other.shared_weight_bytes,
            flops_per_token=self.flops_per_token + other.flops / self.width,
            kv_bytes=self.kv_bytes + other.kv_bytes,
            io_bytes=self.io_bytes + other.io_bytes,
            calls=self.calls + other.calls,
            name="+".join(n for n in (self.name, other.name) if n),
        )


@dataclass(frozen=True)
class Residency:
    """Which weights live in DRAM; everything else streams from flash on every call."""

    resident_layers: frozenset[int]
    shared_resident: bool
    budget_bytes: float

    def split(self, cost: GraphCost) -> tuple[int, int]:
        """(bytes read from DRAM-resident weights, bytes streamed from flash) for one call."""
        dram = cost.shared_weight_bytes if self.shared_resident else 0
        flash = 0 if self.shared_resident else cost.shared_weight_bytes
        for layer, b in cost.layer_weight_bytes.items():
            if layer in self.resident_layers:
                dram += b
            else:
                flash += b
        return dram, flash


def plan_residency(model: GraphCost, budget_bytes: float) -> Residency:
    """Shared weights first (every call reads them), then layers in index order, whole layers."""
    left = budget_bytes
    shared = model.shared_weight_bytes <= left
    if shared:
        left -= model.shared_weight_bytes
    resident: set[int] = set()
    for layer in sorted(model.layer_weight_bytes):
        b = model.layer_weight_bytes[layer]
        if b > left:
            break  # keep a contiguous prefix so parts split by layer range stay predictable
        resident.add(layer)
        left -= b
    return Residency(frozenset(resident), shared, budget_bytes)


@dataclass(frozen=True)
class CallLatency:
    total_s: float
    flash_s: float
    dram_s: float
    compute_s: float
    overhead_s: float
    flash_bytes: int
    dram_bytes: int

    @property
    def bound(self) -> str:
        """The term that dominates: flash, dram or compute."""
        return max((self.flash_s, "flash"), (self.dram_s, "dram"), (self.compute_s, "compute"))[1]


class CostModel:
    """Predicts per-call latency for a device profile and a DRAM budget.

    dram_budget: bytes (int/float > 1), a fraction of the model's weight bytes (0 <= x <= 1;
    0 = everything streams from flash, 1 = everything resident), or None for the device's
    app budget (dram_app_budget_gb). Call `place(model_cost)` once with the whole model so
    every width and every part of it shares one residency; otherwise each call plans alone.
    """

    def __init__(self, profile: DeviceProfile | str | Path, dram_budget: float | None = None):
        self.profile = profile if isinstance(profile, DeviceProfile) else load_profile(profile)
        if dram_budget is not None and dram_budget < 0:
            raise DeviceProfileError(f"the DRAM budget must be >= 0, got {dram_budget}")
        self.dram_budget = dram_budget
        self.residency: Residency | None = None

    def budget_bytes(self, model: GraphCost) -> float:
        b = self.dram_budget
        if b is None:
            return self.profile.dram_app_budget_gb * GB
        if b <= 1.0:
            return b * model.weight_bytes
        return float(b)

    def place(self, model: GraphCost) -> Residency:
        self.residency = plan_residency(model, self.budget_bytes(model))
        return self.residency

    def call_latency(self, cost: GraphCost) -> CallLatency:
        p = self.profile
        residency = self.residency or plan_residency(cost, self.budget_bytes(cost))
        resident_b, flash_b = residency.split(cost)
        dram_b = resident_b + flash_b + cost.kv_bytes + cost.io_bytes
        flash_s = flash_b / p.flash_bytes_per_s if flash_b else 0.0
        dram_s = dram_b / p.dram_bytes_per_s if dram_b else 0.0
        compute_s = cost.flops / p.ops_per_s(cost.precision) if cost.flops else 0.0
        overhead_s = cost.calls * p.call_overhead_ms * 1e-3
        f = p.flash_overlap
        on_chip = max(dram_s, compute_s)
        total = overhead_s + (1.0 - f) * flash_s + max(on_chip, f * flash_s)
        return CallLatency(total, flash_s, dram_s, compute_s, overhead_s, flash_b, dram_b)
