"""Lever's gain/cost token-tree construction (pure: no models, so it is tested on synthetic drafts).

Objective of one cycle (draft a tree, verify it once):

    rate = E[tokens emitted] / cycle latency = (1 + sum of node gains) / (D + V(W))

A node's gain is its estimated probability that the whole path root..node is accepted: the
product of the draft's confidences along the path, each mapped through a `Calibrator` that
learns the observed acceptance per confidence bin. D is the draft time spent growing the tree,
V(W) the latency of the narrowest compiled verify width W >= nodes (a step function: fixed
shapes). Construction alternates two steps:

- select: given the nodes proposed so far, the best tree is the top-(W-1) nodes by gain for
  the width W maximizing the rate (gains shrink along paths, so the top-k is closed under
  parents; see `select`, which is exact and tested against brute force);
- expand: choose a batch of unexpanded nodes to run through the draft in one call (a
  width-b draft graph costs the same for any b up to its width: batch-aware drafting), with
  their children estimated from the calibrated mean confidence of the j-th best child. The
  batch that maximizes the estimated rate is run only if that beats the current rate;
  otherwise construction stops. Beating the current rate is the same as the batch's marginal
  gain rate dG/dT exceeding the tree's average rate (1+G)/T: the adaptive stop rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from toolchain.runtime.tree import Tree

# expand(tree, nodes) -> per node: (candidate tokens, their draft probabilities), best first, and
# optionally a third item: a chain to hang under one of the candidates (a lookup run, see lookup.Run)
ExpandFn = Callable[[Tree, list[int]], list[tuple]]


@dataclass
class StepCost:
    """Latency of one call by compiled width; a call of n <= width items costs the width's latency."""

    by_width: dict[int, float]

    def width_for(self, n: int) -> int | None:
        fits = [w for w in self.by_width if w >= n]
        return min(fits) if fits else None

    def __call__(self, n: int) -> float:
        w = self.width_for(n)
        if w is None:  # wider than every graph: several calls of the widest
            widest = max(self.by_width)
            return -(-n // widest) * self.by_width[widest]
        return self.by_width[w]


class Calibrator:
    """Observed acceptance per (sibling rank, draft-confidence bin), with a prior at the bin's confidence.

    Rank matters as much as confidence: a small or flat draft gives its best child a low
    probability that is nonetheless usually right. The calibrator also tracks the mean
    calibrated confidence of the j-th best child of an expanded node, which is how
    construction estimates the gain of expanding a node before running the draft.
    """

    def __init__(self, bins: int = 10, prior: float = 2.0, top_k: int = 4):
        self.edges = np.linspace(0.0, 1.0, bins + 1)
        self.centers = (self.edges[:-1] + self.edges[1:]) / 2
        self.prior = prior
        self.offered = np.zeros((top_k, bins))
        self.accepted = np.zeros((top_k, bins))
        self.child_mean = np.array([0.5 / (j + 1) for j in range(top_k)])  # before any data
        self.identity = False  # tests: gains are the raw draft probabilities

    def _bin(self, p: float, rank: int) -> tuple[int, int]:
        b = int(min(len(self.centers) - 1, max(0, np.searchsorted(self.edges, p, side="right") - 1)))
        return min(rank, len(self.offered) - 1), b

    def __call__(self, p: float, rank: int = 0) -> float:
        if self.identity:
            return p
        r, b = self._bin(p, rank)
        return float((self.accepted[r, b] + self.prior * self.centers[b]) / (self.offered[r, b] + self.prior))

    def update(self, p: float, rank: int, accepted: bool) -> None:
        r, b = self._bin(p, rank)
        self.offered[r, b] += 1
        self.accepted[r, b] += float(accepted)

    def observe_children(self, probs: Sequence[float], decay: float = 0.05) -> None:
        for j, p in enumerate(list(probs)[: len(self.child_mean)]):
            self.child_mean[j] += decay * (self(p, j) - self.child_mean[j])


@dataclass
class Selection:
    width: int
    nodes: list[int]  # chosen node indices, root first, topological
    gain: float  # expected accepted drafts (sum of gains)
    seconds: float  # D + V(W)

    @property
    def expected_tokens(self) -> float:
        return 1.0 + self.gain

    @property
    def rate(self) -> float:
        return self.expected_tokens / self.seconds if self.seconds > 0 else float("inf")


def _order(gains: Sequence[float], depths: Sequence[int]) -> list[int]:
    """Non-root nodes by gain, parents before children on ties (so every prefix is closed)."""
    g, d = np.asarray(gains[1:], np.float64), np.asarray(depths[1:])
    return (np.lexsort((np.arange(len(g)), d, -g)) + 1).tolist()


def _best_size(gains_desc: np.ndarray, verify: StepCost, draft_seconds: float) -> tuple[Selection, int]:
    """The rate-maximizing width for non-root gains sorted best first, and how many of them (k) it
    verifies beside the root: a Selection without its nodes (a plan's estimates need only the rate;
    select() names the nodes)."""
    csum = np.concatenate([[0.0], np.cumsum(gains_desc)])
    best: tuple[Selection, int] | None = None
    for w in sorted(verify.by_width):
        k = min(w - 1, len(gains_desc))
        cand = Selection(w, [], float(csum[k]), draft_seconds + verify.by_width[w])
        if best is None or cand.rate > best[0].rate * (1 + 1e-12):
            best = cand, k
        if k == len(gains_desc):
            break  # wider graphs only cost more
    assert best is not None, "no verify width"
    return best


def select(gains: Sequence[float], depths: Sequence[int], verify: StepCost, draft_seconds: float,
           order: list[int] | None = None) -> Selection:
    """The rate-maximizing tree among the proposed nodes, and its width."""
    order = _order(gains, depths) if order is None else order
    sel, k = _best_size(np.asarray([gains[i] for i in order], np.float64), verify, draft_seconds)
    sel.nodes = [0, *sorted(order[:k])]
    return sel


@dataclass
class BuildResult:
    pool: Tree  # every node proposed
    selection: Selection
    tree: Tree  # the selected nodes, re-indexed (what the target verifies)
    index: list[int]  # pool index of each tree node
    draft_calls: list[int] = field(default_factory=list)  # nodes evaluated per draft call
    draft_seconds: float = 0.0
    trace: list[dict] = field(default_factory=list)  # per decision: current and estimated rates


class TreeBuilder:
    def __init__(self, verify: StepCost, draft: StepCost, top_k: int = 4, max_depth: int = 8,
                 calibrator: Calibrator | None = None, batch: bool = True, max_nodes: int = 256,
                 max_rows: int | None = None, near_root: Sequence[int] = ()):
        self.verify = verify
        self.draft = draft
        self.top_k = top_k
        # children proposed by a node at depth d < len(near_root) (top_k deeper): a cycle's root follows
        # a rejection, where the draft's first choice is right least often, so more of its candidates pay
        # (their ranks past top_k share the calibrator's last rank bin)
        self.near_root = tuple(near_root)
        self.max_depth = max_depth
        self.calib = calibrator or Calibrator(top_k=top_k)
        self.batch = batch
        self.max_nodes = max_nodes  # proposed nodes (the pool select() ranks)
        # draft rows: each expanded node is one row of the draft's cache, so its free room bounds the
        # expansions, not the pool (a node proposed but never expanded takes no row). Capping the pool
        # by the room instead stopped phone-priced trees at depth 3-4: 16 nodes per call, 4 children each
        self.max_rows = max_rows
        self.explore_every = 8
        self.cycles = 0

    def _batch_sizes(self, n: int) -> list[int]:
        if not self.batch:
            return [1] if n else []
        # within a draft width the cost is flat and phantom gains only add: try each width's top
        return sorted({min(w, n) for w in self.draft.by_width} | {n} if n else set())

    def plan(self, pool: Tree, expanded: set[int], d_seconds: float) -> tuple[list[int], dict]:
        """The batch to expand next ([] to stop) and a trace record. Rates only need the gains best first,
        so each candidate batch is priced on sorted arrays (numpy), not by ranking the pool's nodes
        (that ranking, a Python sort per candidate, was ~15% of a phone-priced lever cycle on this CPU)."""
        gains, depths = np.asarray(pool.gains, np.float64), np.asarray(pool.depths)
        own = np.sort(gains[1:])[::-1]
        cur, _ = _best_size(own, self.verify, d_seconds)
        record = {"nodes": len(pool), "rate": cur.rate, "expected_tokens": cur.expected_tokens}
        rows_left = len(pool) if self.max_rows is None else self.max_rows - len(expanded)
        if len(pool) >= self.max_nodes or rows_left <= 0:
            return [], record
        ran = np.zeros(len(pool), bool)
        ran[list(expanded)] = True
        open_ = (depths < self.max_depth) & ~ran
        open_[1:] &= ran[np.asarray(pool.parents[1:], np.intp)]  # a head reads its parent row (hung runs)
        elig = [0] if open_[0] else []  # the root first, then by gain (parents before children on ties)
        rest = np.flatnonzero(open_[1:]) + 1
        elig += rest[np.lexsort((rest, depths[rest], -gains[rest]))].tolist()
        means = np.asarray(self.calib.child_mean[: self.top_k], np.float64)
        best_b, best = 0, cur
        for b in self._batch_sizes(min(len(elig), rows_left)):
            phantom = np.outer(gains[elig[:b]], means).ravel()  # children estimated before the draft runs
            est, _ = _best_size(np.sort(np.concatenate([own, phantom]))[::-1], self.verify, d_seconds + self.draft(b))
            if est.rate > best.rate * (1 + 1e-9):
                best_b, best = b, est
        if best_b:
            dg, dt = best.gain - cur.gain, best.seconds - cur.seconds
            record.update(batch=best_b, est_rate=best.rate, marginal_rate=dg / dt if dt > 0 else float("inf"))
        return elig[:best_b], record

    def build(self, root_token: int, expand: ExpandFn) -> BuildResult:
        pool = Tree.root(root_token)
        kids: dict[tuple[int, int], int] = {}  # (parent, token) -> node: a token is a node's child once
        expanded: set[int] = set()
        d_seconds = 0.0
        calls: list[int] = []
        trace: list[dict] = []
        while True:
            batch, record = self.plan(pool, expanded, d_seconds)
            trace.append(record)
            if not expanded:
                # not even the root pays (e.g. the target is DRAM-resident and the draft is weak): verify
                # the root alone, an AR step; every `explore_every` cycles draft anyway, so calibration
                # keeps learning whether drafting pays again
                self.cycles += 1
                if not batch and self.cycles % self.explore_every == 0:
                    batch = [0]
            if not batch:
                break
            results = expand(pool, batch)
            d_seconds += self.draft(len(batch))
            calls.append(len(batch))
            bar = self._admission_bar(pool)
            for node, (toks, probs, *run) in zip(batch, results, strict=True):
                expanded.add(node)
                k = self.children(pool.depths[node])
                if len(toks) > k:  # candidates beyond a node's children are shadows, never tree nodes
                    pool.shadows[node] = [int(t) for t in list(toks)[k:]]
                self.calib.observe_children(list(probs)[: self.top_k])
                for rank, (tok, p) in enumerate(list(zip(toks, probs, strict=True))[:k]):
                    gain = pool.gains[node] * self.calib(float(p), rank)
                    if gain > bar and (node, int(tok)) not in kids:  # a hung run may hold it already
                        kids[node, int(tok)] = pool.add(node, int(tok), float(p), gain)
                if run and run[0] is not None:
                    self._hang(pool, kids, node, run[0], bar)
        sel = select(pool.gains, pool.depths, self.verify, d_seconds)
        tree, index = pool.subtree(sel.nodes)
        return BuildResult(pool, sel, tree, index, calls, d_seconds, trace)

    def _hang(self, pool: Tree, kids: dict[tuple[int, int], int], node: int, run, bar: float) -> None:
        """Hang a lookup run under `node`'s child `run.token`: a chain of nodes no draft call proposed
        (each gains the calibrated run confidence over its parent), until one would not be admitted."""
        c = kids.get((node, run.token))
        if c is None:
            return
        q = self.calib(run.p, 0)
        for tok in run.after:
            if pool.depths[c] >= self.max_depth:
                return
            nxt = kids.get((c, tok))
            if nxt is None:
                gain = pool.gains[c] * q
                if gain <= bar:
                    return
                nxt = kids[c, tok] = pool.add(c, tok, run.p, gain)
            c = nxt

    def children(self, depth: int) -> int:
        """How many candidates a node at `depth` proposes as children."""
        return self.near_root[depth] if depth < len(self.near_root) else self.top_k

    @property
    def most_children(self) -> int:
        return max((self.top_k, *self.near_root))

    def _admission_bar(self, pool: Tree) -> float:
        """The gain a new node must beat to be worth keeping: once the pool holds as many nodes as the
        widest verify graph has rows beside the root, a node below the smallest of the best of them
        can never be selected (the pool only grows, and a node's descendants gain less than it), so
        it is not added; wide near-root nodes would otherwise fill the pool with hopeless tails."""
        rows = max(self.verify.by_width) - 1
        gains = np.asarray(pool.gains[1:], np.float64)
        if len(gains) < rows:
            return 0.0
        return float(np.partition(gains, len(gains) - rows)[len(gains) - rows])

    def learn(self, pool: Tree, path: Sequence[int], next_token: int) -> None:
        """Calibrate on one verification: the target's choice at every accepted node is known
        (the next path token, or the correction), so every proposed child of it is a trial,
        whether or not it was selected for verification."""
        for i, u in enumerate(path):
            choice = pool.tokens[path[i + 1]] if i + 1 < len(path) else next_token
            kids = sorted(pool.children(u), key=lambda c: -pool.probs[c])
            for rank, c in enumerate(kids):
                self.calib.update(pool.probs[c], rank, pool.tokens[c] == choice)


def top_candidates(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most probable tokens of a distribution, best first."""
    k = min(k, probs.shape[-1])
    idx = np.argpartition(-probs, k - 1)[:k]
    idx = idx[np.argsort(-probs[idx], kind="stable")]
    return idx, probs[idx]


def top_softmax(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of logits [n, V]: the k most probable tokens best first [n, k] and their softmax
    probabilities [n, k] (float64), without forming the distributions: a row's top k by its logits,
    the partition function from one exponential pass. The same values as top_candidates(softmax(row), k)
    to float rounding, over all rows at once (one row at a time, a softmax and a top-k cost ~0.8 ms per
    49k-token row here)."""
    x = np.asarray(logits, np.float32)
    k = min(k, x.shape[-1])
    top = np.max(x, axis=-1, keepdims=True)
    total = np.exp(x - top).sum(axis=-1, dtype=np.float64)
    idx = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(x, idx, -1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    idx, vals = np.take_along_axis(idx, order, -1), np.take_along_axis(vals, order, -1)
    probs = np.exp(vals - top).astype(np.float64) / total[:, None]  # float32 exponentials, as softmax()
    return idx, probs
