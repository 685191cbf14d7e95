"""Checks shared by the speculative-policy tests: what a draft or target cache must hold after a round."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from toolchain.runtime.model import StepModel

_FRESH: dict = {}  # folder -> a StepModel of its own for the from-scratch reference (sessions are slow to open)


def assert_cache_holds(
    model: StepModel, text: Sequence[int], committed: int | None = None, atol: float = 1e-4
) -> None:
    """The model's cache rows are those of `text` fed from scratch, and there are at most `committed`
    of them (default len(text)): a rejected token left behind by a missing rollback, a scratch row
    kept or a row not moved shows up here. `text` may run past what was emitted (ar's continuation)."""
    n = model.length
    committed = len(text) if committed is None else committed
    assert n <= committed, f"{model.name} holds {n} rows but only {committed} tokens are committed"
    if n == 0:
        return
    fresh = _FRESH.get(model.folder) or _FRESH.setdefault(model.folder, StepModel(model.folder))
    fresh.prefill(list(text[:n]))
    for i in range(model.cache.layout.n_layers):
        np.testing.assert_allclose(
            model.cache.keys[i][..., :n],
            fresh.cache.keys[i][..., :n],
            atol=atol,
            err_msg=f"{model.name} key rows of layer {i}",
        )
        np.testing.assert_allclose(
            model.cache.values[i][:, :, :n],
            fresh.cache.values[i][:, :, :n],
            atol=atol,
            err_msg=f"{model.name} value rows of layer {i}",
        )


def target_second_token(
    target: StepModel, ids: Sequence[int], temperature: float
) -> tuple[int, list[int], np.ndarray]:
    """(the target's most likely first token, its 5 most likely second tokens after it, the probabilities
    of those 5 and of the rest) at `temperature`: the bins of a 5-dof chi-square test."""
    from toolchain.runtime.policies import Sampler

    sampler = Sampler(temperature)
    mode = int(sampler.probs(target.prefill(ids)).argmax())
    p2 = sampler.probs(target.prefill([*ids, mode]))
    top = [int(t) for t in np.argsort(p2)[::-1][:5]]
    return mode, top, np.array([*p2[top], 1.0 - p2[top].sum()])


def chi2_of(seconds: Sequence[int], top: list[int], probs: np.ndarray) -> dict:
    observed = np.zeros(6)
    for t in seconds:
        observed[top.index(t) if t in top else 5] += 1
    expected = probs * observed.sum()
    return {
        "chi2": float(((observed - expected) ** 2 / expected).sum()),
        "observed": observed,
        "expected": expected,
    }


def second_token_check(
    policy, target: StepModel, ids: Sequence[int], temperature: float, runs: int, max_new_tokens: int = 2
) -> dict:
    """Runs `policy` sampled `runs` times (seeds 0..runs-1) and compares the second emitted token, among
    runs whose first token is the target's mode, with the target's own sampling distribution there
    (its top 5 tokens and the rest: 5 degrees of freedom). The first token comes from the prompt's
    logits; the second is the first one a speculative round decides (accepted draft, correction from
    the residual, or bonus), so a wrong acceptance rule or a wrong q shows up as a biased histogram."""
    from toolchain.runtime.policies import Sampler

    mode, top, probs = target_second_token(target, ids, temperature)
    seconds = []
    for seed in range(runs):
        out = [
            t
            for chunk in policy.generate(ids, max_new_tokens, Sampler(temperature, seed=seed))
            for t in chunk
        ]
        if out[0] == mode:
            seconds.append(out[1])
    return chi2_of(seconds, top, probs)
