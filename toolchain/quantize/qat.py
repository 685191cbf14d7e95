"""QAT: a short fake-quant fine-tune in torch whose learned clipping is carried into the QDQ graph.

Every nn.Linear of the decoder (and lm_head) is wrapped while training:
- weights: symmetric per-output-channel fake quant at the recipe's bit width, clip c learned
  (c = max|w| * alpha, alpha initialised by a per-channel MSE grid search, then trained); the
  round is a straight-through estimator, the clip receives gradients through min/max;
- inputs (8-bit activations only): asymmetric per-tensor fake quant with learned [lo, hi].
The float model is its own teacher (wrappers switched off): loss is KL(teacher || student) on
temperature-scaled logits over the calibration text.

Carried into the graph exactly: weights are clipped to c in the float graph before onnxruntime
quantizes them, so its symmetric min/max scale max|w|/qmax *is* c/qmax; [lo, hi] become rmin/rmax
overrides of the MatMul input. Graph tensors QAT does not model (residual adds, attention) keep
their calibrated ranges.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from toolchain.quantize.qdq import QatResult
from toolchain.quantize.schema import QuantizeSpec

BITS = {"int4": 4, "int8": 8, "int16": 16}


def grid(bits: int) -> tuple[float, int, int]:
    """onnxruntime's symmetric signed grid: scale = max|w| / ((2**b - 1) / 2), q in [-2**(b-1), 2**(b-1) - 1]."""
    return (2**bits - 1) / 2, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def round_ste(x: torch.Tensor) -> torch.Tensor:
    return (x.round() - x).detach() + x


def mse_alpha(w: torch.Tensor, bits: int, steps: int = 12) -> torch.Tensor:
    """Per-row clip ratio in [0.5, 1] minimising the weight's quantization MSE (QAT's start point)."""
    half, lo, hi = grid(bits)
    amax = w.abs().amax(1, keepdim=True).clamp_min(1e-8)
    best, best_err = torch.ones_like(amax), torch.full_like(amax, float("inf"))
    for a in torch.linspace(0.5, 1.0, steps):
        c = amax * a
        s = c / half
        err = ((torch.clamp(w, -c, c) / s).round().clamp(lo, hi) * s - w).pow(2).sum(1, keepdim=True)
        better = err < best_err
        best = torch.where(better, a, best)
        best_err = torch.where(better, err, best_err)
    return best


class QLinear(nn.Module):
    def __init__(self, linear: nn.Linear, wbits: str, abits: str | None, train_weights: bool):
        super().__init__()
        self.linear = linear
        self.half, self.qlo, self.qhi = grid(BITS[wbits])
        linear.weight.requires_grad_(train_weights)
        with torch.no_grad():
            w = linear.weight.detach()
            self.register_buffer("amax", w.abs().amax(1, keepdim=True).clamp_min(1e-8))
            self.alpha = nn.Parameter(mse_alpha(w, BITS[wbits]))
        self.abits = abits
        self.lo = nn.Parameter(torch.zeros(())) if abits else None
        self.hi = nn.Parameter(torch.zeros(())) if abits else None
        self.observing = True  # first batch: min/max initialise [lo, hi]
        self.enabled = True

    def clip(self) -> torch.Tensor:
        return self.amax * self.alpha.clamp(0.2, 1.0)

    def qweight(self) -> torch.Tensor:
        c = self.clip()
        w = torch.maximum(torch.minimum(self.linear.weight, c), -c)
        s = c / self.half
        return torch.clamp(round_ste(w / s), self.qlo, self.qhi) * s

    def qinput(self, x: torch.Tensor) -> torch.Tensor:
        assert self.lo is not None and self.hi is not None
        if self.observing:
            with torch.no_grad():
                self.lo.fill_(min(float(x.min()), 0.0))
                self.hi.fill_(max(float(x.max()), 1e-3))
            return x
        qmax = 255 if self.abits == "int8" else 65535
        lo, hi = self.lo.clamp(max=0.0), self.hi.clamp(min=1e-3)
        s = (hi - lo) / qmax
        zp = round_ste(-lo / s).detach()
        xc = torch.maximum(torch.minimum(x, hi), lo)
        return (torch.clamp(round_ste(xc / s) + zp, 0, qmax) - zp) * s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return self.linear(x)
        if self.abits:
            x = self.qinput(x)
        return nn.functional.linear(x, self.qweight(), self.linear.bias)


def _graph_key(module_name: str) -> str:
    """HF module path -> the ONNX node-name prefix the exporter gives its MatMul."""
    return module_name.removeprefix("model.")


def wrap(model: nn.Module, spec: QuantizeSpec, input_types: dict[str, str] | None = None) -> dict[str, QLinear]:
    """input_types: the graph's activation type of each linear's input (e.g. 16-bit after norms)."""
    from toolchain.quantize.qdq import node_overrides

    input_types = input_types or {}
    wrapped: dict[str, QLinear] = {}
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, lin in targets:
        key = _graph_key(name)
        o = node_overrides(spec, key + "/MatMul")
        wbits = o.get("weights", spec.weights)
        if wbits == "float":
            continue
        abits = input_types.get(key, o.get("activations", spec.activations))
        q = QLinear(lin, wbits, abits if abits == "int8" else None, spec.qat_spec.train_weights)
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], q)
        wrapped[key] = q
    return wrapped


def unwrap(model: nn.Module, wrapped: dict[str, QLinear]) -> None:
    for name, mod in list(model.named_modules()):
        if isinstance(mod, QLinear):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], mod.linear)


def _set(wrapped: dict[str, QLinear], **flags: bool) -> None:
    for q in wrapped.values():
        for k, v in flags.items():
            setattr(q, k, v)


def _kl(teacher: torch.Tensor, student: torch.Tensor, t: float) -> torch.Tensor:
    tp = torch.log_softmax(teacher / t, -1)
    sp = torch.log_softmax(student / t, -1)
    return (tp.exp() * (tp - sp)).sum(-1).mean() * t * t


def run_qat(model: nn.Module, tokens: list[int], spec: QuantizeSpec,
            log: Callable[[str], None] = lambda m: None,
            input_types: dict[str, str] | None = None) -> tuple[QatResult, dict[str, Any]]:
    cfg = spec.qat_spec
    torch.manual_seed(spec.calibration.seed)
    rng = np.random.default_rng(spec.calibration.seed)
    was_training = model.training
    frozen = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = wrap(model, spec, input_types)
    L = cfg.seq_len

    def batch() -> torch.Tensor:
        s = int(rng.integers(0, max(1, len(tokens) - L)))
        return torch.tensor([tokens[s : s + L]])

    t0 = time.perf_counter()
    history: list[float] = []
    try:
        model.eval()  # no dropout; gradients still flow to the quantizer parameters
        with torch.no_grad():
            _set(wrapped, enabled=True, observing=True)
            model(batch())
            _set(wrapped, observing=False)
        params = [p for q in wrapped.values() for p in q.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=cfg.lr)
        held = batch()
        initial = _eval_kl(model, wrapped, held, cfg.temperature)
        step = 0
        for step in range(1, cfg.steps + 1):
            x = batch()
            with torch.no_grad():
                _set(wrapped, enabled=False)
                teacher = model(x).logits
                _set(wrapped, enabled=True)
            loss = _kl(teacher, model(x).logits, cfg.temperature)
            opt.zero_grad()
            loss.backward()
            opt.step()
            history.append(float(loss.detach()))
            if step % 10 == 0:
                log(f"qat step {step}: kl {np.mean(history[-10:]):.4f}")
            if time.perf_counter() - t0 > cfg.max_seconds:
                break
        final = _eval_kl(model, wrapped, held, cfg.temperature)
        result = QatResult()
        with torch.no_grad():
            for key, q in wrapped.items():
                result.weight_clip[key] = q.clip().squeeze(1).numpy().astype(np.float32)
                if q.lo is not None:
                    result.act_range[key] = (float(q.lo.clamp(max=0.0)), float(q.hi.clamp(min=1e-3)))
                if cfg.train_weights:
                    result.weights[key] = q.linear.weight.detach().numpy().copy()
    finally:
        unwrap(model, wrapped)
        for n, p in model.named_parameters():
            p.requires_grad_(frozen.get(n, False))
        model.train(was_training)
    record = {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "seq_len": L,
              "held_out_kl_before": round(initial, 5), "held_out_kl_after": round(final, 5),
              "train_kl_first10": round(float(np.mean(history[:10])), 5) if history else None,
              "train_kl_last10": round(float(np.mean(history[-10:])), 5) if history else None,
              "wrapped_linears": len(wrapped)}
    return result, record


@torch.no_grad()
def _eval_kl(model: nn.Module, wrapped: dict[str, QLinear], x: torch.Tensor, t: float) -> float:
    _set(wrapped, enabled=False)
    teacher = model(x).logits
    _set(wrapped, enabled=True)
    return float(_kl(teacher, model(x).logits, t))
