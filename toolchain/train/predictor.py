"""`mobc train predictor`: fit lever's branch predictor on real runs of target + draft.

Data: the lever policy decodes real prompts (held out from the bench's) with a recording
verifier that runs the full tree call (all layers, all logits). For every non-root node it
records the predictor features (toolchain/runtime/predictor.py: the residual at layer l read
through the final norm and output embedding over the node's siblings and shadow candidates,
plus draft confidence, rank and depth) and the label: is the node's token the target's
greedy choice after its parent. A logistic regression (Newton's method, L2) is fit on 80%;
the threshold is the highest one that keeps `recall` of the positive non-backbone nodes on
the held-out 20%, where precision, recall and the fraction of nodes pruned are reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from toolchain.errors import MobcError
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.sampling import Sampler
from toolchain.runtime.predictor import (
    FEATURES,
    HeadReader,
    PredictorSpec,
    backbone,
    draft_fingerprint,
    features,
    score,
)
from toolchain.runtime.tree import Tree, accept
from toolchain.runtime.tree_exec import TreeVerifier, VerifyResult, run_stages


def split_layer(model: StepModel) -> int:
    """The layer at which the target's tree graphs are cut (split_layers)."""
    cuts = set()
    for fam in model.widths:
        for st in model.sessions.chain(fam):
            layers = st.meta.get("layers")
            if layers and layers[0] > 0:
                cuts.add(layers[0])
    if not cuts:
        raise MobcError(f"{model.name}: compile the target with split_layers: {{at: [l]}} to train a predictor at l")
    return min(cuts)


class RecordingVerifier(TreeVerifier):
    """Full verification that also records (features, label, is_backbone) for every non-root node."""

    def __init__(self, model: StepModel, layer: int):
        super().__init__(model, logits="full")
        self.layer = layer
        self.head = HeadReader(model)
        self.x: list[np.ndarray] = []
        self.y: list[np.ndarray] = []
        self.bb: list[np.ndarray] = []

    def verify(self, tree: Tree, sampler) -> VerifyResult:
        m = self.model
        fam = self.family(len(tree))
        width = m.widths[fam]
        feeds = m.cache.step_inputs(tree.tokens, width, tree.ancestor_mask(), tree.depths)
        outs = run_stages(m, m.sessions.chain(fam), feeds, key=fam)
        res = outs.get(f"residual_{self.layer}")
        if res is not None and len(tree) > 1:
            f = features(tree, res[0], self.head)
            choice = outs["logits"][0, : len(tree)].argmax(-1)
            y = np.array([tree.tokens[i] == choice[tree.parents[i]] for i in range(1, len(tree))], np.float32)
            bb = set(backbone(tree))
            self.x.append(f[1:])
            self.y.append(y)
            self.bb.append(np.array([i in bb for i in range(1, len(tree))]))
        acc = accept(tree, lambda i: outs["logits"][0, i], sampler)
        m.commit_rows(outs, acc.path)  # a draft head reads the target's features of these rows
        return VerifyResult(acc, width, width, width)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3, iters: int = 25) -> tuple[np.ndarray, float]:
    xb = np.hstack([x, np.ones((len(x), 1))]).astype(np.float64)
    w = np.zeros(xb.shape[1])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-xb @ w))
        g = xb.T @ (p - y) + l2 * w
        h = (xb * (p * (1 - p))[:, None]).T @ xb + l2 * np.eye(len(w))
        w -= np.linalg.solve(h, g)
    return w[:-1], float(w[-1])


def metrics_at(p: np.ndarray, y: np.ndarray, bb: np.ndarray, thr: float) -> dict[str, float]:
    """Precision/recall of 'kept' vs 'is the target's choice', over all nodes (backbone always kept)."""
    kept = (p >= thr) | bb
    tp = float((kept & (y > 0)).sum())
    return {"precision": tp / max(float(kept.sum()), 1.0), "recall": tp / max(float((y > 0).sum()), 1.0),
            "pruned_fraction": 1.0 - float(kept.mean()), "nodes": int(len(y))}


def train_predictor(target: StepModel, draft: StepModel, prompts: list[str], seconds: float = 180.0,
                    max_new_tokens: int = 64, recall: float = 0.95, log: Callable[[str], None] = print,
                    **lever_options: Any) -> PredictorSpec:
    from toolchain.runtime.policies.lever import Lever, LeverConfig

    layer = split_layer(target)
    rec = RecordingVerifier(target, layer)
    cfg = LeverConfig(**{k: v for k, v in lever_options.items() if k in LeverConfig.__dataclass_fields__})
    policy = Lever(target, draft, cfg, verifier=rec)
    tok = target.tokenizer
    t0 = time.perf_counter()
    used = 0
    for text in prompts:
        if time.perf_counter() - t0 > seconds:
            break
        ids = tok(text).input_ids
        n = min(max_new_tokens, target.context - max(rec.widths) - len(ids) - 1)
        if n < 8:
            continue
        for _ in policy.generate(ids, n, Sampler()):
            pass
        used += 1
        log(f"prompt {used}: {sum(len(y) for y in rec.y)} nodes recorded, {time.perf_counter() - t0:.0f} s")
    if not rec.y:
        raise MobcError("no tree nodes recorded: give more prompts or a longer --minutes budget")
    x, y, bb = np.vstack(rec.x), np.concatenate(rec.y), np.concatenate(rec.bb)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    cut = int(0.8 * len(y))
    tr, te = order[:cut], order[cut:]
    w, b = fit_logistic(x[tr], y[tr])
    spec = PredictorSpec(layer, [float(v) for v in w], b, 0.5, draft=draft_fingerprint(draft))
    p = score(spec, x[te])
    best = 0.0
    for thr in np.unique(np.concatenate([[0.0], np.quantile(p, np.linspace(0, 1, 101))])):
        if metrics_at(p, y[te], bb[te], float(thr))["recall"] >= recall:
            best = max(best, float(thr))
    spec.threshold = best
    spec.metrics = {
        "layer": layer, "train_nodes": int(len(tr)), "test_nodes": int(len(te)), "prompts": used,
        "seconds": time.perf_counter() - t0, "positive_rate": float(y.mean()), "target_recall": recall,
        "test": metrics_at(p, y[te], bb[te], best),
        "backbone_only": metrics_at(np.zeros(len(te)), y[te], bb[te], 1.0),
        "features": list(FEATURES),
    }
    return spec
