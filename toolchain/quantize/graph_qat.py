"""QAT on the QDQ graph itself: learned activation encodings, trained in torch, written back exactly.

A fake-quant copy of the Hugging Face modules cannot know which of the QDQ graph's ~2,500
activation tensors onnxruntime quantizes, at which width, with which shared encodings (a
Reshape's output reuses its input's scale), so what it learns does not carry over (measured:
its KL fell while the QDQ graph's perplexity rose). Here the QDQ graph *is* the student:

- `QdqTorch` executes the graph's nodes in torch. Weight DequantizeLinears become constants
  (the int4/int8 codes times their scales: exactly what runs). Every activation Q/DQ pair is a
  straight-through fake quant with the graph's own encoding; the 8-bit encodings that are free
  to move are learnable (lo, hi) ranges, one per shared scale/zero-point initializer, so tensors
  that must share an encoding keep sharing it;
- the teacher is the same graph with activation Q/DQ switched off (float activations, the
  deployed weights): the loss is KL(teacher || student) on the logits of realistic step-graph
  calls (calibration text, real KV cache contents, as in calibration);
- learned encodings are written into the scale/zero-point initializers of every graph that
  names them (decode and prefill share tensor names), so what was trained is what runs.

Fixed, never learned: 16-bit encodings (simulated, not trained), the tied KV cache encodings,
Concat outputs (they carry the cache's encoding) and graph inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper
from torch import nn

from toolchain.errors import QuantizeError

QRANGE = {TensorProto.UINT8: (0, 255), TensorProto.INT8: (-128, 127), TensorProto.UINT16: (0, 65535),
          TensorProto.INT16: (-32768, 32767)}
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
ELEMENTWISE = {"Add": torch.add, "Mul": torch.mul, "Sub": torch.sub, "Div": torch.div}


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round() forward, identity backward (straight-through estimator)."""
    return (x.round() - x).detach() + x


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def dequantize_constant(q: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, axis: int,
                        block: int) -> np.ndarray:
    """DequantizeLinear of an initializer: per tensor, per axis, or blocked along `axis`."""
    q = q.astype(np.float32)
    zp = np.zeros_like(scale) if zp is None else zp.astype(np.float32)
    if scale.ndim == 0 or scale.size == 1:
        return (q - zp.reshape(())) * scale.reshape(())
    axis = axis % q.ndim
    if block:  # scale has q's shape with ceil(dim / block) along axis
        s = np.repeat(scale, block, axis=axis).take(range(q.shape[axis]), axis=axis)
        z = np.repeat(zp, block, axis=axis).take(range(q.shape[axis]), axis=axis)
        return (q - z) * s
    shape = [1] * q.ndim
    shape[axis] = -1
    return (q - zp.reshape(shape)) * scale.reshape(shape)


class Encoding(nn.Module):
    """One activation encoding (a shared scale/zero-point initializer pair) as a fake quant.

    Learnable ones are parametrized by log-multipliers of the calibrated range ends, so a range
    end at 0 stays at 0 (zero point stays exact) and every range moves by relative steps,
    whatever its magnitude (ranges here span 1e-3 to 1e4)."""

    def __init__(self, scale: float, zero_point: int, qmin: int, qmax: int, learn: bool):
        super().__init__()
        self.qmin, self.qmax = qmin, qmax
        self.lo0 = (qmin - zero_point) * scale
        self.hi0 = (qmax - zero_point) * scale
        self.scale0, self.zp0 = scale, zero_point
        self.log_lo = nn.Parameter(torch.zeros(()), requires_grad=learn)
        self.log_hi = nn.Parameter(torch.zeros(()), requires_grad=learn)
        self.learn = learn
        self.active = True  # False: this encoding's Q/DQ pass float through (sensitivity probes)

    def scale_zp(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.learn:
            return torch.tensor(self.scale0), torch.tensor(float(self.zp0))
        lo = self.lo0 * self.log_lo.exp()
        hi = self.hi0 * self.log_hi.exp()
        scale = ((hi - lo) / (self.qmax - self.qmin)).clamp_min(1e-12)
        zp = (self.qmin - lo / scale).round().clamp(self.qmin, self.qmax).detach()
        return scale, zp

    def freeze(self) -> None:
        self.learn = False
        self.log_lo.requires_grad_(False)
        self.log_hi.requires_grad_(False)

    def exported(self) -> tuple[float, int]:
        with torch.no_grad():
            s, z = self.scale_zp()
        return float(s), int(z)


class QdqTorch(nn.Module):
    """Runs a QDQ ONNX graph in torch, activation Q/DQ as (learnable) straight-through fake quant."""

    SUPPORTED = {"QuantizeLinear", "DequantizeLinear", "MatMul", "Add", "Mul", "Sub", "Div", "Neg", "Sigmoid",
                 "Softmax", "Reshape", "Transpose", "Slice", "Concat", "Gather", "Unsqueeze", "Squeeze",
                 "SimplifiedLayerNormalization", "ReduceSum", "Identity"}

    def __init__(self, model: onnx.ModelProto, fixed_tensors: Iterable[str] = ()):
        super().__init__()
        g = model.graph
        unknown = sorted({n.op_type for n in g.node} - self.SUPPORTED)
        if unknown:
            raise QuantizeError(f"method: qat cannot run ops {unknown} of this graph in torch; use method: ptq "
                                "for it (or compile without the pass that introduced them)")
        arrays = {i.name: numpy_helper.to_array(i) for i in g.initializer}
        producer = {o: n for n in g.node for o in n.output}
        fixed = set(fixed_tensors) | {i.name for i in g.input}
        self.consts: dict[str, torch.Tensor] = {}
        self.encodings = nn.ModuleDict()
        self.enc_of: dict[str, str] = {}  # Q/DQ node name -> encoding key
        self.enc_inits: dict[str, tuple[str, str | None]] = {}  # encoding key -> (scale init, zp init)
        # encoding key -> the compute nodes whose outputs it quantizes (through Q/DQ convert pairs)
        self.producers: dict[str, list[str]] = {}
        self.nodes: list[tuple[str, str, list[str], list[str], dict[str, Any]]] = []
        frozen_keys: set[str] = set()
        for n in g.node:
            a = _attrs(n)
            if n.op_type == "DequantizeLinear" and n.input[0] in arrays:
                zp = arrays.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
                w = dequantize_constant(arrays[n.input[0]], arrays[n.input[1]], zp, a.get("axis", 1),
                                        a.get("block_size", 0))
                self.consts[n.output[0]] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
                continue
            if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
                key = self._encoding(n, arrays)
                self.enc_of[n.name] = key
                src = n.input[0] if n.op_type == "QuantizeLinear" else None
                if src is not None:
                    self.producers.setdefault(key, []).append(_origin(src, producer))
                # the KV tie holds through a mixed-precision Convert (a 16-bit v_proj -> the 8-bit cache)
                if src is not None and (src in fixed or _through_converts(src, producer) in fixed
                                        or (producer.get(src) is not None and producer[src].op_type == "Concat")):
                    frozen_keys.add(key)
            self.nodes.append((n.op_type, n.name, list(n.input), list(n.output), a))
        for key in frozen_keys:
            self.encodings[key].freeze()
        for name, arr in arrays.items():  # float constants and int64 shapes/axes/indices
            if name not in self.consts and (arr.dtype.kind == "f" or arr.dtype == np.int64):
                self.consts[name] = torch.from_numpy(np.array(arr))

    def _encoding(self, n: onnx.NodeProto, arrays: dict[str, np.ndarray]) -> str:
        zp_name = n.input[2] if len(n.input) > 2 and n.input[2] else None
        key = f"{n.input[1]}|{zp_name}".replace(".", "_")
        if key not in self.encodings:
            if n.input[1] not in arrays or (zp_name and zp_name not in arrays):
                raise QuantizeError(f"method: qat: {n.name}'s scale/zero point are not initializers; use method: ptq")
            scale = arrays[n.input[1]]
            if scale.size != 1:
                raise QuantizeError(f"method: qat learns per-tensor activation encodings, but {n.name}'s has shape "
                                    f"{scale.shape}; use method: ptq")
            zp = arrays[zp_name] if zp_name else np.zeros((), np.uint8)
            qmin, qmax = QRANGE[onnx.helper.np_dtype_to_tensor_dtype(zp.dtype)]
            learn = zp.dtype == np.uint8
            self.encodings[key] = Encoding(float(scale.reshape(())), int(zp.reshape(())), qmin, qmax, learn)
            self.enc_inits[key] = (n.input[1], zp_name)
        return key

    def learnable(self) -> list[nn.Parameter]:
        return [p for e in self.encodings.values() if e.learn for p in (e.log_lo, e.log_hi)]

    def forward(self, feeds: dict[str, torch.Tensor], quant: bool = True,
                want: tuple[str, ...] = ("logits",)) -> dict[str, torch.Tensor]:
        env: dict[str, torch.Tensor] = dict(self.consts)
        env.update(feeds)
        cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # scale/zp once per encoding per call

        for op, name, ins, outs, a in self.nodes:
            # a Q/DQ's scale and zero point live in its Encoding, not in env
            x = [env[i] if i else None for i in (ins[:1] if op in QDQ_OPS else ins)]
            if op in QDQ_OPS:
                key = self.enc_of[name]
                e = self.encodings[key]
                if not (quant and e.active):
                    y = x[0]
                else:
                    if key not in cache:
                        cache[key] = e.scale_zp()
                    s, z = cache[key]
                    y = torch.clamp(round_ste(x[0] / s) + z, e.qmin, e.qmax) if op == "QuantizeLinear" else (x[0] - z) * s
            elif op == "MatMul":
                y = torch.matmul(x[0], x[1])
            elif op in ELEMENTWISE:
                y = ELEMENTWISE[op](x[0], x[1])
            elif op == "Neg":
                y = -x[0]
            elif op == "Sigmoid":
                y = torch.sigmoid(x[0])
            elif op == "Softmax":
                y = torch.softmax(x[0], dim=a.get("axis", -1))
            elif op == "ReduceSum":  # exact_mask.py's renormalisation
                y = x[0].sum(dim=tuple(int(v) for v in x[1].tolist()), keepdim=bool(a.get("keepdims", 1)))
            elif op == "Reshape":
                shape = [int(v) for v in x[1].tolist()]
                shape = [x[0].shape[i] if v == 0 and not a.get("allowzero", 0) else v for i, v in enumerate(shape)]
                y = x[0].reshape(shape)
            elif op == "Transpose":
                y = x[0].permute(*a["perm"])
            elif op == "Slice":
                y = _slice(x[0], *[v.tolist() if v is not None else None for v in (x[1:] + [None] * 3)[:4]])
            elif op == "Concat":
                y = torch.cat(x, dim=a["axis"])
            elif op == "Gather":
                y = _gather(x[0], x[1], a.get("axis", 0))
            elif op == "Unsqueeze":
                y = x[0]
                for ax in sorted(int(v) % (x[0].dim() + len(x[1])) for v in x[1].tolist()):
                    y = y.unsqueeze(ax)
            elif op == "Squeeze":
                y = x[0].squeeze(tuple(int(v) for v in x[1].tolist())) if len(x) > 1 else x[0].squeeze()
            elif op == "SimplifiedLayerNormalization":
                axis = a.get("axis", -1)
                var = x[0].pow(2).mean(dim=axis, keepdim=True)
                y = x[0] * torch.rsqrt(var + a.get("epsilon", 1e-5)) * x[1]
            else:  # Identity
                y = x[0]
            env[outs[0]] = y
        return {k: env[k] for k in want}

    def write(self, model: onnx.ModelProto) -> int:
        """Writes the learned encodings into `model`'s initializers of the same names; returns how many."""
        inits = {i.name: i for i in model.graph.initializer}
        written = 0
        for key, e in self.encodings.items():
            if not e.learn or (float(e.log_lo.detach()) == 0.0 and float(e.log_hi.detach()) == 0.0):
                continue  # untouched: the PTQ encoding stays bit-exact
            s, z = e.exported()
            scale_name, zp_name = self.enc_inits[key]
            if scale_name not in inits:
                continue
            inits[scale_name].CopyFrom(numpy_helper.from_array(np.array(s, np.float32), scale_name))
            if zp_name and zp_name in inits:
                inits[zp_name].CopyFrom(numpy_helper.from_array(np.array(z, np.uint8), zp_name))
            written += 1
        return written


def _origin(tensor: str, producer: dict[str, onnx.NodeProto]) -> str:
    """The compute node behind a tensor, looking through Q/DQ pairs (mixed-precision converts)."""
    node = producer.get(_through_converts(tensor, producer))
    return node.name if node is not None else tensor


def _through_converts(tensor: str, producer: dict[str, onnx.NodeProto]) -> str:
    """The tensor a compute node wrote, looking back through Q/DQ pairs (mixed-precision converts)."""
    node = producer.get(tensor)
    while node is not None and node.op_type in QDQ_OPS:
        tensor = node.input[0]
        node = producer.get(tensor)
    return tensor


def _slice(x: torch.Tensor, starts: list[int], ends: list[int], axes: list[int] | None,
           steps: list[int] | None) -> torch.Tensor:
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    index = [slice(None)] * x.dim()
    for s, e, ax, st in zip(starts, ends, axes, steps, strict=True):
        if st != 1:
            raise QuantizeError("method: qat: a Slice with step != 1 is not supported; use method: ptq")
        dim = x.shape[ax]
        index[ax] = slice(max(0, min(dim, s if s >= 0 else dim + s)), max(0, min(dim, e if e >= 0 else dim + e)))
    return x[tuple(index)]


def _gather(x: torch.Tensor, idx: torch.Tensor, axis: int) -> torch.Tensor:
    out = torch.index_select(x, axis, idx.reshape(-1).long())
    shape = list(x.shape[:axis]) + list(idx.shape) + list(x.shape[axis + 1:])
    return out.reshape(shape)


def kl_divergence(teacher: torch.Tensor, student: torch.Tensor, t: float = 1.0) -> torch.Tensor:
    """Mean over rows of KL(teacher || student) of temperature-scaled logits, times t^2."""
    tp = torch.log_softmax(teacher.reshape(-1, teacher.shape[-1]) / t, -1)
    sp = torch.log_softmax(student.reshape(-1, student.shape[-1]) / t, -1)
    return (tp.exp() * (tp - sp)).sum(-1).mean() * t * t


@torch.no_grad()
def mean_kl(net: QdqTorch, teachers: list[torch.Tensor], feeds: list[dict[str, torch.Tensor]],
            t: float = 1.0) -> float:
    """Mean logit KL of the (fake-quant) graph against precomputed teacher logits over several calls."""
    return float(np.mean([float(kl_divergence(tl, net(f)["logits"], t)) for tl, f in zip(teachers, feeds,
                                                                                         strict=True)]))


def torch_feeds(feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()}


def train_encodings(graph: Path, feeds: list[dict[str, np.ndarray]], held: list[dict[str, np.ndarray]],
                    fixed_tensors: Iterable[str], steps: int, lr: float, temperature: float, max_seconds: float,
                    log: Callable[[str], None] = lambda m: None, eval_every: int = 5) -> tuple[QdqTorch, dict[str, Any]]:
    """Learns the QDQ graph's free 8-bit activation encodings by logit distillation on `feeds`.

    Held-out KL is measured every `eval_every` steps and the best encodings seen are the ones kept
    (the PTQ encodings if training never beat them), so QAT cannot leave the graph worse than PTQ
    on held-out calls."""
    net = QdqTorch(onnx.load(graph), fixed_tensors)
    params = net.learnable()
    opt = torch.optim.Adam(params, lr=lr)
    teachers: dict[int, torch.Tensor] = {}
    tfeeds = [torch_feeds(f) for f in feeds]
    theld = [torch_feeds(f) for f in held]
    with torch.no_grad():
        held_teachers = [net(f, quant=False)["logits"] for f in theld]

    def held_kl() -> float:
        return mean_kl(net, held_teachers, theld, temperature)

    def snapshot() -> list[torch.Tensor]:
        return [p.detach().clone() for p in params]

    t0 = time.perf_counter()
    before = held_kl()
    best, best_step, best_state = before, 0, snapshot()
    log(f"graph QAT: {len(params) // 2} learnable 8-bit encodings of {len(net.encodings)}; held-out KL {before:.4f}")
    history: list[float] = []
    curve: list[tuple[int, float]] = [(0, round(before, 5))]
    step = 0
    for step in range(1, steps + 1):
        i = (step - 1) % len(tfeeds)
        if i not in teachers:
            with torch.no_grad():
                teachers[i] = net(tfeeds[i], quant=False)["logits"]
        loss = kl_divergence(teachers[i], net(tfeeds[i])["logits"], temperature)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(float(loss.detach()))
        out_of_time = time.perf_counter() - t0 > max_seconds
        if step % eval_every == 0 or step == steps or out_of_time:
            kl = held_kl()
            curve.append((step, round(kl, 5)))
            if kl < best:
                best, best_step, best_state = kl, step, snapshot()
            log(f"graph QAT step {step}: train KL {np.mean(history[-eval_every:]):.4f}, held-out {kl:.4f} "
                f"(best {best:.4f} at step {best_step}; {time.perf_counter() - t0:.0f} s)")
        if out_of_time:
            break
    with torch.no_grad():
        for p, v in zip(params, best_state, strict=True):
            p.copy_(v)
    kept = "learned" if best_step else "ptq (training never beat it on held-out calls)"
    log(f"graph QAT: held-out KL {before:.4f} -> {best:.4f}; kept {kept}")
    moved = [abs(float(e.log_hi.detach())) + abs(float(e.log_lo.detach())) for e in net.encodings.values() if e.learn]
    record = {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "feeds": len(feeds),
              "held_out_feeds": len(held), "learnable_encodings": len(params) // 2, "encodings": len(net.encodings),
              "held_out_kl_before": round(before, 5), "held_out_kl_after": round(best, 5), "best_step": best_step,
              "kept": kept, "held_out_curve": curve,
              "train_kl_first5": round(float(np.mean(history[:5])), 5) if history else None,
              "train_kl_last5": round(float(np.mean(history[-5:])), 5) if history else None,
              "mean_abs_log_range_change": round(float(np.mean(moved)), 4) if moved else 0.0,
              "method": "QDQ graph in torch, STE fake quant, learned (lo, hi) per shared 8-bit encoding, "
                        "KL to the same graph with float activations; best held-out checkpoint kept"}
    return net, record


def write_encodings_into(net: QdqTorch, graph: Path) -> int:
    """Rewrites `graph`'s encoding initializers in place (its external weight data is untouched)."""
    model = onnx.load(graph, load_external_data=False)
    n = net.write(model)
    onnx.save_model(model, graph)
    return n
