"""Compiling a feature-level draft head (toolchain/train/head_model.py) into step graphs.

A recipe with a `head:` section compiles the head trained for its `source` model instead of the
model itself. Each graph follows the step-graph convention (DESIGN.md) with one layer, plus:

    inputs   features [1,N,C]   the target's residual before its final norm at each row's previous
                                position (or the head's own `hidden` of the previous draft row)
    outputs  logits [1,N,V']    over the draft vocabulary (draft_vocab.npy maps index -> token id)
             hidden [1,N,C]     the head's predicted feature, the next draft row's `features`

The head's attention is the capture's own step attention (toolchain/compile/capture.py), so cache
layout, masks and RoPE inputs are the target's. Verification runs a real token sequence through the
compiled width-1 graph with the runtime's own cache, row by row, against the torch module's causal
pass over the whole sequence (the form it was trained in): logits, features and drafted tokens.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import optimizer
from torch import nn

from toolchain.artifact.layout import StepLayout
from toolchain.compile.capture import ATTENTION_NAME
from toolchain.compile.export import OPSET, ExportError, name_initializers, name_nodes
from toolchain.errors import MobcError
from toolchain.train.head_model import DraftHead, load_head_tensors, saved_layers

FEATURES = "features"
HIDDEN = "hidden"
VOCAB_FILE = "draft_vocab.npy"


class HeadError(MobcError):
    """The head's weights do not fit the recipe's target."""


def load_head(target: Any, weights: Path, dropout: float = 0.0) -> DraftHead:
    """The trained head for `target` from the safetensors `mobc train draft --kind head` wrote (in eval mode;
    `dropout` for a training that goes on from it)."""
    from safetensors.torch import load_file

    if not weights.is_file():
        raise HeadError(f"head weights {weights} do not exist; train them with `mobc train draft --kind head` "
                        "or point `head: {weights: ...}` at the shipped file")
    tensors = load_file(str(weights))
    if "vocab_ids" not in tensors:
        raise HeadError(f"{weights} has no vocab_ids tensor: not a file `mobc train draft --kind head` wrote")
    layers = saved_layers(tensors)
    if layers == 0:
        raise HeadError(f"{weights} holds no head layer tensors: not a file `mobc train draft --kind head` wrote")
    head = DraftHead(target, tensors.pop("vocab_ids").long(), init_layer=None, layers=layers, dropout=dropout)
    try:
        load_head_tensors(head, tensors)
    except RuntimeError as exc:
        raise HeadError(f"{weights} was trained for another target (its shapes do not match "
                        f"{target.config.model_type} with hidden size {target.config.hidden_size}): "
                        f"{str(exc).splitlines()[0]}") from exc
    return head.float().eval()


def head_layout(head: DraftHead, width: int, context: int) -> StepLayout:
    from toolchain.compile.capture import layout_for

    base = layout_for(head.config, width, context)
    return StepLayout(**{**base.__dict__, "vocab": len(head.vocab_ids)})


def io_names(layout: StepLayout) -> tuple[list[str], list[str]]:
    ins = [n for n, _, _ in layout.inputs()]
    outs = [n for n, _, _ in layout.outputs()]
    return [ins[0], FEATURES, *ins[1:]], [outs[0], HIDDEN, *outs[1:]]


class HeadStepGraph(nn.Module):
    """forward(input_ids, features, mask, cos, sin, past_key_0, past_value_0, ...) -> (logits, hidden, K_0, V_0, ...)."""

    def __init__(self, head: DraftHead, layout: StepLayout):
        super().__init__()
        self.head, self.layout = head, layout
        head.config._attn_implementation = ATTENTION_NAME

    def forward(self, input_ids, features, mask, cos, sin, *past):
        lay = self.layout
        x = self.head.mix(features, input_ids.long())
        rope = (torch.cat([cos, cos], -1).reshape(1, lay.width, lay.head_dim),
                torch.cat([sin, sin], -1).reshape(1, lay.width, lay.head_dim))
        sink: list = []
        for i, layer in enumerate(self.head.layers):
            out = layer(x, attention_mask=mask, position_embeddings=rope, mobc_kv=(past[2 * i], past[2 * i + 1], sink))
            x = out[0] if isinstance(out, tuple) else out
        return (self.head.logits(x), x, *(t for kv in sink for t in kv))


def example_feeds(layout: StepLayout, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ins, _ = io_names(layout)
    shapes = dict((n, (s, d)) for n, s, d in layout.inputs())
    shapes[FEATURES] = ([1, layout.width, layout.hidden], "float32")
    feeds = {}
    for name in ins:
        shape, dtype = shapes[name]
        if dtype == "int32":
            feeds[name] = rng.integers(0, 1000, shape).astype(np.int32)
        elif name.startswith("attention_mask"):
            feeds[name] = np.zeros(shape, np.float32)
        else:
            feeds[name] = (rng.standard_normal(shape) * (1.0 if name == FEATURES else 0.1)).astype(np.float32)
    return feeds


def export_head_graph(head: DraftHead, layout: StepLayout, graph_name: str) -> ir.Model:
    wrapper = HeadStepGraph(head, layout).eval()
    ins, outs = io_names(layout)
    feeds = example_feeds(layout)
    args = tuple(torch.from_numpy(feeds[n]) for n in ins)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")
            logging.getLogger("torch.onnx").setLevel(logging.ERROR)
            program = torch.onnx.export(wrapper, args, input_names=ins, output_names=outs, opset_version=OPSET,
                                        dynamo=True, optimize=False, verify=False, report=False)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"torch.onnx.export failed for head graph {graph_name!r} ({type(exc).__name__}: {first})") from exc
    finally:
        head.config._attn_implementation = "sdpa"
    model = program.model
    optimizer.optimize(model)
    model.graph.name = graph_name
    name_nodes(model)
    name_initializers(model)
    return model


def reference_sequence(head: DraftHead, target: Any, tokens: list[int]) -> dict[str, np.ndarray]:
    """The target's features over `tokens` and the head's causal pass over them (the trained form)."""
    with torch.no_grad():
        ids = torch.tensor([tokens])
        seen: list[torch.Tensor] = []  # the residual entering the final norm (HF returns it normalized)
        hook = target.model.norm.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
        try:
            target.model(ids)
        finally:
            hook.remove()
        raw = seen[-1]
        feats = torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], 1)  # row t: the feature of t-1
        head.config._attn_implementation = "sdpa"
        positions = torch.arange(len(tokens))[None]
        g = head.forward_train(feats, ids, positions, normalized=False)
        return {"features": feats[0].numpy(), "hidden": g[0].numpy(), "logits": head.logits(g)[0].numpy()}


def verify_head(folder: Path, head: DraftHead, target: Any, tokens: list[int], max_abs: float) -> dict[str, Any]:
    """Row-by-row decode through the compiled width-1 graph vs the torch causal pass."""
    from toolchain.runtime.model import StepModel

    ref = reference_sequence(head, target, tokens)
    model = StepModel(folder, io_binding=False)
    fam = model.decode_family
    feats = model.extra_inputs(fam)[FEATURES]
    worst = {"logits": 0.0, "hidden": 0.0}
    same_argmax = 0
    model.reset()
    for t, tok in enumerate(tokens):
        feats[...] = 0.0
        feats[0, 0] = ref["features"][t]
        logits = model.forward([tok], family=fam)
        hidden = model._last[1][HIDDEN][0, 0]
        worst["logits"] = max(worst["logits"], float(np.abs(logits[0] - ref["logits"][t]).max()))
        worst["hidden"] = max(worst["hidden"], float(np.abs(hidden - ref["hidden"][t]).max()
                                                 / max(1.0, float(np.abs(ref["hidden"][t]).max()))))
        same_argmax += int(np.argmax(logits[0]) == np.argmax(ref["logits"][t]))
        model.commit([0])
    result = {"rows": len(tokens), "max_abs_logits": worst["logits"], "max_rel_hidden": worst["hidden"],
              "argmax_identical": same_argmax, "ok": worst["logits"] <= max_abs and worst["hidden"] <= max_abs}
    if not result["ok"]:
        raise ExportError(f"head graph {fam} does not compute its torch module: max |logits diff| "
                          f"{worst['logits']:.3g}, max relative |hidden diff| {worst['hidden']:.3g} over "
                          f"{len(tokens)} decoded rows (tolerance {max_abs:g})")
    return result
