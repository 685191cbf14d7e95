"""Predictor pruning: score tree branches at layer l, verify only the promising ones past l.

The target's tree call is cut at layer l (split_layers at l). After the first part, the
residual stream at l of every node u is read through the target's own final norm and output
embedding, restricted to u's candidate tokens: its children in the tree plus *shadow*
candidates (draft tokens proposed at u but not in the tree), and softmax-normalized over that
set, so a child competes with the draft's other guesses, not with the whole vocabulary.
A logistic model over [early log-prob, early argmax, draft log-prob, draft rank 0, depth]
estimates P(child == target's choice at u). Branches below a threshold are dropped (with their
subtrees), except the backbone (the draft's best child at every level), which is never
dropped; the kept nodes run the layers after l in the narrowest compiled tree width that
holds them. Acceptance over the kept tree is the same lossless walk, so output stays
identical to ar; pruning can only shorten what is accepted, never change it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from toolchain.errors import MobcError
from toolchain.runtime.model import StepModel
from toolchain.runtime.tree import Tree, accept
from toolchain.runtime.tree_exec import TreeVerifier, VerifyResult, run_stages

FEATURES = ["early_logprob", "early_top", "draft_logprob", "draft_rank0", "depth"]


@dataclass
class PredictorSpec:
    layer: int
    weights: list[float]
    bias: float
    threshold: float
    metrics: dict = field(default_factory=dict)
    features: list[str] = field(default_factory=lambda: list(FEATURES))
    # the draft it was fitted with: {"name", "weights_sha256"} (its features are that draft's confidences)
    draft: dict = field(default_factory=dict)


def draft_fingerprint(draft) -> dict[str, str]:
    """Name and weights hash of a draft (a StepModel, or a head / lookup adapter around one)."""
    model = getattr(draft, "step_model", draft)
    return {"name": model.name, "weights_sha256": model.manifest.weights.get("sha256", "")}


def check_draft(spec: PredictorSpec, draft, path: str | Path) -> None:
    """Refuse a predictor fitted with another draft: its thresholds are calibrated on that draft's
    confidences, and would prune the wrong branches silently."""
    want = spec.draft.get("weights_sha256")
    have = draft_fingerprint(draft)
    if want and have["weights_sha256"] and want != have["weights_sha256"]:
        raise MobcError(
            f"predictor {path} was fitted with draft {spec.draft.get('name')!r} (weights sha256 {want[:12]}); "
            f"draft {have['name']!r} has weights {have['weights_sha256'][:12]}. Fit one for this draft: "
            f"`mobc train predictor <target artifact> --draft <this draft's folder> --out {path}`")


def save_predictor(spec: PredictorSpec, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(asdict(spec), indent=1))
    return path


def load_predictor(path: str | Path) -> PredictorSpec:
    p = Path(path)
    if not p.is_file():
        raise MobcError(f"predictor file {p} does not exist; train one with `mobc train predictor`")
    return PredictorSpec(**json.loads(p.read_text()))


class HeadReader:
    """The target's final norm and output embedding as numpy (from its lm_head graph)."""

    def __init__(self, model: StepModel):
        import onnx_ir as ir

        head = [s for s in model.sessions.chain(model.decode_family) if s.role == "lm_head"]
        if not head:
            raise MobcError(f"{model.name}: predictor pruning needs split_lm_head in the recipe's passes")
        g = ir.load(str(model.folder / head[0].file)).graph
        c, v = model.manifest.model.hidden, model.vocab
        self.norm = np.ones(c, np.float32)
        self.eps = 1e-5
        self.emb = None
        for val in g.initializers.values():
            shape = tuple(val.shape)
            if shape == (c,):
                self.norm = val.const_value.numpy().astype(np.float32)
            elif shape == (c, v):
                self.emb = val.const_value.numpy().astype(np.float32)
            elif shape == (v, c):
                self.emb = val.const_value.numpy().astype(np.float32).T
        for node in g:
            if node.op_type == "Add":  # the eps of RMSNorm: the only scalar added before the sqrt
                for inp in node.inputs:
                    if inp is not None and inp.const_value is not None and inp.const_value.size == 1:
                        self.eps = float(inp.const_value.numpy().reshape(-1)[0])
        if self.emb is None:
            raise MobcError(f"{model.name}: no [hidden, vocab] output embedding found in {head[0].name}")

    def normed(self, residual: np.ndarray) -> np.ndarray:
        r = residual.astype(np.float32)
        return r / np.sqrt((r * r).mean(-1, keepdims=True) + self.eps) * self.norm


def features(tree: Tree, residual: np.ndarray, head: HeadReader) -> np.ndarray:
    """[n, len(FEATURES)] per node (row 0, the root, is unused)."""
    n = len(tree)
    f = np.zeros((n, len(FEATURES)), np.float32)
    h = head.normed(residual[:n])
    for u in range(n):
        kids = tree.children(u)
        if not kids:
            continue
        cand = [tree.tokens[c] for c in kids] + [t for t in tree.shadows.get(u, []) if t not in
                                                 {tree.tokens[c] for c in kids}]
        s = h[u] @ head.emb[:, cand]
        logq = s - s.max() - np.log(np.exp(s - s.max()).sum())
        top = int(np.argmax(s))
        ranked = sorted(kids, key=lambda c: -tree.probs[c])
        for j, c in enumerate(kids):
            f[c] = [logq[j], float(j == top), np.log(max(tree.probs[c], 1e-9)), float(c == ranked[0]),
                    tree.depths[c] / 8.0]
    return f


def score(spec: PredictorSpec, feats: np.ndarray) -> np.ndarray:
    z = feats @ np.asarray(spec.weights, np.float32) + spec.bias
    return 1.0 / (1.0 + np.exp(-z))


def backbone(tree: Tree) -> list[int]:
    """Root, then the draft's best child at every level."""
    out, u = [0], 0
    while kids := tree.children(u):
        u = max(kids, key=lambda c: (tree.probs[c], -c))
        out.append(u)
    return out


def keep_set(tree: Tree, probs: np.ndarray, threshold: float) -> list[int]:
    """Nodes kept: the backbone always; any other node if its parent is kept and it scores >= threshold."""
    keep = set(backbone(tree))
    for i in range(1, len(tree)):  # parents come first
        if i not in keep and tree.parents[i] in keep and probs[i] >= threshold:
            keep.add(i)
    return sorted(keep)


@dataclass
class PruneCounts:
    """What pruning did over the verifier's calls (cumulative; subtract two to get one run's)."""

    calls: int = 0  # tree verifications
    pruned_calls: int = 0  # ... that ran the layers past the cut at a narrower width
    nodes: int = 0  # tree nodes scored
    kept: int = 0  # ... that were verified
    tail_rows_saved: int = 0  # rows the layers past the cut did not compute

    def __sub__(self, other: PruneCounts) -> PruneCounts:
        return PruneCounts(**{k: getattr(self, k) - getattr(other, k) for k in vars(self)})


class PrunedVerifier(TreeVerifier):
    def __init__(self, model: StepModel, spec: PredictorSpec, logits: str = "path"):
        super().__init__(model, logits=logits)
        self.spec = spec
        self.head = HeadReader(model)
        self.cut: dict[str, int] = {}
        for fam in self.widths.values():
            chain = model.sessions.chain(fam)
            at = [s.stage for s in chain if s.meta.get("layers", [None])[0] == spec.layer]
            if at:
                self.cut[fam] = at[0]
        if not self.cut:
            raise MobcError(
                f"{model.name}: no tree graph is split at layer {spec.layer}; compile the target with "
                f"split_layers: {{at: [{spec.layer}]}}")
        self.counts = PruneCounts()

    def verify(self, tree: Tree, sampler) -> VerifyResult:
        m = self.model
        fam = self.family(len(tree))
        width = m.widths[fam]
        if fam not in self.cut or len(tree) <= 2:
            return super().verify(tree, sampler)
        cut = self.cut[fam]
        chain = m.sessions.chain(fam)
        feeds = m.call_inputs(tree.tokens, width, tree.ancestor_mask(), tree.depths)
        outs0 = run_stages(m, [s for s in chain if s.stage < cut], feeds, key=f"head:{fam}:{cut}")
        res_name = f"residual_{self.spec.layer}"
        residual = outs0[res_name][0]
        keep = keep_set(tree, score(self.spec, features(tree, residual, self.head)), self.spec.threshold)
        fits = [w for w in self.widths if w >= len(keep)]
        w2 = min(fits)
        self.counts.calls += 1
        self.counts.nodes += len(tree)
        self.counts.kept += len(keep)
        if w2 >= width or self.widths[w2] not in self.cut:  # no narrower graph: verify everything
            sub, order, fam2, cut2, feeds2 = tree, list(range(len(tree))), fam, cut, {**feeds, **outs0}
        else:
            sub, order = tree.subtree(keep)
            fam2 = self.widths[w2]
            cut2 = self.cut[fam2]
            feeds2 = m.call_inputs(sub.tokens, w2, sub.ancestor_mask(), sub.depths)
            r = np.zeros((1, w2, residual.shape[-1]), np.float32)
            r[0, : len(order)] = residual[order]
            feeds2[res_name] = r
            self.counts.pruned_calls += 1
            self.counts.tail_rows_saved += width - w2
        chain2 = m.sessions.chain(fam2)
        tail = [s for s in chain2 if s.stage >= cut2 and s.role != "lm_head"]
        outs1 = run_stages(m, tail, feeds2, key=f"tail:{fam2}:{cut2}")
        head = [s for s in chain2 if s.role == "lm_head"]
        if self.modes.get(width, self.logits) == "full" and head:  # one lm_head call over every kept row
            outs1.update(run_stages(m, head, {"hidden": outs1["hidden"]}, key=f"stage:{head[0].name}"))
        row, done = self._row_fn(outs1)
        acc = accept(sub, row, sampler)
        rows = {}
        for i in range(m.cache.layout.n_layers):
            for kind in ("key", "value"):
                name = f"new_{kind}_{i}"
                src, idx = (outs1, acc.path) if name in outs1 else (outs0, [order[p] for p in acc.path])
                rows[name] = np.take(src[name], idx, axis=-1 if kind == "key" else 2)
        if "hidden" in outs1:  # the features a draft head reads
            rows["hidden"] = np.take(outs1["hidden"], acc.path, axis=1)
        m.commit_rows(rows, range(len(acc.path)))
        acc.path = [order[p] for p in acc.path]
        rows_logits = m.widths[fam2] if "logits" in outs1 else len(done)
        return VerifyResult(acc, width, width, rows_logits, pruned_width=m.widths[fam2],
                            info={"kept": len(sub)})
