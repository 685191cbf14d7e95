"""certified_lm_head: a Q8_0 lm_head as fast 8-bit MatMulNBits whose argmax is proven exact per call.

The float lm_head is the largest single weight of a small model's CPU step (SmolLM2: 49152 x 576,
113 MB of float32 read every token, 7-9 ms of a 35 ms int4 step, and 108 MB of resident memory).
onnxruntime's 8-bit MatMulNBits is fast only at accuracy_level 4, which quantizes the activation
to int8 per block of 32 and so moves every logit a little. This pass keeps greedy decoding exact
anyway, by bounding that move and rescoring the candidates it could affect:

    approx  = MatMulNBits(x, Q8_0 codes of E, level 4)                 [M, V], fast
    TopK(approx, S + 1): C its K best (the candidates), R the next S - K (screened), a_S the last
    exact_C = x . E[C]  (float32 rows of the float table, the float graph's own weights)
    bound_j = sum_b (max|x_b| / 254) * |d_bj| * sum_i |k_bij|          >= |approx_j - x.e_j|
    B       = sum_b (max|x_b| / 254) * max_j |d_bj| * sum_i |k_bij|    >= bound_j for every j
    rival   = max(max_{j in R} (approx_j + bound_j), a_S + B)
    certified (per row) iff  rival < max exact_C
    logits  = approx with exact_C scattered in; each row not certified: its float x_r @ E^T

Why the bound holds: level 4 rounds x_b to s_b * round(x_b / s_b) with s_b = max|x_b| / 127, so
each activation moves by at most s_b / 2, and a weight row's logit by at most that times the block's
sum of |w| (the weights are the GGUF's own Q8_0 codes, exactly the float table's values). Tokens
outside C and R have approx_j <= a_S (TopK is sorted) and bound_j <= B, so no token outside C can
beat the best rescored one, and argmax(logits) is the float graph's argmax. Both bounds are scaled
by 1.05 and padded by 1e-3 to cover the kernel's float32 accumulation. Only the S - K screened tokens
get a bound of their own: bounding every token was a [18 x 49152] product and two passes over the
vocabulary per call (~0.3 ms of SmolLM2's 13 ms step); B alone for all of them failed 8% of real
positions (hidden states of 16 HumanEval and chat prompts), B past the best 256 none of 407. A row whose
certificate fails (a near tie spread over more than K tokens) gets the exact float product x_r @ E^T
over the whole vocabulary, computed for the failing rows only (an If: a call whose rows all hold
skips it; a 128-row prompt window at int8 fails a row or two, and computing all 128 rows' float logits
then took ~18% of the window's time). The float table E is the embedding Gather's own initializer (the tied head),
read only at the K gathered rows and in the fallback, so it is not resident.

The contract changes: `logits` is argmax-exact (each row's argmax and its value equal the float
graph's) while the other entries are within the bound; the pass runner and the compile's check
against transformers verify exactly that for a recipe with this pass (argmax_exact_outputs).
With `certificate: op` everything after the first pass is one mobc.cpu CertifyArgmax call (the same
ranking, rescoring, bounds and per-row float fallback, toolchain/kernels/certificate.c).
A CPU pass (com.microsoft MatMulNBits; check_htp refuses it). Requires: the lm_head as
MatMul(x, Transpose(E)) or MatMul(x, W) with W on a Q8_0 grid, producing the graph output `logits`.
Ensures: `logits` comes out of the certificate (its If node or CertifyArgmax), and no float MatMul
computes it.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import onnx_ir as ir

from passes.base import GraphPass, PassConfig
from passes.matmul_nbits import DOMAIN, pack_codes
from passes.registry import register
from toolchain import kernels
from toolchain.ir.block_grid import fit_block_grid
from toolchain.ir.graph import add_initializer, linear_weight, new_node, remove_unused, shape_of, take_over

OUTPUT = "logits"
BOUND_SCALE = 1.05
BOUND_PAD = 1e-3
# how far the first pass rounds an activation element, as a fraction of its block's max|x_b|: int8
# (MatMulNBits level 4, s_b = max|x_b| / 127) and int16 (MatMulQ8I16, s_b = max|x_b| / 32767), half a step
STEP_FRACTION = {"int8": 1.0 / 254.0, "int16": 1.0 / 65534.0}


def _lm_head(graph: ir.Graph) -> ir.Node | None:
    """The MatMul producing the graph output `logits` (directly or through one Reshape)."""
    out = next((v for v in graph.outputs if v.name == OUTPUT), None)
    node = out.producer() if out is not None else None
    if node is not None and node.op_type == "Reshape":
        node = node.inputs[0].producer()
    return node if node is not None and linear_weight(node) is not None else None


def _q8_grid(e: np.ndarray, block: int):
    """The symmetric int8 block grid of a [V, C] head weight along C (GGUF Q8_0), or None."""
    if e.shape[1] % block:
        return None
    fit = fit_block_grid(np.ascontiguousarray(e.T), block, "int8")
    return fit if fit is not None and fit.offset is None else None


def _table(graph: ir.Graph, node: ir.Node, e: np.ndarray, name: str) -> ir.Value:
    """The float [V, C] table to gather candidate rows from: the tied head's own initializer
    (the embedding's), else an initializer holding the same bytes, else a new one."""
    w = node.inputs[1]
    if w.producer() is not None:  # Transpose(E): E is the embedding table itself
        return w.producer().inputs[0]
    for value in graph.initializers.values():
        arr = value.const_value.numpy() if value.const_value is not None else None
        if arr is not None and arr.shape == e.shape and arr.dtype == e.dtype and np.array_equal(arr, e):
            return value
    return add_initializer(graph, f"{name}.rows", e)


def _certified_branch(name: str, approx: ir.Value, idx: ir.Value, exact: ir.Value, m: int, v: int) -> ir.Graph:
    """A subgraph scattering the rescored candidates into the approximate logits (the If's
    certified branch). A real op, not an Identity of an outer value: identity elimination
    (onnx_ir's, run by other passes) would leave the subgraph an output it does not produce."""
    node = ir.Node("", "ScatterElements", [approx, idx, exact], attributes=[ir.AttrInt64("axis", 1)],
                   name=f"{name}/scatter")
    out = node.outputs[0]
    out.name, out.shape, out.type = f"{name}_logits", ir.Shape([m, v]), ir.TensorType(ir.DataType.FLOAT)
    return ir.Graph([], [out], nodes=[node], name=name)


def _fallback(name: str, approx: ir.Value, idx: ir.Value, exact: ir.Value, row_ok: ir.Value, e: ir.Value,
              x2: ir.Value, m: int, v: int) -> ir.Graph:
    """The If's else branch: the certified rows as in the then branch, and each row whose
    certificate failed replaced by its float logits x_r @ E^T, computed for those rows only (a
    128-row prompt window fails on a row or two; the whole window's float product cost it ~18% of
    its time). E stays the MatMul's first input, so onnxruntime neither folds a transposed copy nor
    prepacks it at session start."""
    nodes: list[ir.Node] = []

    def op(kind: str, inputs: list, label: str, attrs: list | None = None) -> ir.Value:
        node = ir.Node("", kind, inputs, attributes=attrs or [], name=f"{name}/{label}")
        node.outputs[0].name = f"{name}_{label}"
        nodes.append(node)
        return node.outputs[0]

    def const(label: str, array) -> ir.Value:
        return op("Constant", [], label, [ir.AttrTensor("value", ir.tensor(np.asarray(array), name=f"{name}_{label}"))])

    base = op("ScatterElements", [approx, idx, exact], "scatter", [ir.AttrInt64("axis", 1)])
    failed = op("Not", [op("Reshape", [row_ok, const("shape_m", [m])], "row_ok")], "failed")
    which = op("Transpose", [op("NonZero", [failed], "nonzero")], "which", [ir.AttrInt64s("perm", [1, 0])])  # [F, 1]
    rows = op("Gather", [x2, op("Reshape", [which, const("shape_flat", [-1])], "which_flat")], "rows")  # [F, C]
    xt = op("Transpose", [rows], "xt", [ir.AttrInt64s("perm", [1, 0])])
    exact_rows = op("Transpose", [op("MatMul", [e, xt], "matmul")], "float_rows", [ir.AttrInt64s("perm", [1, 0])])
    out = op("ScatterND", [base, which, exact_rows], "logits")
    out.shape, out.type = ir.Shape([m, v]), ir.TensorType(ir.DataType.FLOAT)
    return ir.Graph([], [out], nodes=nodes, name=name)


def _rewrite(graph: ir.Graph, node: ir.Node, cfg: PassConfig) -> bool:
    e, wname = linear_weight(node)  # [V, C]
    v, c = e.shape
    block = cfg.block_size
    fit = _q8_grid(e, block)
    if fit is None:
        return False
    x = node.inputs[0]
    lead = shape_of(x)[:-1]
    m = math.prod(lead)
    k = min(cfg.candidates, v - 1)
    base = f"{wname}.q8"
    f32, i64 = ir.DataType.FLOAT, ir.DataType.INT64

    def const(label: str, array) -> ir.Value:
        return add_initializer(graph, f"certified_lm_head.{label}", np.asarray(array))

    def op(kind: str, inputs: list, label: str, shape: list[int], dtype=f32, attrs=None, outs=1) -> ir.Node:
        return new_node(graph, node, kind, inputs, f"lm_head_certified/{label}", attrs, shape, dtype, outs)

    scale16 = np.ascontiguousarray(fit.scale.T).astype(np.float16)  # [V, C/block]: GGUF keeps Q8_0's d as float16
    int16 = (cfg.activations == "int16" and m <= cfg.kernel_rows and block == kernels.BLOCK
             and c <= kernels.MAX_K and np.array_equal(scale16.astype(np.float32), fit.scale.T))
    if int16:
        kernels.require("certified_lm_head: {activations: int16}")
    q = add_initializer(graph, f"{base}.codes", pack_codes(fit.codes, 8, block))
    d = add_initializer(graph, f"{base}.scales", scale16 if int16 else np.ascontiguousarray(fit.scale.T).reshape(-1))
    # per block and token |d| * sum|k|, pre-scaled (bound_j = max|x_b| @ row j), and its largest over the vocabulary
    weight_l1 = np.abs(fit.scale) * np.abs(fit.codes.astype(np.float32)).reshape(c // block, block, v).sum(1)
    step = STEP_FRACTION["int16" if int16 else "int8"]
    per_token = (weight_l1.T * (BOUND_SCALE * step)).astype(np.float32)  # [V, C/block]: gathered by token
    token_w = add_initializer(graph, f"{base}.bound", np.ascontiguousarray(per_token))
    worst_w = add_initializer(graph, f"{base}.bound_max", per_token.max(axis=0).reshape(-1, 1))  # [C/block, 1]
    table = _table(graph, node, e, wname)
    s = min(max(cfg.screened, k + 1), v - 1)
    nb = c // block

    x2 = op("Reshape", [x, const(f"shape.{m}x{c}", [m, c])], "rows", [m, c]).outputs[0]
    if int16:
        approx = op("MatMulQ8I16", [x2, q, d], "approx", [m, v])
        approx.domain = kernels.DOMAIN
    else:
        approx = op("MatMulNBits", [x2, q, d], "approx", [m, v],
                    attrs={"K": c, "N": v, "bits": 8, "block_size": block, "accuracy_level": 4})
        approx.domain = DOMAIN
    approx = approx.outputs[0]
    if cfg.certificate == "op":
        kernels.require("certified_lm_head: {certificate: op}")
        settings = const(f"settings.{k}.{s}", np.array([k, s, BOUND_PAD], np.float32))
        checked = op("CertifyArgmax", [approx, x2, table, token_w, worst_w, settings], "certify", [m, v])
        checked.domain = kernels.DOMAIN
        _finish(graph, node, checked.outputs[0], op, const)
        return True
    top = op("TopK", [approx, const(f"k.{s + 1}", [s + 1])], "candidates", [m, s + 1], attrs={"axis": 1}, outs=2)
    ranked, ranked_idx = top.outputs
    ranked_idx.shape, ranked_idx.type = ir.Shape([m, s + 1]), ir.TensorType(i64)
    axis1 = const("axes.1", [1])

    def ranks(source: ir.Value, lo: int, hi: int, label: str, dtype=f32) -> ir.Value:
        """columns lo..hi-1 of a TopK output"""
        return op("Slice", [source, const(f"starts.{lo}", [lo]), const(f"ends.{hi}", [hi]), axis1], label,
                  [m, hi - lo], dtype=dtype).outputs[0]

    idx = ranks(ranked_idx, 0, k, "best_k", i64)
    rows = op("Gather", [table, idx], "candidate_rows", [m, k, c]).outputs[0]
    xcol = op("Reshape", [x2, const(f"shape.{m}x{c}x1", [m, c, 1])], "column", [m, c, 1]).outputs[0]
    exact = op("MatMul", [rows, xcol], "rescore", [m, k, 1]).outputs[0]
    exact = op("Reshape", [exact, const(f"shape.{m}x{k}", [m, k])], "exact", [m, k]).outputs[0]
    best = op("ReduceMax", [exact, axis1], "best", [m, 1], attrs={"keepdims": 1}).outputs[0]

    blocks = op("Reshape", [x2, const(f"shape.{m}x{nb}x{block}", [m, nb, block])], "blocks", [m, nb, block]).outputs[0]
    amax = op("ReduceMax", [op("Abs", [blocks], "abs", [m, nb, block]).outputs[0], const("axes.2", [2])],
              "block_max", [m, nb], attrs={"keepdims": 0}).outputs[0]
    pad = const("pad", np.float32(BOUND_PAD))
    # the screened tokens, each with its own bound
    screened = op("Gather", [token_w, ranks(ranked_idx, k, s, "screened", i64)], "screened_weights",
                  [m, s - k, nb]).outputs[0]
    amax_col = op("Reshape", [amax, const(f"shape.{m}x{nb}x1", [m, nb, 1])], "block_max_col", [m, nb, 1]).outputs[0]
    screened_bound = op("MatMul", [screened, amax_col], "screened_bound_col", [m, s - k, 1]).outputs[0]
    screened_bound = op("Reshape", [screened_bound, const(f"shape.{m}x{s - k}", [m, s - k])], "screened_bound",
                        [m, s - k]).outputs[0]
    screened_upper = op("Add", [ranks(ranked, k, s, "screened_approx"), screened_bound], "screened_upper",
                        [m, s - k]).outputs[0]
    screened_rival = op("ReduceMax", [screened_upper, axis1], "screened_rival", [m, 1], attrs={"keepdims": 1}).outputs[0]
    # every other token: below the S-th approximation, within the row's bound
    row_bound = op("MatMul", [amax, worst_w], "row_bound", [m, 1]).outputs[0]
    rest_rival = op("Add", [ranks(ranked, s, s + 1, "next_best"), row_bound], "rest_rival", [m, 1]).outputs[0]
    rival = op("Add", [op("Max", [screened_rival, rest_rival], "rival_raw", [m, 1]).outputs[0], pad], "rival",
               [m, 1]).outputs[0]
    row_ok = op("Less", [rival, best], "row_certified", [m, 1], dtype=ir.DataType.BOOL).outputs[0]
    as_float = op("Cast", [row_ok], "row_certified_f", [m, 1], attrs={"to": int(f32)}).outputs[0]
    all_ok = op("ReduceMin", [as_float], "all_certified_f", [], attrs={"keepdims": 0}).outputs[0]
    cond = op("Cast", [all_ok], "all_certified", [], dtype=ir.DataType.BOOL,
              attrs={"to": int(ir.DataType.BOOL)}).outputs[0]
    choose = ir.Node("", "If", [cond], attributes=[
        ir.AttrGraph("then_branch", _certified_branch("lm_head_certified_then", approx, idx, exact, m, v)),
        ir.AttrGraph("else_branch", _fallback("lm_head_float_fallback", approx, idx, exact, row_ok, table, x2, m, v)),
    ], name="lm_head_certified/choose")
    graph.insert_before(node, choose)
    chosen = choose.outputs[0]
    chosen.name, chosen.shape, chosen.type = "lm_head_certified_logits", ir.Shape([m, v]), ir.TensorType(f32)
    _finish(graph, node, chosen, op, const)
    return True


def _finish(graph: ir.Graph, node: ir.Node, logits: ir.Value, op, const) -> None:
    """The checked [M, V] logits in the head's output shape, in place of the float head."""
    out_shape = shape_of(node.outputs[0])
    y = op("Reshape", [logits, const("shape." + "x".join(map(str, out_shape)), out_shape)], "logits",
           out_shape).outputs[0]
    take_over(node.outputs[0], y, "float")
    graph.remove(node, safe=True)


@register("certified_lm_head")
class CertifiedLmHead(GraphPass):
    runs_before = ("matmul_nbits", "check_htp")
    argmax_exact_outputs = (OUTPUT,)

    class Config(PassConfig):
        block_size: int = 32  # GGUF's Q8_0 block
        candidates: int = 32  # K rows rescored in float per call (a Gather of K x C floats)
        screened: int = 256   # the best S approximations get a bound of their own (the rest share the row's)
        # the first pass's activations: int8 (onnxruntime's 8-bit MatMulNBits at accuracy level 4,
        # which copies the codes into a prepacked buffer and keeps float32 scales) or int16 (mobc's
        # MatMulQ8I16: the GGUF's codes and float16 scales read as stored, each 32-block of x rounded
        # to int16, a 258x tighter bound; on SmolLM2's decode step 0.94-1.00x the time, README).
        # int16 applies to graphs of up to kernel_rows rows; wider ones keep int8
        activations: Literal["int8", "int16"] = "int8"
        kernel_rows: int = 32
        # the check after the first pass: standard ONNX nodes (TopK, Gathers, MatMuls, an If with the
        # per-row float fallback), or mobc's CertifyArgmax doing the same in one call (needs the
        # kernel library; SmolLM2's int16 decode step: README)
        certificate: Literal["graph", "op"] = "graph"

    def rewrite(self, model: ir.Model) -> bool:
        node = _lm_head(model.graph)
        if node is None or not _rewrite(model.graph, node, self.config):
            return False
        model.opset_imports.setdefault(DOMAIN, 1)
        if any(n.domain == kernels.DOMAIN for n in model.graph):
            model.opset_imports.setdefault(kernels.DOMAIN, kernels.OPSET)
        remove_unused(model)
        return True

    def ensures(self, model: ir.Model) -> None:
        node = _lm_head(model.graph)
        if node is not None and _q8_grid(linear_weight(node)[0], self.config.block_size) is not None:
            raise AssertionError(f"{OUTPUT} is still a float MatMul over a Q8_0 weight")
