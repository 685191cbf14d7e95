"""certified_lm_head on tiny graphs whose tied or untied lm_head sits on a Q8_0 grid: the fast
8-bit head (onnxruntime's MatMulNBits on int8 activations, or mobc's MatMulQ8I16 on int16 ones) keeps
every row's argmax (and its value) exact, its error bound holds against the float head, and when the
certificate fails the If falls back to the float product."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
import pytest

import passes.certified_lm_head as certified
from passes import build
from tests.passes.test_matmul_nbits import _q8_0
from tests.passes.tiny import graphset_for
from toolchain import kernels
from toolchain.compile.pass_runner import ort_run, run_passes
from toolchain.ir.graph import const_array, extract, linear_weight, shape_of

# the first pass's kernel per `activations`
FIRST_PASS = {"int8": "MatMulNBits", "int16": "MatMulQ8I16"}
ACTIVATIONS = ["int8", pytest.param("int16", marks=pytest.mark.skipif(not kernels.available(),
                                                                        reason="no C compiler for mobc's CPU kernels"))]


def _head_on_q8_0(gs) -> None:
    """The lm_head's [V, C] weight on a Q8_0 grid along C (as GGUF stores token_embd)."""
    for entry in gs.entries.values():
        node = certified._lm_head(entry.model.graph)
        w = node.inputs[1]
        if w.producer() is not None:  # tied: Transpose(E)
            e = w.producer().inputs[0]
            e.const_value = ir.tensor(_q8_0(const_array(e).T).T.copy(), name=e.name)
        else:  # untied W [C, V]
            w.const_value = ir.tensor(_q8_0(const_array(w)), name=w.name)


def _certified(arch: str, width: int = 4, activations: str = "int8"):
    gs, feeds = graphset_for(arch, (width,))
    _head_on_q8_0(gs)
    float_logits = {f: ort_run(e, feeds[f])["logits"] for f, e in gs.entries.items()}
    for entry in gs.entries.values():
        assert build({"certified_lm_head": {"activations": activations}}).call(entry.model).modified
    return gs, feeds, float_logits


# the check after the first pass: ONNX nodes around an If, or mobc's CertifyArgmax
CERTIFICATES = ["graph", pytest.param("op", marks=pytest.mark.skipif(not kernels.available(),
                                                                     reason="no C compiler for mobc's CPU kernels"))]
CHECK_OP = {"graph": "If", "op": "CertifyArgmax"}


@pytest.mark.parametrize("certificate", CERTIFICATES)
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # untied head; tied (Transpose of the embedding)
def test_argmax_exact_through_the_pass_runner(arch, activations, certificate):
    gs, feeds = graphset_for(arch, (1, 4))
    _head_on_q8_0(gs)
    config = {"activations": activations, "certificate": certificate}
    out, rows = run_passes(gs, ["fold_constants", {"certified_lm_head": config}], 1e-5, feeds)
    for entry in out.entries.values():
        build("certified_lm_head").ensures(entry.model)
        ops = [n.op_type for n in entry.model.graph]
        assert CHECK_OP[certificate] in ops and FIRST_PASS[activations] in ops
        if certificate == "op":
            assert "TopK" not in ops and "If" not in ops
        heads = [n for n in entry.model.graph if linear_weight(n) is not None and linear_weight(n)[0].shape == (256, 64)]
        assert not heads  # no float MatMul over the [V, C] head remains
    assert rows[-1]["worst"]["diff"] < 1e-5  # at the argmax, where the contract is exact


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_non_candidates_move_within_the_bound_and_the_argmax_does_not(activations):
    gs, feeds, float_logits = _certified("llama", 4, activations)
    for fam, entry in gs.entries.items():
        got = ort_run(entry, feeds[fam])["logits"]
        ref = float_logits[fam]
        assert (got.argmax(-1) == ref.argmax(-1)).all()
        assert np.abs(got - ref).max() > 1e-7  # the rounding head really ran (the relaxation is real)


def _node(graph: ir.Graph, label: str) -> ir.Node:
    return next(n for n in graph if n.name == f"lm_head_certified/{label}")


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("scale", [0.3, 3.0, 40.0])
def test_the_bounds_cover_the_first_passs_error(scale, activations):
    """|first-pass logits - float logits| <= the row's bound for every token, and <= the screened
    tokens' own bounds for them, on activations of very different sizes and with a few massive
    channels (what defeats a bound that assumes one scale per row); the int16 pass's bound is the
    int8 one's over 258 (its rounding step), so a bound copied from the other kernel fails here."""
    gs, _, _ = _certified("llama", 4, activations)
    entry = next(iter(gs.entries.values()))
    graph = entry.model.graph
    x = _node(graph, "rows").inputs[0]
    names = {label: _node(graph, label).outputs[0].name for label in ("approx", "row_bound", "screened", "screened_bound")}
    table = const_array(_node(graph, "candidate_rows").inputs[0]).astype(np.float64)  # [V, C]
    head = dataclasses.replace(entry, name="head", model=extract(entry.model, [x.name], list(names.values()), "head"))
    rng = np.random.default_rng(1)
    for _ in range(20):
        h = (rng.standard_normal(shape_of(x)) * scale).astype(np.float32)
        h[..., rng.integers(0, h.shape[-1], 2)] *= 25
        out = ort_run(head, {x.name: h})
        err = np.abs(out[names["approx"]] - h.reshape(-1, h.shape[-1]).astype(np.float64) @ table.T)
        row = out[names["row_bound"]] + certified.BOUND_PAD
        assert row.shape == (err.shape[0], 1) and (err <= row).all()
        screened_err = np.take_along_axis(err, out[names["screened"]], axis=1)
        assert (screened_err <= out[names["screened_bound"]] + certified.BOUND_PAD).all()
        assert (out[names["screened_bound"]] <= out[names["row_bound"]] * (1 + 1e-6)).all()  # the row's is the loosest
        assert err.max() > 0.05 * out[names["row_bound"]].min()  # the bound is tight enough to mean something


def test_a_failed_certificate_falls_back_to_the_float_head(monkeypatch):
    """A pad that no candidate can beat fails every row's certificate: the If's float branch runs
    and the logits are the float head's everywhere, not only at the argmax."""
    monkeypatch.setattr(certified, "BOUND_PAD", 1e9)
    gs, feeds, float_logits = _certified("llama", 4)
    for fam, entry in gs.entries.items():
        got = ort_run(entry, feeds[fam])["logits"]
        np.testing.assert_allclose(got, float_logits[fam], atol=1e-5)


def test_later_passes_keep_the_certificate_a_valid_graph():
    """Passes after it may eliminate identities and collapse layouts (onnx_ir's passes recurse into
    subgraphs): the If's branches must stay valid graphs that onnxruntime loads and runs."""
    gs, feeds = graphset_for("llama", (1, 4))
    _head_on_q8_0(gs)
    out, rows = run_passes(gs, ["fold_constants", "certified_lm_head", "simplify_layout", "fold_constants"],
                           1e-5, feeds)
    assert all(r["worst"]["diff"] < 1e-5 for r in rows)
    assert all(any(n.op_type == "If" for n in e.model.graph) for e in out.entries.values())


def test_the_certificate_compares_the_next_best_approximation_with_the_best_rescored_one():
    """The rival of a row is its (K+1)-th approximate logit plus the bound: with the pad set just
    above best_exact - rival_without_pad the certificate fails (float fallback everywhere), just
    below it holds (the approximate logits off the candidates)."""
    gs, feeds, float_logits = _certified("llama", 1)
    entry = next(iter(gs.entries.values()))
    fam = next(iter(gs.entries))
    graph = entry.model.graph
    best, rival = _node(graph, "best").outputs[0].name, _node(graph, "rival").outputs[0].name
    probe = dataclasses.replace(entry, name="probe", model=extract(entry.model, [i.name for i in graph.inputs],
                                                                 [best, rival], "probe"))
    out = ort_run(probe, feeds[fam])
    margin = float((out[best] - out[rival]).min())  # > 0: this call is certified with the default pad
    assert margin > 0
    for pad_delta, certified_expected in ((margin * 1.01, False), (margin * 0.5, True)):
        monkey_pad = certified.BOUND_PAD + pad_delta
        gs2, feeds2 = graphset_for("llama", (1,))
        _head_on_q8_0(gs2)
        old = certified.BOUND_PAD
        certified.BOUND_PAD = monkey_pad
        try:
            for e in gs2.entries.values():
                assert build("certified_lm_head").call(e.model).modified
        finally:
            certified.BOUND_PAD = old
        got = ort_run(next(iter(gs2.entries.values())), feeds2[fam])["logits"]
        is_float = np.allclose(got, float_logits[fam], atol=1e-6)
        assert is_float != certified_expected


@pytest.mark.parametrize("certificate", CERTIFICATES)
def test_only_the_rows_whose_certificate_fails_get_the_float_head(certificate):
    """With the pad between two rows' margins (the graph form's best rescored - rival), the rows below
    it take their float logits over the whole vocabulary and the others keep the certified logits
    (approximate off the candidates); the op must send exactly those rows to the float product."""
    gs, feeds, float_logits = _certified("llama", 4)
    entry, fam = next(iter(gs.entries.values())), next(iter(gs.entries))
    graph = entry.model.graph
    best, rival = _node(graph, "best").outputs[0].name, _node(graph, "rival").outputs[0].name
    probe = dataclasses.replace(entry, name="probe", model=extract(entry.model, [i.name for i in graph.inputs],
                                                                 [best, rival], "probe"))
    out = ort_run(probe, feeds[fam])
    margins = (out[best] - out[rival]).reshape(-1)  # > 0: certified with the default pad
    assert (margins > 0).all() and len(set(margins.tolist())) == len(margins)
    cut = float(np.sort(margins)[1:3].mean())  # between the second and third smallest margins
    gs2, feeds2 = graphset_for("llama", (4,))
    _head_on_q8_0(gs2)
    old = certified.BOUND_PAD
    certified.BOUND_PAD = old + cut
    try:
        for e in gs2.entries.values():
            assert build({"certified_lm_head": {"certificate": certificate}}).call(e.model).modified
    finally:
        certified.BOUND_PAD = old
    got = ort_run(next(iter(gs2.entries.values())), feeds2[fam])["logits"].reshape(4, -1)
    want = float_logits[fam].reshape(4, -1)
    failing = margins < cut
    assert failing.sum() == 2
    for row in range(4):
        is_float = np.allclose(got[row], want[row], atol=1e-5)
        assert is_float == bool(failing[row]), row
        assert got[row].argmax() == want[row].argmax()


def _op_form(arch: str, width: int, activations: str = "int8"):
    gs, feeds = graphset_for(arch, (width,))
    _head_on_q8_0(gs)
    for entry in gs.entries.values():
        config = {"activations": activations, "certificate": "op"}
        assert build({"certified_lm_head": config}).call(entry.model).modified
    return gs, feeds


@pytest.mark.skipif(not kernels.available(), reason="no C compiler for mobc's CPU kernels")
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_op_gives_the_graph_forms_logits(arch, activations):
    """Same ranking, candidates and decisions: the logits agree to float32 rounding of the rescoring."""
    graph_form, feeds, float_logits = _certified(arch, 4, activations)
    op_form, _ = _op_form(arch, 4, activations)
    for fam, entry in op_form.entries.items():
        got = ort_run(entry, feeds[fam])["logits"]
        np.testing.assert_allclose(got, ort_run(graph_form.entries[fam], feeds[fam])["logits"], rtol=0, atol=1e-6)
        assert (got.argmax(-1) == float_logits[fam].argmax(-1)).all()
        assert np.abs(got - float_logits[fam]).max() > 1e-7  # the rounding head really ran
