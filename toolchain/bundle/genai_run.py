"""Runs a bundle in onnxruntime-genai itself and checks it against mobc's own runtime.

`verify_bundle` feeds the same prompt token ids to both: onnxruntime-genai's Generator over the
bundle (greedy) and mobc's StepModel over the artifact (the `ar` policy's greedy loop), and
compares the generated ids token for token. It also times both decode loops in the same process,
prompt by prompt, so the tokens/s ratio is measured under the same load.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.bundle.genai import load_marker
from toolchain.errors import ArtifactError, MobcError


class BundleMismatchError(MobcError):
    """onnxruntime-genai and mobc generated different tokens from one bundle/artifact pair."""


def _genai(target: str = "cpu"):
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise ArtifactError("running a bundle needs onnxruntime-genai: pip install onnxruntime-genai "
                            "(it is in mobc's dev extra)") from None
    if target == "qnn":
        _register_qnn(og)
    return og


@functools.cache  # once per process
def _register_qnn(og: Any) -> None:
    """genai's PyPI wheel has no QNN EP built in; onnxruntime-qnn's plugin library provides it
    (the HTP emulator on x86, the real HTP on a Snapdragon device)."""
    try:
        import onnxruntime_qnn
    except ImportError:
        raise ArtifactError("a --target qnn bundle runs on the QNN EP: install onnxruntime-qnn "
                            "(a mobc dependency on Linux x86_64)") from None
    og.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())


def padded_length(n: int, width: int) -> int:
    """The prompt's length as genai feeds it: left-padded to whole windows (genai counts the pads)."""
    return -(-n // width) * width


@dataclass
class Generation:
    tokens: list[int]
    prompt_seconds: float  # until the first generated token is known
    decode_seconds: float  # every later token

    @property
    def decode_tps(self) -> float:
        n = len(self.tokens) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else float("nan")


class GenaiRunner:
    """One onnxruntime-genai model over a bundle folder, generating greedily from token ids."""

    def __init__(self, bundle: str | Path):
        self.bundle = Path(bundle)
        self.marker = load_marker(self.bundle)
        og = _genai(self.marker["target"])
        self._og = og
        try:
            self.model = og.Model(str(self.bundle))
        except Exception as exc:  # genai reports config and session errors as RuntimeError
            raise ArtifactError(f"onnxruntime-genai cannot load {self.bundle}: {exc}") from None

    def generate(self, ids: Sequence[int], max_new_tokens: int) -> Generation:
        pad = self.marker["pad_token_id"]
        if pad in ids:
            raise ArtifactError(f"the prompt holds token {pad}, the bundle's pad token: onnxruntime-genai would "
                                "take it for padding; remove it from the prompt")
        params = self._og.GeneratorParams(self.model)
        padded = padded_length(len(ids), self.marker["prompt_width"])
        params.set_search_options(do_sample=False, max_length=padded + max_new_tokens)
        gen = self._og.Generator(self.model, params)
        out: list[int] = []
        t0 = time.perf_counter()
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        first = None
        while not gen.is_done() and len(out) < max_new_tokens:
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        return Generation(out, (first or end) - t0, end - (first or end))


def mobc_generate(model: Any, ids: Sequence[int], max_new_tokens: int) -> Generation:
    """`mobc run`'s greedy decoding (the ar policy) on a StepModel, timed like GenaiRunner.generate."""
    from toolchain.runtime.policies import Sampler, make_policy

    out: list[int] = []
    first = None
    t0 = time.perf_counter()
    for chunk in make_policy("ar", model).generate(list(ids), max_new_tokens, Sampler()):
        out += chunk
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return Generation(out, (first or end) - t0, end - (first or end))


@dataclass
class PromptResult:
    prompt_tokens: int
    genai: Generation
    mobc: Generation

    @property
    def identical(self) -> bool:
        return bool(self.mobc.tokens) and self.genai.tokens == self.mobc.tokens

    @property
    def agreement(self) -> float:
        """Share of mobc's tokens genai reproduced before the first difference (1.0 = identical)."""
        first = self.first_difference
        return 1.0 if first is None else first / max(1, len(self.mobc.tokens))

    @property
    def first_difference(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.genai.tokens, self.mobc.tokens, strict=False)):
            if a != b:
                return i
        same = len(self.genai.tokens) == len(self.mobc.tokens)
        return None if same else min(len(self.genai.tokens), len(self.mobc.tokens))


@dataclass
class BundleCheck:
    bundle: Path
    artifact: Path
    tokens: int
    results: list[PromptResult] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return bool(self.results) and all(r.identical for r in self.results)

    def summary(self) -> dict[str, Any]:
        def median(xs: list[float]) -> float:
            xs = [x for x in xs if np.isfinite(x)]
            return float(np.median(xs)) if xs else float("nan")

        g = median([r.genai.decode_tps for r in self.results])
        m = median([r.mobc.decode_tps for r in self.results])
        return {"bundle": str(self.bundle), "artifact": str(self.artifact), "prompts": len(self.results),
                "agreement": float(np.mean([r.agreement for r in self.results])) if self.results else 0.0,
                "tokens": self.tokens, "identical": self.identical,
                "identical_prompts": sum(r.identical for r in self.results),
                "genai_decode_tps": g, "mobc_decode_tps": m, "genai_over_mobc": g / m if m else float("nan"),
                "genai_prompt_s": median([r.genai.prompt_seconds for r in self.results]),
                "mobc_prompt_s": median([r.mobc.prompt_seconds for r in self.results])}


def verify_bundle(bundle: str | Path, prompts: Sequence[Sequence[int]], tokens: int = 32,
                  artifact: str | Path | None = None, threads: int | None = None,
                  progress: Callable[[str], None] = lambda m: None) -> BundleCheck:
    from toolchain.runtime.model import StepModel

    runner = GenaiRunner(bundle)
    width, context = runner.marker["prompt_width"], runner.marker["context"]
    for i, ids in enumerate(prompts):
        padded = padded_length(len(ids), width)
        if not ids or padded + tokens > context:
            raise ArtifactError(
                f"prompt {i + 1} has {len(ids)} tokens: padded to whole windows of {width} ({padded}) plus "
                f"{tokens} new tokens it does not fit the context of {context}; use shorter prompts, fewer "
                "--tokens, or a recipe with a longer context")
    artifact = Path(artifact or runner.marker["artifact"])
    model = StepModel(artifact, threads=threads)
    check = BundleCheck(Path(bundle), artifact, tokens)
    for i, ids in enumerate(prompts):
        ours = mobc_generate(model, ids, tokens)
        theirs = runner.generate(ids, tokens)
        check.results.append(PromptResult(len(ids), theirs, ours))
        r = check.results[-1]
        progress(f"prompt {i + 1}/{len(prompts)} ({len(ids)} tokens): "
                 + ("identical" if r.identical else f"differs at token {r.first_difference}"))
    return check
