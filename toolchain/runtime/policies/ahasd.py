"""ahasd: asynchronous drafting and verification (AHASD, Ma et al. 2026), lossless.

Two threads: the drafter runs the draft model ahead of verification, one token per call, and
the verifier runs the target over what was drafted. Three queues connect them:
- unverified: drafter -> verifier, every drafted token (epoch, position, token, q);
- pre-verification: the verifier's staging of drafts it took but has not verified yet; a
  verification starts when gamma are staged, or early (time-aware pre-verification) when
  waiting longer than the drafter's measured time per token would leave the target idle or
  the drafter has paused;
- feedback: verifier -> drafter, per verification the accepted positions and, on a rejection,
  a rollback (new epoch, position, the target's token there).
Entropy-history drafting control: a pattern history table indexed by the quantized entropies
of the last two drafts and the leading length (drafts ahead of verification) holds 2-bit
saturating counters, updated with each draft's verification outcome; when it predicts a
rejection the drafter pauses until the next feedback instead of drafting look-ahead that will
likely be thrown away. Acceptance is the chain rule (accept_chain), so greedy output is ar's.

`overlap` reports how much of the drafter's busy time ran while the verifier was busy;
`AhasdStats.phone_seconds` replays the observed dependency order with phone call latencies.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from toolchain.errors import MobcError
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.base import Policy, Pricer, RunStats
from toolchain.runtime.policies.sampling import Sampler, accept_chain, softmax
from toolchain.runtime.spans import overlapped_seconds

ENTROPY_EDGES = (0.5, 1.5, 3.0)  # nats: confident / fair / unsure / lost


class EntropyHistory:
    """Pattern history table: (entropy bucket of previous draft, of this draft, leading length) -> counter."""

    def __init__(self, max_lead: int = 7):
        n = len(ENTROPY_EDGES) + 1
        self.max_lead = max_lead
        self.table = np.full((n, n, max_lead + 1), 2, dtype=np.int8)  # weakly "continue"

    def index(self, h_prev: float, h: float, lead: int) -> tuple[int, int, int]:
        q = np.searchsorted(ENTROPY_EDGES, [h_prev, h])
        return int(q[0]), int(q[1]), min(lead, self.max_lead)

    def predict(self, idx: tuple[int, int, int]) -> bool:
        return bool(self.table[idx] >= 2)

    def update(self, idx: tuple[int, int, int], accepted: bool) -> None:
        v = self.table[idx] + (1 if accepted else -1)
        self.table[idx] = min(3, max(0, v))


@dataclass
class Draft:
    epoch: int
    pos: int
    token: int
    q: np.ndarray | None


@dataclass
class Feedback:
    epoch: int
    outcomes: list[tuple[int, bool]]  # (position, accepted) per verified draft
    rollback: tuple[int, int] | None = None  # (position, token) to restart from


@dataclass
class AhasdStats(RunStats):
    draft_family: str = ""  # the draft's decode graph, whose calls the replay prices
    draft_busy: list[tuple[float, float]] = field(default_factory=list)
    verify_busy: list[tuple[float, float]] = field(default_factory=list)
    pauses: int = 0  # times entropy-history control stopped look-ahead
    early_verifies: int = 0  # verifications started before gamma drafts were staged
    discarded: int = 0  # drafted tokens thrown away (stale epoch)
    draft_deps: list[int] = field(default_factory=list)  # per draft call: feedbacks consumed before it
    verify_deps: list[int] = field(default_factory=list)  # per verify: draft calls finished before it
    verify_keys: list[str] = field(default_factory=list)

    @property
    def overlap_seconds(self) -> float:
        return overlapped_seconds(self.verify_busy, self.draft_busy)

    @property
    def overlap(self) -> float:
        """Fraction of draft busy time hidden under verification."""
        busy = sum(b - a for a, b in self.draft_busy)
        return self.overlap_seconds / busy if busy else 0.0

    def phone_seconds(self, target: Pricer, draft: Pricer | None = None) -> float:
        """Replay the run's dependency order (which feedback each draft waited for, which drafts
        each verification waited for) with phone latencies on two concurrent units."""
        if draft is None:
            return super().phone_seconds(target)
        d_cost = draft.seconds(self.draft_family)
        d_end: list[float] = []
        v_end: list[float] = []
        di = vi = 0
        # merge by dependency: a draft needs v_end[fb-1]; a verify needs d_end[deps-1]
        while di < len(self.draft_deps) or vi < len(self.verify_deps):
            if vi < len(self.verify_deps) and self.verify_deps[vi] <= di:
                start = max(v_end[-1] if v_end else 0.0, d_end[self.verify_deps[vi] - 1] if self.verify_deps[vi] else 0.0)
                v_end.append(start + target.seconds(self.verify_keys[vi]))
                vi += 1
            elif di < len(self.draft_deps) and self.draft_deps[di] <= vi:
                fb = self.draft_deps[di]
                start = max(d_end[-1] if d_end else 0.0, v_end[fb - 1] if fb else 0.0)
                d_end.append(start + d_cost)
                di += 1
            else:  # inconsistent record (should not happen): fall back to serial time
                return super().phone_seconds(target, draft)
        return max(v_end[-1] if v_end else 0.0, 0.0)


def _entropy(p: np.ndarray) -> float:
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum())


class Ahasd(Policy):
    name = "ahasd"
    stats_type = AhasdStats
    stats: AhasdStats

    def __init__(self, target: StepModel, draft: StepModel | None = None, gamma: int = 4, max_lead: int = 12):
        if draft is None:
            raise MobcError("policy ahasd needs a draft model: pass --draft <artifact folder>")
        super().__init__(target, draft)
        self.gamma = gamma
        self.max_lead = max_lead
        self.pht = EntropyHistory()
        target.family_for(gamma + 1)

    # ---- drafter thread -----------------------------------------------------------------------
    def _drafter(self, start_pos: int, first: int, sampler: Sampler, stop: threading.Event) -> None:
        d, st = self.draft, self.stats
        epoch, pos = 0, start_pos  # pos: the newest known token's position; the next draft is pos + 1
        seq = {start_pos: first}  # tokens by position from the draft cache's end on
        verified = start_pos - 1  # positions <= verified are committed
        h_prev, fb_seen = 0.0, 0
        pht_of: dict[int, tuple[int, int, int]] = {}  # pos -> PHT index of that draft
        rng = np.random.default_rng(sampler.seed + 1)
        while not stop.is_set():
            fb = None
            paused = pos - verified > self.max_lead
            if not paused and pos in pht_of:
                paused = not self.pht.predict(pht_of[pos])  # low-confidence look-ahead: wait
            try:
                fb = self.feedback.get(timeout=0.02) if paused else self.feedback.get_nowait()
            except queue.Empty:
                if paused:
                    st.pauses += 1
                    continue
            if fb is not None:
                fb_seen += 1
                for p, ok in fb.outcomes:
                    if p in pht_of:
                        self.pht.update(pht_of.pop(p), ok)
                    if ok:
                        verified = max(verified, p)
                if fb.rollback is not None and fb.epoch > epoch:
                    start, toks = fb.rollback
                    epoch = fb.epoch
                    d.truncate(min(d.length, start))
                    seq = {p: t for p, t in seq.items() if d.length <= p < start}
                    seq.update({start + i: t for i, t in enumerate(toks)})
                    pos = start + len(toks) - 1
                    verified = pos - 1
                    pht_of = {p: i for p, i in pht_of.items() if p < start}
                continue
            feed = [seq[p] for p in range(d.length, pos + 1)]
            if d.cache.free(max(d.widths.values())) < len(feed):
                return  # out of draft context: the verifier finishes alone (plain target steps)
            t0 = time.perf_counter()
            st.draft_deps.append(fb_seen)
            logits = d.feed(feed)
            st.draft_busy.append((t0, time.perf_counter()))
            if sampler.greedy:
                p = softmax(logits)
                nxt, q = int(np.argmax(logits)), None
            else:
                p = q = sampler.probs(logits)
                nxt = int(rng.choice(len(q), p=q))
            h = _entropy(p)
            pos += 1
            seq[pos] = nxt
            pht_of[pos] = self.pht.index(h_prev, h, pos - verified)
            h_prev = h
            self.unverified.put(Draft(epoch, pos, nxt, q))

    # ---- verifier thread ----------------------------------------------------------------------
    def _verifier(self, first: int, pos: int, budget: int, sampler: Sampler, stop: threading.Event) -> None:
        t, st = self.target, self.stats
        base = pos
        committed = [first]  # committed[i] is the token at position base + i; the last is pending
        epoch, staged, n = 0, [], 0
        per_token = 0.0  # drafter's measured seconds per draft (time-aware pre-verification)

        def rollback(start: int) -> None:
            nonlocal epoch, staged
            epoch += 1
            staged = []
            self.feedback.put(Feedback(epoch, [], (start, committed[start - base :])))

        def take(dr: Draft) -> None:
            """Route one draft: stale, already decided (check it), or next in line (stage it)."""
            pend = base + len(committed) - 1
            if dr.epoch != epoch:
                st.discarded += 1
            elif dr.pos <= pend:  # the target already chose this position's token
                ok = committed[dr.pos - base] == dr.token
                self.feedback.put(Feedback(epoch, [(dr.pos, ok)]))
                if not ok:
                    rollback(dr.pos)
                elif dr.pos < pend:  # the drafter fell behind the target: hand it the decided tokens
                    rollback(dr.pos + 1)
            elif dr.pos == pend + 1 + len(staged):
                staged.append(dr)
            else:
                st.discarded += 1

        try:
            while n < budget and not stop.is_set():
                deadline = time.perf_counter() + max(per_token * (self.gamma - len(staged)), 0.002)
                while len(staged) < self.gamma and not stop.is_set():
                    wait = deadline - time.perf_counter()
                    try:
                        dr = self.unverified.get(timeout=wait) if wait > 0 else self.unverified.get_nowait()
                    except queue.Empty:
                        break  # waited as long as drafting should take: verify what is staged
                    take(dr)
                if st.draft_busy:
                    per_token = float(np.mean([b - a for a, b in st.draft_busy[-8:]]))
                g = min(len(staged), budget - n - 1, self.gamma)
                if not t.room(g + 1):
                    g = 0
                    if not t.room(1):
                        break
                batch, rest = staged[:g], staged[g:]
                st.early_verifies += int(g < self.gamma)
                t0 = time.perf_counter()
                st.verify_deps.append(len(st.draft_busy))
                fam = t.family_for(g + 1)
                st.verify_keys.append(fam)
                logits = t.forward([committed[-1], *[x.token for x in batch]], family=fam)
                k, nxt = accept_chain(logits, [x.token for x in batch], [x.q for x in batch], sampler)
                t.commit(range(k + 1))
                st.verify_busy.append((t0, time.perf_counter()))
                self.stats.accepted.append(k)
                emitted = [x.token for x in batch[:k]] + [nxt]
                committed.extend(emitted)
                self.feedback.put(Feedback(epoch, [(x.pos, i < k) for i, x in enumerate(batch)]))
                if k < len(batch):
                    rollback(base + len(committed) - 1)  # drafts after the rejection are stale
                else:
                    staged = []
                    for dr in rest:  # the first may be the drafter's guess of the bonus token
                        take(dr)
                n += len(emitted)
                self.out.put(emitted)
        finally:
            self.out.put(None)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampler: Sampler) -> Iterator[list[int]]:
        assert self.draft is not None
        self._start(prompt)
        self.stats.draft_family = self.draft.decode_family
        self.unverified: queue.Queue[Draft] = queue.Queue()
        self.feedback: queue.Queue[Feedback] = queue.Queue()
        self.out: queue.Queue[list[int] | None] = queue.Queue()
        first = self._prefill(prompt, sampler)
        stop = threading.Event()
        pos = len(prompt)  # position of `first`
        errors: list[BaseException] = []

        def guard(fn, *args):
            def body():
                try:
                    fn(*args)
                except BaseException as e:  # surfaced in the caller's thread below
                    errors.append(e)
                    stop.set()
                    self.out.put(None)
            return body

        threads = [threading.Thread(target=guard(self._drafter, pos, first, sampler, stop), daemon=True,
                                    name="ahasd-draft"),
                   threading.Thread(target=guard(self._verifier, first, pos, max_new_tokens - 1, sampler, stop),
                                    daemon=True, name="ahasd-verify")]
        n = 1
        try:
            yield [first]
            if first in self.target.eos_ids or max_new_tokens <= 1:
                return
            for th in threads:
                th.start()
            while True:
                chunk = self.out.get()
                if chunk is None:
                    return
                new, done = self._clip(chunk, max_new_tokens - n)
                n += len(new)
                self.stats.tokens = n
                yield new
                if done:
                    return
        finally:
            stop.set()
            for th in threads:
                if th.is_alive() or th.ident is not None:
                    th.join(timeout=30)
            self.alive_threads = sum(th.is_alive() for th in threads)
            self._finish()
            if errors:
                raise errors[0]



def make(target: StepModel, draft: StepModel | None, gamma: int = 4, variant: str = "", **options) -> Policy:
    if variant:
        raise MobcError(f"ahasd has no variant {variant!r}")
    return Ahasd(target, draft, gamma=gamma)
