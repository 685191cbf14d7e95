"""Calibration on real text, through the float step graphs with realistic cache contents.

Text: the Python standard library's own source (toolchain/train/corpus.py): calibration reads
its calibration modules (train split), perplexity and sensitivity its evaluation modules
(held-out split).

Feeds: a calibration sample is one call of a family's step graph (N new tokens) against a KV
cache filled by *running the float graphs* over the preceding text, at past lengths spread over
the whole context, so past_key/past_value inputs and attention masks look like deployment.

Statistics: onnxruntime's MinMax calibrator, which augments the graph with ReduceMin/ReduceMax
per tensor, so each call contributes two scalars per tensor and no activation is ever held
(`max_intermediate_outputs` merges them every few calls). Feeds are generated lazily, one at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod
from onnxruntime.quantization.calibrate import (
    TensorsData,
    create_calibrator,
    load_tensors_data,
    save_tensors_data,
)

from toolchain.runtime.cache import KVCache
from toolchain.runtime.greedy import family_by_role
from toolchain.runtime.sessions import ArtifactSessions
from toolchain.train import corpus

CACHE_DIR = Path(os.environ.get("MOBC_CACHE", Path.home() / ".cache" / "mobc")) / "calibration"
CACHE_VERSION = 2  # 2: every window samples past 0


def corpus_tokens(tokenizer: Any, split: str, n_tokens: int, text: str | None = None) -> list[int]:
    """The first n_tokens of the calibration text (train split) or of the evaluation text (held-out
    split), or of `text` when given."""
    if text is None:
        text = corpus.named_text(corpus.CALIBRATION_FILES if split == "calibration" else corpus.EVALUATION_FILES)
    ids: list[int] = []
    # tokenize file-sized pieces so we never tokenize megabytes to keep a few thousand tokens
    for piece in text.split("\n\n\n"):
        ids.extend(tokenizer(piece + "\n\n\n").input_ids)
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


def filler_family(sessions: ArtifactSessions) -> str:
    """The widest graph family: used to fill caches quickly (prefill if the artifact has one)."""
    fam = family_by_role(sessions, "prefill")
    if fam is None:
        fam = max(sessions.families(), key=lambda f: sessions.chain(f)[0].width)
    return fam


def advance(sessions: ArtifactSessions, fam: str, cache: KVCache, tokens: list[int]) -> None:
    """Commits `tokens` to the cache through the float graph `fam`, width-sized chunks."""
    width = sessions.chain(fam)[0].width
    for s in range(0, len(tokens), width):
        chunk = tokens[s : s + width]
        outs = sessions.run_family(fam, cache.step_inputs(chunk, width))
        cache.commit(outs, range(len(chunk)))


def family_feeds(sessions: ArtifactSessions, family: str, tokens: list[int], samples: int,
                 seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """`samples` realistic feeds of `family`, at past lengths spread over the context.

    Each text window of `context` tokens gives up to 4 samples at increasing past lengths; the
    cache between them is filled by the float filler family, so its contents are real K/V.
    """
    layout = sessions.layout(family)
    n, cl = layout.width, layout.context
    fill = filler_family(sessions)
    per_window = min(4, samples)
    rng = np.random.default_rng(seed)
    max_start = max(1, len(tokens) - cl)
    made = 0
    while made < samples:
        start = int(rng.integers(0, max_start)) if samples > per_window else 0
        text = tokens[start : start + cl]
        top = min(cl - n, len(text) - n)
        if top < 0:
            raise ValueError(f"calibration text of {len(tokens)} tokens is shorter than one width-{n} call")
        cache = KVCache(layout, sessions.rope)
        # past lengths: evenly spread over [0, top], jittered, increasing
        jitter = int(rng.integers(0, max(1, top // (2 * per_window))))
        pasts = sorted({min(top, int(p) + jitter) for p in np.linspace(0, top, per_window + 1)[1:-1]} | {0})
        # past 0 (the window's first tokens) is always sampled: the sequence's first token carries
        # the "massive activations" (residual |x| ~ 2e4 on SmolLM2); ranges that miss it clip it
        # at run time, which breaks the attention sink every later token relies on
        for p in pasts:
            if made >= samples:
                return
            advance(sessions, fill, cache, text[cache.length : p])
            yield cache.step_inputs(text[p : p + n], n)
            made += 1


class _One(CalibrationDataReader):
    def __init__(self, feeds: dict[str, np.ndarray]):
        self.feeds: dict[str, np.ndarray] | None = feeds

    def get_next(self) -> dict[str, np.ndarray] | None:
        f, self.feeds = self.feeds, None
        return f


class GraphCalibrator:
    """onnxruntime's MinMax calibrator over one graph file, fed one call at a time.

    onnxruntime 1.32's `max_intermediate_outputs` drops (does not merge) the collected batch, so
    instead every call is its own collect_data(), which merges its ReduceMin/ReduceMax scalars into
    the running range at once: memory is two scalars per tensor, whatever the sample count.
    """

    def __init__(self, onnx_path: Path, work: Path):
        self.calibrator = create_calibrator(
            onnx_path, None, augmented_model_path=str(work / f"{onnx_path.stem}.augmented.onnx"),
            calibrate_method=CalibrationMethod.MinMax, use_external_data_format=True,
        )
        self.input_names = [i.name for i in self.calibrator.infer_session.get_inputs()]
        self.calls = 0

    def add(self, feeds: dict[str, np.ndarray]) -> None:
        self.calibrator.collect_data(_One({k: feeds[k] for k in self.input_names}))
        self.calls += 1

    def ranges(self) -> TensorsData:
        return self.calibrator.compute_data()


def cache_key(sessions: ArtifactSessions, family: str, tokens: list[int], samples: int, seed: int,
              variant: str = "") -> str:
    """Content hash of everything the ranges depend on: graphs (and the rewrite `variant` calibrated
    in their place), weights, text, sample plan."""
    h = hashlib.sha256(json.dumps([sessions.manifest.weights["sha256"], samples, seed, CACHE_VERSION, variant,
                                   [st.sha256 for st in sessions.chain(family)]]).encode())
    h.update(np.asarray(tokens, np.int64).tobytes())
    return h.hexdigest()[:32]


def calibrate_family(sessions: ArtifactSessions, family: str, tokens: list[int], samples: int, seed: int,
                     work: Path, graphs: dict[str, Path] | None = None, variant: str = "") -> dict[str, TensorsData]:
    """Ranges of every float tensor of each stage graph of `family`, cached by content hash (so a
    W4A16 and a W4A8 compile of the same graphs calibrate once).

    graphs: stage name -> an equivalent rewritten float graph to collect ranges on instead (the
    artifact's own graphs still fill the cache); `variant` names that rewrite in the cache key."""
    chain = sessions.chain(family)
    key = cache_key(sessions, family, tokens, samples, seed, variant)
    cached = {st.name: CACHE_DIR / f"{key}-{st.name}.json" for st in chain}
    if all(p.is_file() for p in cached.values()):
        return {name: load_tensors_data(p) for name, p in cached.items()}
    ranges = _calibrate(sessions, family, tokens, samples, seed, work, graphs or {})
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    for name, r in ranges.items():
        save_tensors_data(r, cached[name])
    return ranges


def _calibrate(sessions: ArtifactSessions, family: str, tokens: list[int], samples: int, seed: int,
               work: Path, graphs: dict[str, Path]) -> dict[str, TensorsData]:
    chain = sessions.chain(family)
    envs = [dict(feeds) for feeds in family_feeds(sessions, family, tokens, samples, seed)]
    ranges = {}
    # stage by stage, so one stage's calibrator (a session over its weights) exists at a time:
    # a 3B model calibrates in one part's memory
    for i, st in enumerate(chain):
        path = graphs.get(st.name, sessions.folder / st.file)
        cal = GraphCalibrator(path, work)
        for env in envs:
            cal.add(env)
            if i < len(chain) - 1:  # later stages need this stage's real outputs
                env.update(sessions.run_stage(st, {n: env[n] for n in st.input_names}))
        ranges[st.name] = cal.ranges()
        del cal
        for f in work.glob(f"{path.stem}.augmented.onnx*"):
            f.unlink()  # the calibrator's copy of the stage's weights: gone before the next stage's
    return ranges


def tensor_range(ranges: TensorsData, name: str) -> tuple[float, float] | None:
    if name not in ranges.data:
        return None
    lo, hi = ranges.data[name].range_value
    return float(np.asarray(lo).min()), float(np.asarray(hi).max())
