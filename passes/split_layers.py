"""split_layers: cut a family's decoder stage into parts at layer boundaries.

Rewrite rule (graph-level, per family): the stage holding the decoder layers is cut before each
layer k in the cut set; the interface between parts is the residual stream entering layer k,
named `residual_<k>` [1,N,C]. Part j computes layers [start, stop) and outputs their new K/V
rows; the first part also holds the embedding, the last part the final norm / lm_head (unless
split_lm_head moved them out) and the family's hidden/logits output. Inputs a part needs besides
the residual (masks, RoPE tables, its layers' past K/V) come from the family inputs; small
preprocessing both sides need (RoPE table reshapes) is computed in each part.

The cut set is the union of
  - `at: [k, ...]`: explicit boundaries (e.g. the layer Lever's predictor prunes at), and
  - `max_part_bytes`: a greedy budget packing; a part is closed before the layer that would
    push its weights over the budget (HTP's per-graph limit is ~2 GB). A single layer larger
    than the budget gets a part of its own.
Part 0 keeps the stage's name and role; part j >= 1 is `<name>_part<j>` with role "part".
Every part records meta {"layers": [start, stop]} (stop exclusive), the manifest's chaining.

Requires: node names with the layer prefix `layers.<i>.` (export.py; every mobc pass keeps it)
  and a single residual tensor crossing each cut.
Ensures (`ensures`): the parts' layer ranges tile the layer range in order, each part j >= 1
  has input `residual_<start>` produced by part j-1, and every node of a part that depends on
  the tokens belongs to its layers or to no layer.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from passes.base import GraphSetPass, PassConfig
from passes.registry import register
from toolchain.errors import PassError
from toolchain.ir.graph import extract, layer_of, scope
from toolchain.ir.graphset import GraphSet

_HEAD_SCOPES = ("embed_tokens",)


def _position(node: ir.Node, n_layers: int) -> float | None:
    """Where a node sits along the residual stream: -1 embedding, i layer i, n_layers the tail."""
    i = layer_of(node)
    if i is not None:
        return i
    s = scope(node)
    if s.split(".")[0] in _HEAD_SCOPES:
        return -1
    if s in ("graph", ""):
        return None
    return n_layers


def _layer_bytes(model: ir.Model, n_layers: int) -> list[int]:
    sizes = [0] * (n_layers + 2)  # [embedding, layer 0..L-1, tail]
    seen: set[int] = set()
    for node in model.graph:
        pos = _position(node, n_layers)
        slot = 0 if pos is None or pos < 0 else int(pos) + 1
        for v in node.inputs:
            if v is not None and v.is_initializer() and id(v) not in seen:
                seen.add(id(v))
                sizes[slot] += v.const_value.nbytes
    return sizes


@register("split_layers")
class SplitLayers(GraphSetPass):
    class Config(PassConfig):
        at: list[int] = []  # cut before these layers
        max_part_bytes: float | None = None  # weight budget per part

    def cuts(self, model: ir.Model, n_layers: int) -> list[int]:
        cuts = set(self.config.at)
        bad = [k for k in cuts if not 0 < k < n_layers]
        if bad:
            raise PassError(f"split_layers.at: layer boundaries {bad} are outside 1..{n_layers - 1}")
        budget = self.config.max_part_bytes
        if budget:
            sizes = _layer_bytes(model, n_layers)
            part = sizes[0]  # the embedding rides in part 0
            for i in range(n_layers):
                size = sizes[i + 1] + (sizes[-1] if i == n_layers - 1 else 0)
                if i > 0 and (i in cuts or part + size > budget):
                    cuts.add(i)
                    part = 0
                part += size
        return sorted(cuts)

    def apply(self, gs: GraphSet, family: str) -> GraphSet:
        chain = gs.chain(family)
        bodies = [e for e in chain if any(layer_of(n) is not None for n in e.model.graph)]
        if len(bodies) != 1:
            raise PassError(f"split_layers: graph {family!r} is already split into parts; list it once")
        body = bodies[0]
        model = body.model
        n_layers = 1 + max(layer_of(n) for n in model.graph if layer_of(n) is not None)
        cuts = self.cuts(model, n_layers)
        if not cuts:
            return gs
        tainted = _downstream_of_tokens(model)
        pos = {n: _position(n, n_layers) if n in tainted else None for n in model.graph}
        boundary = {k: _crossing(model, pos, k) for k in cuts}
        bounds = [0, *cuts, n_layers]
        out_part: dict[str, int] = {}
        for v in model.graph.outputs:
            p = pos.get(v.producer(), -1) if v.producer() is not None else -1
            p = max(-1, min(n_layers, n_layers if p is None else p))
            out_part[v.name] = max(j for j in range(len(bounds) - 1) if bounds[j] <= max(p, 0))
        parts = []
        for j in range(len(bounds) - 1):
            start, stop = bounds[j], bounds[j + 1]
            ins = [boundary[start]] if j > 0 else []
            outs = [n for n in body.output_names if out_part[n] == j]
            if stop < n_layers:
                outs.append(boundary[stop])
            name = body.name if j == 0 else f"{body.name}_part{j}"
            part = extract(model, ins, outs, name)
            for v in [*part.graph.inputs, *part.graph.outputs]:
                for k, b in boundary.items():
                    if v.name == b:
                        v.name = f"residual_{k}"
            meta = {**body.meta, "layers": [start, stop], "part": j, "parts": len(bounds) - 1}
            role = body.role if j == 0 else "part"
            parts.append(dataclasses.replace(body, name=name, model=part, role=role, meta=meta))
        stages, k = [], 0
        for e in chain:
            for s in parts if e is body else [e]:
                stages.append(dataclasses.replace(s, stage=k))
                k += 1
        gs.replace_family(family, stages)
        return gs

    def ensures(self, gs: GraphSet, family: str) -> None:
        parts = [e for e in gs.chain(family) if "layers" in e.meta]
        if not parts:
            return
        expected = 0
        for j, e in enumerate(parts):
            start, stop = e.meta["layers"]
            assert start == expected, f"{e.name}: layers start at {start}, expected {expected}"
            expected = stop
            if j > 0:
                assert f"residual_{start}" in e.input_names, e.input_names
                assert f"residual_{start}" in parts[j - 1].output_names
            for n in _downstream_of_tokens(e.model):
                i = layer_of(n)
                assert i is None or start <= i < stop, (
                    f"{e.name}: node {n.name} outside layers {start}..{stop}"
                )


def _crossing(model: ir.Model, pos: dict, k: int) -> str:
    found: list[str] = []
    for node in model.graph:
        p = pos[node]
        if p is None or p < k:
            continue
        for v in node.inputs:
            if v is None or v.is_initializer() or v.const_value is not None or v.producer() is None:
                continue
            q = pos[v.producer()]
            if q is not None and q < k and v.name not in found:
                found.append(v.name)
    if len(found) != 1:
        raise PassError(
            f"split_layers: cutting before layer {k} crosses {found}, expected one residual tensor"
        )
    return found[0]


def _downstream_of_tokens(model: ir.Model) -> set[ir.Node]:
    """Nodes that depend on input_ids; the rest only reshape masks/RoPE tables and may be
    recomputed by every part."""
    roots = {v for v in model.graph.inputs if v.name == "input_ids" or v.name.startswith("residual_")}
    tainted: set[ir.Node] = set()
    for node in model.graph:
        if any(v is not None and (v in roots or v.producer() in tainted) for v in node.inputs):
            tainted.add(node)
    return tainted


@register("split_parts")
class SplitParts(SplitLayers):
    """split_parts: split_layers by a weight budget only (DESIGN's name for the HTP size cut)."""

    class Config(PassConfig):
        max_part_bytes: float = 1.5e9  # HTP's per-graph limit is ~2 GB; keep headroom

    def cuts(self, model: ir.Model, n_layers: int) -> list[int]:
        full = SplitLayers.Config(max_part_bytes=self.config.max_part_bytes)
        return SplitLayers(full).cuts(model, n_layers)
