"""Token trees for tree speculative decoding: structure, masks, positions and acceptance.

Node 0 is the root: the newest committed token the target has not run yet (`pending`).
Every other node is a draft token whose parent is an earlier node, so node order is a
topological order and a verify call can feed the nodes as they are. One verify call of a
width-N step graph scores every node at once: node i attends to the committed text and to
its ancestors (itself included), at position `committed + depth(i)`; its output row is the
target's prediction of the token after the path root..i.

Acceptance walks down from the root. Greedy (temperature 0): at node u the target's choice is
argmax(row u); if a child of u carries it, accept that child and continue, else emit it as the
correction and stop, so the emitted text is exactly what greedy AR would produce. Sampling
(temperature > 0): the children of u are a deterministic candidate list (top-k of the draft),
so each candidate is tested as a point-mass proposal: accept x with probability r(x), where r
starts as the target's p(.|u) and, after a rejection of x, becomes r with x removed and
renormalized. The token finally emitted at u (an accepted child or a sample of the last
residual) is distributed exactly as p(.|u): the multi-candidate rule of SpecInfer/Sequoia
specialised to candidates that were not sampled. `row` callbacks let the caller compute a
row's logits only when the walk reaches it (logits on the accepted path only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from toolchain.runtime.policies.sampling import Sampler


@dataclass
class Tree:
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    probs: list[float] = field(default_factory=lambda: [1.0])  # draft p(token | parent)
    gains: list[float] = field(default_factory=lambda: [1.0])  # estimated P(path root..i accepted)
    depths: list[int] = field(default_factory=lambda: [0])
    # node -> draft tokens proposed there but not in the tree (predictor pruning normalizes over them)
    shadows: dict[int, list[int]] = field(default_factory=dict)

    @classmethod
    def root(cls, token: int) -> Tree:
        return cls([int(token)])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, prob: float, gain: float) -> int:
        if not 0 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not a node of a {len(self)}-node tree")
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.probs.append(float(prob))
        self.gains.append(float(gain))
        self.depths.append(self.depths[parent] + 1)
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def child_with(self, node: int, token: int) -> int | None:
        for i, p in enumerate(self.parents):
            if p == node and self.tokens[i] == token:
                return i
        return None

    def path(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestor_mask(self) -> np.ndarray:
        """[n,n] bool: row i may attend column j iff j is i or an ancestor of i."""
        n = len(self)
        m = np.zeros((n, n), dtype=bool)
        for i in range(n):
            p = self.parents[i]
            if p >= 0:
                m[i] = m[p]  # parents come first, so row p is complete
            m[i, i] = True
        return m

    def subtree(self, keep: Sequence[int]) -> tuple[Tree, list[int]]:
        """The tree restricted to `keep` (must be closed under parents and contain the root);
        returns it and the old index of each new node."""
        order = sorted(set(keep))
        if not order or order[0] != 0:
            raise ValueError("a subtree must keep the root")
        new_of = {old: new for new, old in enumerate(order)}
        t = Tree.root(self.tokens[0])
        for old in order[1:]:
            p = self.parents[old]
            if p not in new_of:
                raise ValueError(f"node {old} is kept but its parent {p} is not")
            t.add(new_of[p], self.tokens[old], self.probs[old], self.gains[old])
        for old in order:  # dropped children become shadow candidates of their parent
            dropped = [self.tokens[c] for c in self.children(old) if c not in new_of]
            if dropped or old in self.shadows:
                t.shadows[new_of[old]] = [*dropped, *self.shadows.get(old, [])]
        return t, order


RowFn = Callable[[int], np.ndarray]  # node index -> the target's logits row for that node [V]


@dataclass
class Acceptance:
    path: list[int]  # accepted nodes, root first (the root is always "accepted": it is committed text)
    next_token: int  # the target's correction or bonus token after the path
    rows_computed: int  # logits rows the walk needed (path-only logits: len(path))

    @property
    def accepted(self) -> int:
        """Draft tokens accepted (the root is not a draft)."""
        return len(self.path) - 1


def accept_greedy(tree: Tree, row: RowFn) -> Acceptance:
    """Longest path whose every token equals the target's argmax at its parent."""
    node, path = 0, [0]
    while True:
        best = int(np.argmax(row(node)))
        child = tree.child_with(node, best)
        if child is None:
            return Acceptance(path, best, len(path))
        path.append(child)
        node = child


def accept_sampled(tree: Tree, row: RowFn, sampler: Sampler) -> Acceptance:
    """Multi-candidate acceptance for temperature > 0 (lossless, see the module docstring)."""
    node, path = 0, [0]
    while True:
        residual = sampler.probs(row(node))
        chosen = None
        for child in sorted(tree.children(node), key=lambda c: -tree.probs[c]):
            x = tree.tokens[child]
            mass = residual[x]
            if mass > 0 and sampler.rng.random() < mass:
                chosen = child
                break
            residual = residual.copy()
            residual[x] = 0.0
            total = residual.sum()
            if total <= 0:  # every token with mass was a rejected candidate: measure zero
                break
            residual /= total
        if chosen is None:
            if residual.sum() <= 0:  # rounding only: fall back to the target's own distribution
                residual = sampler.probs(row(node))
            return Acceptance(path, sampler.sample(residual / residual.sum()), len(path))
        path.append(chosen)
        node = chosen


def accept(tree: Tree, row: RowFn, sampler: Sampler) -> Acceptance:
    return accept_greedy(tree, row) if sampler.greedy else accept_sampled(tree, row, sampler)
