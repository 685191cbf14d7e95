"""Perplexity of an artifact's step graphs on held-out text, through the runtime's own cache.

Text is cut into windows of the graph's context; each window starts from an empty cache and is fed
through the widest (prefill) family in width-N chunks, exactly as `greedy.prefill` does, so float and
quantized graphs are scored on identical feeds. Every token after the first of a window is scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.quantize.calibrate import corpus_tokens, filler_family
from toolchain.runtime.cache import KVCache
from toolchain.runtime.sessions import ArtifactSessions

QUANT_DIR = "quantized"


@dataclass
class Perplexity:
    ppl: float
    nll: float
    tokens: int
    argmax_agree: float | None = None  # vs the float graphs' next-token choice

    def row(self) -> dict[str, Any]:
        return {"ppl": round(self.ppl, 4), "nll": round(self.nll, 5), "tokens": self.tokens,
                "argmax_agree": None if self.argmax_agree is None else round(self.argmax_agree, 4)}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def window_logits(sessions: ArtifactSessions, tokens: list[int]) -> list[np.ndarray]:
    """Logits [k, V] of each window chunk, windows of the family's context."""
    fam = filler_family(sessions)
    layout = sessions.layout(fam)
    n, cl = layout.width, layout.context
    out = []
    for w in range(0, len(tokens) - 1, cl):
        window = tokens[w : w + cl]
        cache = KVCache(layout, sessions.rope)
        for s in range(0, len(window), n):
            chunk = window[s : s + n]
            res = sessions.run_family(fam, cache.step_inputs(chunk, n))
            cache.commit(res, range(len(chunk)))
            out.append(res["logits"][0, : len(chunk)])
    return out


def perplexity(sessions: ArtifactSessions, tokens: list[int],
               reference: list[np.ndarray] | None = None) -> tuple[Perplexity, list[np.ndarray]]:
    fam = filler_family(sessions)
    cl = sessions.layout(fam).context
    chunks = window_logits(sessions, tokens)
    logits = np.concatenate(chunks)
    nll, count, agree = 0.0, 0, 0
    for w in range(0, len(tokens) - 1, cl):
        window = tokens[w : w + cl]
        lp = _log_softmax(logits[w : w + len(window) - 1])
        target = np.asarray(window[1:])
        nll -= float(lp[np.arange(len(target)), target].sum())
        count += len(target)
    if reference is not None:
        ref = np.concatenate(reference)
        agree = float((ref.argmax(-1) == logits.argmax(-1)).mean())
    mean = nll / max(count, 1)
    return Perplexity(float(np.exp(mean)), mean, count, agree if reference is not None else None), chunks


def eval_artifact(folder: str | Path, n_tokens: int = 1024, text: str | None = None,
                  tokenizer: Any = None) -> dict[str, Any]:
    """Float vs quantized perplexity of an artifact (its `quantized/` sub-artifact when present)."""
    folder = Path(folder)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    tokens = corpus_tokens(tokenizer, "heldout", n_tokens, text)
    rows: dict[str, Any] = {}
    ref_sessions = ArtifactSessions(folder)
    base, ref_logits = perplexity(ref_sessions, tokens)
    rows["float"] = base.row()
    del ref_sessions
    qdir = folder / QUANT_DIR
    if (qdir / "manifest.json").is_file():
        qs = ArtifactSessions(qdir)
        tag = (qs.manifest.quantization or {}).get("scheme", "quantized")
        q, _ = perplexity(qs, tokens, ref_logits)
        row = q.row()
        row["rel_change"] = round(q.ppl / base.ppl - 1.0, 5)
        rows[tag] = row
    return {"text": "held-out stdlib sources" if text is None else "user text", "tokens": len(tokens),
            "rows": rows}


def ppl_table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["graphs", "perplexity", "rel. change", "argmax = float", "scored tokens"]
    rows = []
    for name, r in result["rows"].items():
        rel = r.get("rel_change")
        rows.append([name, f"{r['ppl']:.3f}", "—" if rel is None else f"{rel * 100:+.2f}%",
                     "—" if r.get("argmax_agree") is None else f"{r['argmax_agree'] * 100:.1f}%",
                     str(r["tokens"])])
    return head, rows
