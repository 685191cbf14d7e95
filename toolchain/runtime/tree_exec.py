"""Running token trees through StepModels: the draft grows a tree, the target verifies one.

Draft side (`DraftTree`): tree nodes are run in batches (one call per batch, tree-ancestor
mask inside the batch). Their K/V rows are committed into the draft cache as scratch slots
after the root, and later batches see only their own ancestors among those slots (the cache
manager's mask lets every query see every committed slot, so the scratch columns are masked
back here). After verification the rows of the accepted path are moved down to their final
slots and everything else is dropped, so the draft never recomputes an accepted token it
already ran.

Target side (`TreeVerifier`): one call of a tree-width step graph over the whole tree. With
the lm_head split off (split_lm_head), the body stages return hidden states and logits are
computed only for the rows the acceptance walk visits, through the width-1 lm_head graph of
the decode family (`logits="path"`); `logits="full"` runs the tree family's own lm_head over
every row. Either way the cache commits only the accepted path's rows.

Calls are counted in the model's `calls`/`seconds` counters: whole families under their name
(what the bench's predictor prices), single stages as `stage:<graph name>`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from toolchain.artifact.layout import MASK_MIN
from toolchain.errors import ArtifactError
from toolchain.runtime.model import StepModel
from toolchain.runtime.tree import Acceptance, Tree, accept


def tree_widths(model: StepModel, prefill: bool = False) -> dict[int, str]:
    """Compiled verify widths -> family: tree-role graphs, else every step graph wider than 1. With
    `prefill`, prefill-role graphs too: a step graph takes its mask as an input, so a prefill graph
    verifies a tree like any other (a policy that prices its calls decides whether that pays)."""
    roles = {f: model.sessions.chain(f)[0].role for f in model.widths}
    fams = [f for f in model.widths if roles[f] == "tree"] or [f for f in model.widths if model.widths[f] > 1]
    if prefill:
        fams += [f for f in model.widths if roles[f] == "prefill" and f not in fams]
    fams.append(model.decode_family)  # width 1: a tree of the root alone is an AR step
    out: dict[int, str] = {}
    for f in fams:
        out.setdefault(model.widths[f], f)
    return dict(sorted(out.items()))


def run_stages(model: StepModel, stages: Sequence, feeds: dict[str, np.ndarray], key: str | None = None
               ) -> dict[str, np.ndarray]:
    """Runs some stages of a family like run_chain, counting the calls (as `key`, else per stage)."""
    env = dict(feeds)
    outs: dict[str, np.ndarray] = {}
    t = time.perf_counter()
    for st in stages:
        t0 = time.perf_counter()
        res = model.sessions.run_stage(st, {n: env[n] for n in st.input_names})
        if key is None:
            model.calls[f"stage:{st.name}"] += 1
            model.seconds[f"stage:{st.name}"] += time.perf_counter() - t0
        env.update(res)
        outs.update(res)
    if key is not None:
        model.calls[key] += 1
        model.seconds[key] += time.perf_counter() - t
    return outs


class DraftTree:
    def __init__(self, model: StepModel):
        self.model = model
        self.root_slot = -1
        self.slot: dict[int, int] = {}

    def start(self, todo: Sequence[int]) -> np.ndarray:
        """Feed the committed tokens the draft has not seen (ending with the root); root logits [V]."""
        m = self.model
        logits = m.feed(list(todo))  # chunked by the widest graph: todo grows while drafting is skipped
        self.root_slot = m.cache.length - 1
        self.slot = {0: self.root_slot}
        return np.asarray(logits, dtype=np.float32)

    def room(self, extra: int) -> bool:
        return self.model.cache.free(max(self.model.widths.values())) >= extra

    def expand(self, tree: Tree, nodes: list[int]) -> np.ndarray:
        """Run these nodes (their parents already ran); returns their logits [len(nodes), V].

        More nodes than the widest draft graph run as several calls, in order (a later call
        sees the earlier calls' rows like any scratch rows)."""
        widest = max(self.model.widths.values())
        return np.concatenate([self._expand(tree, nodes[i : i + widest]) for i in range(0, len(nodes), widest)])

    def _expand(self, tree: Tree, nodes: list[int]) -> np.ndarray:
        if any(tree.parents[x] not in self.slot and tree.parents[x] not in nodes for x in nodes):
            raise ValueError("expand: every node's parent must have run first (or run in the same call)")
        fam, feeds = self._tree_feeds(tree, nodes)
        outs = self._call(fam, feeds)
        self._commit_rows(outs, nodes)
        return np.asarray(outs["logits"][0, : len(nodes)], dtype=np.float32)

    def _call(self, fam: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One draft call, timed and counted like the model's own calls."""
        m = self.model
        t = time.perf_counter()
        outs = m.sessions.run_family(fam, feeds)
        m.seconds[fam] += time.perf_counter() - t
        m.calls[fam] += 1
        return outs

    def _commit_rows(self, outs: dict[str, np.ndarray], nodes: list[int]) -> None:
        """The call's rows become scratch slots of the draft cache, one per node."""
        base = self.model.cache.length
        self.model.cache.commit(outs, range(len(nodes)))
        for r, x in enumerate(nodes):
            self.slot[x] = base + r

    def _tree_feeds(self, tree: Tree, nodes: list[int]) -> tuple[str, dict[str, np.ndarray]]:
        """The family and inputs of one call over `nodes`: tree positions, each query seeing only its
        ancestors (in this call and in earlier calls' scratch slots)."""
        m = self.model
        fam = m.family_for(len(nodes))
        width = m.widths[fam]
        sub = tree.ancestor_mask()[np.ix_(nodes, nodes)]
        root_pos = self.root_slot
        depths = [root_pos + tree.depths[x] - m.cache.length for x in nodes]  # positions root+depth
        feeds = m.cache.step_inputs([tree.tokens[x] for x in nodes], width, sub, depths)
        lo, hi = self.root_slot + 1, m.cache.length
        if hi > lo:  # scratch slots: each query sees only its ancestors' rows
            seen = np.zeros((width, hi - lo), dtype=bool)
            for r, x in enumerate(nodes):
                a = tree.parents[x]
                while a > 0:
                    if a in self.slot:  # an ancestor in this same call is covered by allowed_new
                        seen[r, self.slot[a] - lo] = True
                    a = tree.parents[a]
            for name, mask in feeds.items():
                if name.startswith("attention_mask"):
                    mask[0, 0, :, lo:hi] = np.where(seen, 0.0, MASK_MIN)
        return fam, feeds

    def finish(self, path: Sequence[int]) -> int:
        """Keep the rows of the accepted path's nodes that ran (a prefix); returns how many."""
        src = []
        for x in path[1:]:
            if x not in self.slot:
                break
            src.append(self.slot[x])
        self.model.cache.move_slots(src, self.root_slot + 1)
        self.model.cache.truncate(self.root_slot + 1 + len(src))
        self.slot = {}
        return len(src)


@dataclass
class VerifyResult:
    acceptance: Acceptance
    width: int
    rows_total: int  # rows the verify call produced
    rows_logits: int  # rows whose logits were computed
    pruned_width: int | None = None
    info: dict = field(default_factory=dict)


class TreeVerifier:
    def __init__(self, model: StepModel, logits: str = "path", prefill: bool = False):
        if logits not in ("path", "full"):
            raise ValueError("logits must be 'path' or 'full'")
        self.model = model
        self.widths = tree_widths(model, prefill)
        self.logits = logits
        self.modes: dict[int, str] = {}  # per-width override of `logits` (policies decide by cost)
        head = [s for s in model.sessions.chain(model.decode_family) if s.role == "lm_head"]
        self.row_head = head[0] if head else None
        if logits == "path" and self.row_head is None:
            raise ArtifactError(
                f"{model.name}: logits on the accepted path need the lm_head split off; add "
                "split_lm_head to the recipe's passes and recompile"
            )

    def family(self, n: int) -> str:
        fits = [w for w in self.widths if w >= n]
        if not fits:
            raise ArtifactError(f"{self.model.name}: no verify graph takes {n} tree nodes (widths {list(self.widths)})")
        return self.widths[min(fits)]

    def body_and_head(self, family: str) -> tuple[list, object | None]:
        chain = self.model.sessions.chain(family)
        head = [s for s in chain if s.role == "lm_head"]
        return [s for s in chain if s.role != "lm_head"], (head[0] if head else None)

    def _row_fn(self, outs: dict[str, np.ndarray]) -> tuple[Callable[[int], np.ndarray], dict[int, np.ndarray]]:
        """row(i) over a call's outputs: logits as the call returned them, or the lm_head on one row."""
        if "logits" in outs:
            return (lambda i: outs["logits"][0, i]), {}
        m, head, hidden = self.model, self.row_head, outs["hidden"]
        done: dict[int, np.ndarray] = {}

        def row(i: int) -> np.ndarray:
            if i not in done:
                h = np.ascontiguousarray(hidden[:, i : i + 1])
                done[i] = run_stages(m, [head], {"hidden": h}, key=f"stage:{head.name}")["logits"][0, 0]
            return done[i]

        return row, done

    def verify(self, tree: Tree, sampler) -> VerifyResult:
        m = self.model
        fam = self.family(len(tree))
        width = m.widths[fam]
        body, head = self.body_and_head(fam)
        feeds = m.call_inputs(tree.tokens, width, tree.ancestor_mask(), tree.depths)
        if self.modes.get(width, self.logits) == "full" or head is None:
            outs = run_stages(m, body + ([head] if head else []), feeds, key=fam)  # = one family call
        else:
            outs = run_stages(m, body, feeds, key=f"body:{fam}")
        row, done = self._row_fn(outs)
        acc = accept(tree, row, sampler)
        m.commit_rows(outs, acc.path)
        return VerifyResult(acc, width, width, len(done) if "logits" not in outs else width)
