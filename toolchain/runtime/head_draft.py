"""A compiled draft head (toolchain/compile/head.py) as a draft model the speculative policies drive.

It looks like a StepModel to a policy (reset, prefill, feed, forward, commit, truncate, room,
cache, calls/seconds), but each row also needs a feature: the target's residual before its final
norm at the previous position. The adapter listens to the target's commits and keeps those
features by slot; a row whose previous position the target has not committed yet (a draft of a
draft) takes the head's own `hidden` of that previous row instead.

Rows computed from the head's own features are redone once the target has committed their
positions: before the next call, the head's cache is rolled back to the first such row and those
tokens are fed again with the target's features, in the same call as the tokens fed next (EAGLE's
way of keeping the draft cache on the target's features).

Logits come out over the draft vocabulary; they are scattered into the target's vocabulary (every
other token at MASK_MIN), so a policy sees the same shape from any draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from toolchain.artifact.layout import MASK_MIN
from toolchain.artifact.manifest import Manifest
from toolchain.errors import ArtifactError
from toolchain.runtime.model import StepModel
from toolchain.runtime.tree_exec import DraftTree

FEATURES = "features"
HIDDEN = "hidden"


def is_head(folder: str | Path) -> bool:
    return Manifest.load(Path(folder)).model.draft_head is not None


class HeadDraft:
    def __init__(self, head: StepModel, target: StepModel):
        info = head.manifest.model.draft_head
        if info is None:
            raise ArtifactError(f"{head.folder} is not a draft head artifact (no model.draft_head in its manifest)")
        if info["target_vocab"] != target.vocab:
            raise ArtifactError(f"draft head {head.name} was trained for a vocabulary of {info['target_vocab']} "
                                f"tokens, target {target.name} has {target.vocab}; train a head for this target")
        self.head, self.target = head, target
        self.step_model = head  # what benches time and price
        self.name = head.name
        self.vocab = target.vocab
        self.eos_ids = target.eos_ids
        self.vocab_ids = np.load(head.folder / info["vocab_file"])
        c = head.manifest.model.hidden
        self.target_features = np.zeros((target.context, c), np.float32)
        self._own: dict[int, np.ndarray] = {}  # slot -> the head's hidden of the row in that slot
        self.tokens: list[int] = []  # token of each committed head slot
        self.guessed_from = 0  # first committed slot whose row used one of the head's own features
        self._pending: list[np.ndarray] = []
        self.heard = 0  # the target's length after the last commit the head heard of
        target.commit_listeners.append(self._on_target_commit)
        self._check_target()

    def _check_target(self) -> None:
        fam = self.target.decode_family
        outs = [o.name for st in self.target.sessions.chain(fam) for o in st.outputs]
        if HIDDEN not in outs:
            raise ArtifactError(
                f"target {self.target.name} does not expose the features a draft head reads (no `{HIDDEN}` "
                "output): compile it with split_lm_head (e.g. recipes/smollm2-135m.yaml) or, for the CPU form, "
                "expose_features (recipes/smollm2-135m-cpu.yaml), and run that artifact")

    # ---- features --------------------------------------------------------------------------
    def _on_target_commit(self, outs: dict[str, np.ndarray], rows: list[int], slot: int) -> None:
        self.target_features[slot : slot + len(rows)] = outs[HIDDEN][0, rows]
        self.heard = slot + len(rows)  # commits append at the target's length

    def _feature(self, slot: int, committed: int) -> np.ndarray | None:
        """The feature row `slot` reads: position slot-1's (zeros for slot 0); `committed` is the
        target's length, read once per call (ahasd's verifier commits concurrently)."""
        prev = slot - 1
        if prev < 0:
            return np.zeros(self.target_features.shape[1], np.float32)
        if prev < committed:
            if prev >= self.heard:  # a stale row of an earlier text: drafting on it fails silently
                raise RuntimeError(f"the target committed slot {prev} without telling its commit listeners; "
                                   "commit the target's rows through StepModel.commit or commit_rows")
            return self.target_features[prev]
        return self._own.get(prev)

    def _redo_guessed(self) -> list[int]:
        """Roll back to the first row that used one of the head's own features, where the target has
        committed since, and return the tokens rolled back, to feed again: `_run` gives each row the
        target's feature where it has one and starts a new call at the first row past the target's
        text (a draft running ahead, as in ahasd), so those rows still draft on the head's own."""
        top = min(self.head.length, self.target.length + 1)
        if self.guessed_from >= top:
            return []
        redo = self.tokens[self.guessed_from :]
        self.truncate(self.guessed_from)
        return redo

    # ---- calls ------------------------------------------------------------------------------
    def _run(self, tokens: Sequence[int]) -> np.ndarray:
        """Head calls over `tokens` at the next slots, committed; returns the logits [k, V'] of their rows.

        A row joins the call of the row before it only when its feature is the target's: a row that
        drafts on the previous row's own `hidden` needs that row run first, so it starts a new call."""
        out = []
        widest = max(self.head.widths.values())
        i = 0
        while i < len(tokens):
            base, committed = self.head.length, self.target.length
            rows = [self._feature(base, committed)]
            if rows[0] is None:
                raise RuntimeError(f"no feature for head slot {base}: its previous row never ran")
            while i + len(rows) < len(tokens) and len(rows) < widest and base + len(rows) - 1 < committed:
                rows.append(self.target_features[base + len(rows) - 1])
            chunk = list(tokens[i : i + len(rows)])
            fam = self.head.family_for(len(chunk))
            feats = self.head.extra_inputs(fam)[FEATURES]
            feats[...] = 0.0
            feats[0, : len(rows)] = rows
            logits = self.head.forward(chunk, family=fam)
            hidden = self.head._last[1][HIDDEN][0]
            self.head.commit(range(len(chunk)))
            for r in range(len(chunk)):
                self._own[base + r] = hidden[r].copy()
            self.tokens.extend(chunk)
            if base - 1 >= committed:  # only the first row can have read the head's own feature
                self.guessed_from = min(self.guessed_from, base)
            elif self.guessed_from >= base:
                self.guessed_from = base + len(chunk)
            out.append(logits)
            i += len(chunk)
        return np.concatenate(out)

    def _full(self, logits: np.ndarray) -> np.ndarray:
        full = np.full(self.vocab, MASK_MIN, np.float32)
        full[self.vocab_ids] = logits
        return full

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        self.reset(stats=False)
        return self._full(self._run(ids)[-1])

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        # the redone rows and the new tokens all read the target's features: one call, not two
        return self._full(self._run([*self._redo_guessed(), *tokens])[-1])

    def reset(self, stats: bool = True) -> None:
        self.head.reset(stats)
        self.tokens, self._own, self.guessed_from = [], {}, 0

    def truncate(self, length: int) -> None:
        self.head.truncate(length)
        del self.tokens[length:]
        self._own = {s: h for s, h in self._own.items() if s < length}
        self.guessed_from = min(self.guessed_from, length)

    def room(self, n: int) -> bool:
        return self.head.room(n)

    @property
    def cache(self):
        return self.head.cache

    @property
    def length(self) -> int:
        return self.head.length

    @property
    def calls(self):
        return self.head.calls

    @property
    def seconds(self):
        return self.head.seconds

    @property
    def widths(self) -> dict[str, int]:
        return self.head.widths

    @property
    def decode_family(self) -> str:
        return self.head.decode_family

    @property
    def manifest(self) -> Manifest:
        return self.head.manifest


class HeadDraftTree(DraftTree):
    """Lever's tree drafting with a head: a node's row reads its parent row's `hidden` as its feature
    (the root's parent rows are the committed text's), so a whole frontier still runs in one call."""

    def __init__(self, draft: HeadDraft):
        super().__init__(draft.head)
        self.draft = draft
        self.hidden: dict[int, np.ndarray] = {}  # scratch slot -> that row's hidden
        self.token_at: dict[int, int] = {}

    def start(self, todo: Sequence[int]) -> np.ndarray:
        logits = self.draft.feed(list(todo))
        self.root_slot = self.model.cache.length - 1
        self.slot = {0: self.root_slot}
        self.hidden, self.token_at = {}, {}
        return logits

    def _parent_hidden(self, slot: int) -> np.ndarray:
        return self.hidden[slot] if slot in self.hidden else self.draft._own[slot]

    def _expand(self, tree, nodes: list[int]) -> np.ndarray:
        m = self.model
        if any(tree.parents[x] not in self.slot for x in nodes):
            raise ValueError("a head expands nodes whose parents ran in an earlier call (it reads their hidden)")
        fam, feeds = self._tree_feeds(tree, nodes)
        feats = np.zeros(m.sessions.chain(fam)[0].input_shape(FEATURES)[0], np.float32)
        for r, x in enumerate(nodes):
            feats[0, r] = self._parent_hidden(self.slot[tree.parents[x]])
        feeds[FEATURES] = feats
        outs = self._call(fam, feeds)
        base = m.cache.length
        self._commit_rows(outs, nodes)
        for r, x in enumerate(nodes):
            self.hidden[base + r] = outs[HIDDEN][0, r].copy()
            self.token_at[base + r] = tree.tokens[x]
        return np.stack([self.draft._full(row) for row in outs["logits"][0, : len(nodes)]])

    def finish(self, path: Sequence[int]) -> int:
        src = [self.slot[x] for x in path[1:] if x in self.slot]
        kept = super().finish(path)
        d, lo = self.draft, self.root_slot + 1
        del d.tokens[lo:]
        d._own = {s: h for s, h in d._own.items() if s < lo}
        for j, s in enumerate(src[:kept]):  # moved to lo + j; computed from the head's own features
            d.tokens.append(self.token_at[s])
            d._own[lo + j] = self.hidden[s]
        if kept:
            d.guessed_from = min(d.guessed_from, lo)
        self.hidden, self.token_at = {}, {}
        return kept


def tree_drafter(draft) -> DraftTree:
    """Lever's drafter for a draft model: its own (a lookup wrapper's), a head's, or the plain StepModel one."""
    if hasattr(type(draft), "tree_drafter"):
        return draft.tree_drafter()
    return HeadDraftTree(draft) if isinstance(draft, HeadDraft) else DraftTree(draft)
