"""lever: gain/cost token trees, verified in one fixed-width target call, lossless.

A cycle: the draft runs the tokens it has not seen (ending with the root, the target's newest
unverified token); TreeBuilder grows a token tree by gain/cost with batched draft calls and
stops adaptively (toolchain/runtime/lever_tree.py); the target verifies the tree with one call
of the chosen compiled width (toolchain/runtime/tree_exec.py), logits only on the accepted
path when the lm_head is split off and that is cheaper; the builder's calibrator learns from
the outcome; the draft keeps the rows of the accepted tokens it already ran.

Costs come from `prices`: the phone cost model by default (the decisions a phone would make;
the CPU then runs them) or this CPU's measured call times (`cost="cpu"`).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from toolchain.cost.prices import CpuPrices, PhonePrices, Prices
from toolchain.errors import MobcError
from toolchain.runtime.head_draft import tree_drafter
from toolchain.runtime.lever_tree import Calibrator, StepCost, TreeBuilder, top_candidates, top_softmax
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.base import Policy, RunStats
from toolchain.runtime.policies.sampling import Sampler
from toolchain.runtime.tree_exec import DraftTree, TreeVerifier

if TYPE_CHECKING:
    from toolchain.runtime.predictor import PruneCounts


@dataclass
class LeverConfig:
    # Children proposed per expanded node, depth and pool bounds. With the phone's prices (a verify
    # reads the target from flash, a draft-head call ~1% of it) the rate-optimal tree is deep and its
    # root wide: on the 44 bench prompts (lever+lookup, shipped head) top_k 4 / depth 8 / pool 128
    # gave 3.05 tokens per cycle, top_k 8 / depth 32 / pool 768 3.33, and with the prefill graph as a
    # verify width too a pool of 2048 3.54 (without it, the larger pool changed nothing). CPU prices
    # stop the tree early, so lever+cpu keeps its small trees (2.12 -> 2.24 there).
    top_k: int = 8
    max_depth: int = 32
    batch: bool = True  # several frontier nodes per draft call
    logits: str = "auto"  # path | full | auto (path when the cost model says it is cheaper)
    cost: str = "phone"  # phone | cpu
    device: str = "snapdragon-8-gen-3"
    target_dram: float = 0.0
    draft_dram: float = 1.0
    max_nodes: int = 2048  # proposed nodes; the draft's free cache rows bound the expanded ones
    # children proposed at depths 0, 1 (top_k deeper): a cycle's root follows a rejection, where the
    # head's first choice is right least often (29-44% there against ~40-50% over all positions).
    # On 24 prompts outside the bench set (HumanEval 20-31, 12 chat requests) it cut lever+lookup's
    # cycles by 3.0% and lever+cpu+lookup's by 4.6%; on 6 bench prompts (64,), (32,), (16,) did less.
    # The 44 bench prompts: lever+lookup 3.54 -> 3.82 tokens per cycle, phone 3.25x -> 3.47x Flash-AR
    near_root: tuple[int, ...] = (32, 16)
    shadows: int = 4  # extra draft candidates per expanded node, for predictor normalization


@dataclass
class LeverStats(RunStats):
    widths: Counter[int] = field(default_factory=Counter)  # verify width chosen per cycle
    tree_nodes: list[int] = field(default_factory=list)
    expected_tokens: list[float] = field(default_factory=list)  # builder's estimate per cycle
    draft_calls_per_cycle: list[int] = field(default_factory=list)
    logits_rows: int = 0  # lm_head rows computed
    logits_rows_full: int = 0  # rows a full lm_head would have computed
    pruned: list[tuple[int, int]] = field(default_factory=list)  # (nodes before, after) per cycle
    curves: list[np.ndarray] = field(default_factory=list)  # per cycle: 1 + cumsum of sorted pool gains
    prune: PruneCounts | None = None  # with a pruning verifier: what it pruned in this run
    prune_key: str | None = None  # the price key of the pruned layers past the cut (widest tree graph)


class Lever(Policy):
    name = "lever"
    stats_type = LeverStats
    stats: LeverStats

    def __init__(self, target: StepModel, draft: StepModel | None = None, config: LeverConfig | None = None,
                 prices: tuple[Prices, Prices] | None = None, verifier: TreeVerifier | None = None):
        if draft is None:
            raise MobcError("policy lever needs a draft model: pass --draft <artifact folder>")
        if draft.vocab != target.vocab:
            raise MobcError(f"draft {draft.name} and target {target.name} have different vocabularies")
        super().__init__(target, draft)
        self.config = cfg = config or LeverConfig()
        if prices is None:
            d_model = getattr(draft, "step_model", draft)  # a draft head's adapter wraps its StepModel
            prices = ((PhonePrices(target, cfg.device, cfg.target_dram), PhonePrices(d_model, cfg.device, cfg.draft_dram))
                      if cfg.cost == "phone" else (CpuPrices(target), CpuPrices(d_model)))
        self.t_prices, self.d_prices = prices
        logits = "path" if cfg.logits == "auto" else cfg.logits
        # the phone prices a verify by its flash reads, nearly flat in rows, so a prefill-wide tree may pay
        # there; on a CPU a call's cost grows with its rows (32 rows ~3.8x a decode step) and timing a
        # 128-row call at start-up costs seconds, so CPU prices keep to the tree graphs
        wide = verifier is None and cfg.cost == "phone"
        self.verifier = verifier or TreeVerifier(target, logits=logits if self._can_split() else "full", prefill=wide)
        if isinstance(self.t_prices, CpuPrices):  # every price a decision compares, timed side by side
            self.t_prices.measure(self._verify_keys())
        if isinstance(self.d_prices, CpuPrices):
            self.d_prices.measure(list(draft.widths))
        self.mean_emitted = 2.0  # running mean of tokens per cycle (prices path-only logits)
        self.verify_costs = self._verify_costs()
        self.builder = TreeBuilder(self.verify_costs, self._draft_costs(), cfg.top_k, cfg.max_depth,
                                   Calibrator(top_k=cfg.top_k), cfg.batch, cfg.max_nodes, near_root=cfg.near_root)

    def _can_split(self) -> bool:
        return any(s.role == "lm_head" for s in self.target.sessions.chain(self.target.decode_family))

    def _path_keys(self, fam: str) -> tuple[str, str] | None:
        """The price keys of a path-only verify of `fam` (its body, the row head), or None when its
        lm_head is not a stage of its own."""
        v = self.verifier
        if v.body_and_head(fam)[1] is None or v.row_head is None:
            return None
        return f"body:{fam}", f"stage:{v.row_head.name}"

    def _verify_keys(self) -> list[str]:
        """The price keys `_verify_costs` reads: each verify family, and its path keys when split."""
        return [k for fam in self.verifier.widths.values() for k in (fam, *(self._path_keys(fam) or ()))]

    def _verify_costs(self) -> StepCost:
        """V(W) per compiled width; with path-only logits, the body plus the expected head rows."""
        out = {}
        v = self.verifier
        for w, fam in v.widths.items():
            full = self.t_prices.seconds(fam)
            keys = self._path_keys(fam)
            if keys is None:
                out[w] = full
                continue
            path = self.t_prices.seconds(keys[0]) + self.mean_emitted * self.t_prices.seconds(keys[1])
            if self.config.logits == "auto":
                v.modes[w] = "path" if path < full else "full"
            out[w] = path if v.modes.get(w, v.logits) == "path" else full
        return StepCost(out)

    def _draft_costs(self) -> StepCost:
        return StepCost({self.draft.widths[f]: self.d_prices.seconds(f) for f in self.draft.widths})

    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampler: Sampler) -> Iterator[list[int]]:
        assert self.draft is not None
        draft, target = self.draft, self.target
        self._start(prompt)
        counts_before = copy.copy(getattr(self.verifier, "counts", None))
        self.builder.cycles = 0  # exploration schedule per generation (calibration carries over)
        pending = self._prefill(prompt, sampler)
        n = 1
        drafter = tree_drafter(draft)
        try:
            yield [pending]
            if pending in target.eos_ids:
                return
            todo = [pending]
            while n < max_new_tokens:
                # scratch rows of the draft tree must fit its cache: cap the expansions to the room left
                room = draft.cache.free(max(draft.widths.values())) - len(todo)
                self.builder.max_rows = room
                # near the end of the context only the narrower verify graphs fit: the tree is priced on those
                fitting = {w: c for w, c in self.verify_costs.by_width.items() if target.cache.free(w) >= 0}
                self.builder.verify = StepCost(fitting)
                if not (len(fitting) > 1 and room > self.config.top_k):
                    nxt = yield from self._ar_step(pending, n, sampler)  # out of context: finish like ar
                    if nxt is None:
                        return
                    pending, n = nxt, n + 1
                    todo.append(pending)
                    continue
                started: list[bool] = []
                res = self.builder.build(pending, self._expander(drafter, todo, started, sampler))
                vr = self.verifier.verify(res.tree, sampler)
                acc = vr.acceptance
                pool_path = [res.index[i] for i in acc.path]
                self.builder.learn(res.pool, pool_path, acc.next_token)
                if not started:  # no draft call this cycle: the draft still has todo (+ this token) to see
                    todo = [*todo, acc.next_token]
                    self._record(res, vr, 1)
                    n += 1
                    self.stats.tokens = n
                    pending = acc.next_token
                    yield [acc.next_token]
                    if acc.next_token in target.eos_ids:
                        return
                    continue
                kept = drafter.finish(pool_path)
                toks = [res.tree.tokens[i] for i in acc.path[1:]]
                todo = [*toks[kept:], acc.next_token]
                self._record(res, vr, len(toks) + 1)
                new, stop = self._clip([*toks, acc.next_token], max_new_tokens - n)
                n += len(new)
                self.stats.tokens = n
                pending = acc.next_token
                yield new
                if stop:
                    return
        finally:
            self._finish()
            if counts_before is not None:
                self.stats.prune = self.verifier.counts - counts_before
                fam, cut = max(self.verifier.cut.items(), key=lambda kv: target.widths[kv[0]])
                self.stats.prune_key = f"tail:{fam}:{cut}"

    def _expander(self, drafter: DraftTree, todo: list[int], started: list[bool], sampler: Sampler):
        k = self.builder.most_children + self.config.shadows

        def expand(pool, nodes: list[int]):
            rows = {}
            if 0 in nodes:  # the root's draft call also feeds the committed tokens the draft has not seen
                rows[0] = drafter.start(todo)
                started.append(True)
            rest = [x for x in nodes if x != 0]
            if rest:
                rows.update(zip(rest, drafter.expand(pool, rest), strict=True))
            logits = np.stack([rows[x] for x in nodes])
            if sampler.greedy:  # the draft's own softmax is its confidence: only its top k are needed
                cands = list(zip(*top_softmax(logits, k), strict=True))
            else:
                cands = [top_candidates(sampler.probs(row), k) for row in logits]  # the tempered draft q
            runs = getattr(drafter, "runs", {})  # a lookup drafter's runs: chains to hang under a child
            return [(*c, runs.get(x)) for c, x in zip(cands, nodes, strict=True)]

        return expand

    def _record(self, res, vr, emitted: int) -> None:
        self.stats.accepted.append(vr.acceptance.accepted)
        lv = self.stats
        lv.widths[vr.width] += 1
        lv.tree_nodes.append(len(res.tree))
        lv.expected_tokens.append(res.selection.expected_tokens)
        lv.draft_calls_per_cycle.append(len(res.draft_calls))
        lv.logits_rows += vr.rows_logits
        lv.logits_rows_full += vr.rows_total
        if vr.pruned_width is not None:
            lv.pruned.append((len(res.tree), vr.info.get("kept", len(res.tree))))
        self.mean_emitted += 0.1 * (emitted - self.mean_emitted)
        gains = np.sort(np.asarray(res.pool.gains[1:], dtype=np.float64))[::-1][:63]
        lv.curves.append(1.0 + np.concatenate([[0.0], np.cumsum(gains)]))  # index n-1: n-node tree


VARIANTS = {
    "": {},
    "path": {"logits": "path"},  # force logits on the accepted path only
    "full": {"logits": "full"},  # force one lm_head call over every tree row
    "nobatch": {"batch": False},  # one frontier node per draft call
    "cpu": {"cost": "cpu"},  # decide with this machine's measured call times instead of the phone's
}


def make(target: StepModel, draft: StepModel | None, gamma: int = 4, variant: str = "", **options) -> Policy:
    """make_policy entry: `lever`, `lever+path`, `lever+full`, `lever+nobatch`, `lever+prune[+...]`.

    options: LeverConfig fields (device, target_dram, draft_dram, cost, top_k, ...) and
    `predictor` (a file written by `mobc train predictor`, for +prune).
    """
    fields = {f for f in LeverConfig.__dataclass_fields__}
    cfg = {k: v for k, v in options.items() if k in fields and v is not None}
    prune = False
    for part in filter(None, variant.split("+")):
        if part == "prune":
            prune = True
        elif part in VARIANTS:
            cfg.update(VARIANTS[part])
        else:
            raise MobcError(f"unknown lever variant {part!r}; use one of prune, {', '.join(v for v in VARIANTS if v)}")
    if prune:  # the shipped predictors were fit on trees of top_k children per node: keep their shape
        cfg.setdefault("near_root", ())
    config = LeverConfig(**cfg)
    if not prune:
        return Lever(target, draft, config)
    from toolchain.runtime.predictor import PrunedVerifier, check_draft, load_predictor

    path = options.get("predictor") or target.folder / "predictor.json"  # where `mobc train predictor` writes
    if not Path(path).is_file():
        raise MobcError(f"lever+prune needs a predictor ({path} does not exist): run `mobc train predictor "
                        f"{target.folder} --draft <draft folder>`")
    spec = load_predictor(path)
    check_draft(spec, draft, path)
    verifier = PrunedVerifier(target, spec, logits="path" if config.logits != "full" else "full")
    pol = Lever(target, draft, config, verifier=verifier)
    pol.name = "lever+prune"
    return pol
