"""Policies over tiny compiled artifacts: greedy chain is lossless, IO binding changes nothing."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from tests.tiny import save_tiny, tiny_tokenizer, write_recipe
from tests.toolchain.runtime.speculative import assert_cache_holds, second_token_check
from tests.toolchain.runtime.test_sampling import CHI2_5DOF_P001
from toolchain.compile.pipeline import compile_recipe
from toolchain.errors import MobcError
from toolchain.runtime.greedy import greedy
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import Sampler, make_policy

GRAPHS = "  decode: {width: 1, context: 64}\n  prefill: {width: 8, context: 64}\n"
PROMPTS = ["def f(x):\n    return", "import os\nimport sys\n", "class A:\n    def __init__(self"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    target = write_recipe(root / "t.yaml", save_tiny(root / "t_hf", "llama", seed=0), name="target",
                          graphs=GRAPHS + "  verify: {width: 6, context: 64, role: tree}\n"
                                          "  verify3: {width: 3, context: 64, role: tree}\n")
    draft = write_recipe(root / "d.yaml", save_tiny(root / "d_hf", "llama", seed=1), name="draft", graphs=GRAPHS)
    return compile_recipe(target).out_dir, compile_recipe(draft).out_dir


def run(policy, prompt_ids, n, sampler=None):
    return [t for chunk in policy.generate(prompt_ids, n, sampler or Sampler()) for t in chunk]


def test_ar_matches_compile_time_greedy_with_and_without_io_binding(artifacts):
    target_dir, _ = artifacts
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    bound = StepModel(target_dir)
    plain = StepModel(target_dir, io_binding=False)
    ref = greedy(bound.sessions, ids, 20)
    assert run(make_policy("ar", bound), ids, 20) == ref
    assert run(make_policy("ar", plain), ids, 20) == ref


@pytest.mark.parametrize("draft_kind", ["other", "self"])
def test_greedy_chain_equals_ar(artifacts, draft_kind):
    target_dir, draft_dir = artifacts
    target = StepModel(target_dir)
    draft = StepModel(target_dir if draft_kind == "self" else draft_dir)
    ar = make_policy("ar", target)
    for gamma in (1, 4, 5):
        chain = make_policy("chain", target, draft, gamma=gamma)
        for prompt in PROMPTS:
            ids = tiny_tokenizer()(prompt).input_ids
            ref = run(ar, ids, 30)
            assert run(chain, ids, 30) == ref, (gamma, prompt)
            s = chain.stats
            assert s.tokens == len(ref) and len(s.accepted) == s.n_target_calls
            if draft_kind == "self":  # a draft equal to the target is always accepted
                assert all(k == min(gamma, 30 - 1 - i * (gamma + 1)) for i, k in enumerate(s.accepted))


def test_a_confident_draft_fills_the_verify_graphs_free_rows(artifacts):
    """Past gamma, chain keeps drafting while the draft is confident, up to the widest graph of at most
    8 rows (the 8-wide prefill here: 7 drafts), though gamma + 1 = 3 rows have a graph of their own;
    the target drafting for itself is always right, so every such round accepts 7. A round of gamma
    drafts runs on the 3-wide graph."""
    target_dir, _ = artifacts
    target, draft = StepModel(target_dir), StepModel(target_dir)
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    ref = run(make_policy("ar", target), ids, 30)
    # always confident / never
    # rows=N caps a round's rows at the widest graph of at most N: 3 here (verify3), and 8 (all there is) for 64
    for spec, per_round, family in (("chain:extend=0", 7, "prefill"), ("chain:extend=1", 2, "verify3"),
                                    ("chain:extend=0:rows=4", 2, "verify3"), ("chain:rows=64:extend=0", 7, "prefill")):
        chain = make_policy(spec, target, draft, gamma=2)  # resets the call counts
        assert chain.name == spec
        assert chain.max_drafts == per_round  # extend=1 even when a probability rounds to exactly 1.0
        assert run(chain, ids, 30) == ref
        assert chain.stats.accepted[:3] == [per_round] * 3, (spec, chain.stats.accepted)
        assert target.calls[family] >= 3, target.calls
        if family == "verify3":
            assert target.calls["verify"] == 0, target.calls


@pytest.mark.parametrize("spec, says", [
    ("chain+lookup:depth=3", "chain has no setting 'depth'; its settings: extend"),
    ("chain:extend=1.5", "extend needs a number from 0 to 1"),
    ("chain:extend", "extend needs a number from 0 to 1"),
    ("chain:extend=x", "not 'x'"),
    ("chain:rows=1", "rows needs a whole number of rows, at least 2 (rows=32), not '1'"),
    ("chain:rows=2.5", "not '2.5'"),
    ("chain+lookup:runs=1", "runs needs a whole number of tokens, 0 or at least 2 (runs=5), not '1'"),
    ("chain+lookup:runs=-2", "not '-2'"),
    ("ar:extend=0.5", "ar has no setting 'extend'; its settings: none"),
    ("lever+lookup:extend=0.5", "lever has no setting 'extend'"),
])
def test_policy_settings_are_refused_by_name(spec, says):
    with pytest.raises(MobcError, match=re.escape(says)):
        make_policy(spec, None, None)


def test_chain_with_a_near_draft_accepts_partly_rolls_back_and_stays_lossless(artifacts, near_draft):
    """Acceptance is partial; after every round both caches hold exactly the committed text, and
    each round accepts what the draft's own greedy continuation of the committed text shares with ar."""
    target_dir, _ = artifacts
    target, draft, oracle = StepModel(target_dir), StepModel(near_draft), StepModel(near_draft)
    ar = make_policy("ar", target)
    kinds = Counter()
    for gamma in (2, 5):
        chain = make_policy("chain", target, draft, gamma=gamma, extend_at=1.01)  # exactly gamma per round
        for prompt in PROMPTS:
            ids = tiny_tokenizer()(prompt).input_ids
            ref = run(ar, ids, 30)
            out: list[int] = []
            for chunk in chain.generate(ids, 30, Sampler()):
                out += chunk
                assert_cache_holds(draft, ids + out)
                assert_cache_holds(target, ids + out)
            assert out == ref, (gamma, prompt)
            n = 1
            for k in chain.stats.accepted:
                g = min(gamma, 30 - n)
                proposal = greedy(oracle.sessions, ids + ref[:n], g)
                want = next((i for i, (a, b) in enumerate(zip(proposal, ref[n:], strict=False)) if a != b), g)
                assert k == want, (gamma, prompt, n)
                kinds["none" if k == 0 else "all" if k == g else "partial"] += 1
                n += k + 1
            assert n >= len(ref)
    assert kinds["partial"] >= 5 and kinds["all"] >= 3 and kinds["none"] >= 3, kinds


def test_sampled_chain_runs_and_respects_budget(artifacts):
    target_dir, draft_dir = artifacts
    chain = make_policy("chain", StepModel(target_dir), StepModel(draft_dir), gamma=4)
    ids = tiny_tokenizer()(PROMPTS[1]).input_ids
    out = run(chain, ids, 25, Sampler(temperature=0.8, seed=3))
    assert len(out) == 25 and all(0 <= t < 512 for t in out)
    assert run(chain, ids, 25, Sampler(temperature=0.8, seed=3)) == out  # seeded: reproducible


def test_sampled_chain_emits_the_targets_distribution(artifacts, near_draft):
    """At temperature 0.1 the tiny target's first token is nearly fixed (p 0.94) and its second spread
    over a few tokens; 150 seeded runs: the second token, decided by accept/residual against the near
    draft's q, follows the target's distribution (chi-square, 5 dof, p = 0.001)."""
    target_dir, _ = artifacts
    target, draft = StepModel(target_dir), StepModel(near_draft)
    chain = make_policy("chain", target, draft, gamma=4)
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    r = second_token_check(chain, StepModel(target_dir), ids, 0.1, 150)
    # measured chi2 ~3 (600 runs); acceptance with an untempered q: 1111, every draft accepted: 1107 (600 runs)
    assert r["chi2"] < CHI2_5DOF_P001, r


def test_chain_needs_wide_enough_verify_graph(artifacts):
    from toolchain.errors import ArtifactError

    target_dir, draft_dir = artifacts
    with pytest.raises(ArtifactError, match="width >= 9"):
        make_policy("chain", StepModel(target_dir), StepModel(draft_dir), gamma=8)


def test_context_exhaustion_stops_cleanly(artifacts):
    target_dir, draft_dir = artifacts
    target, draft = StepModel(target_dir), StepModel(draft_dir)
    ids = list(np.random.default_rng(0).integers(3, 500, size=40))
    ar_out = run(make_policy("ar", target), ids, 100)
    chain_out = run(make_policy("chain", target, draft), ids, 100)
    assert chain_out == ar_out and len(ar_out) < 100


def test_cli_run_and_bench_decode(artifacts, tmp_path):
    import json

    from typer.testing import CliRunner

    from toolchain.cli.main import app

    target_dir, draft_dir = artifacts
    runner = CliRunner()
    res = runner.invoke(app, ["run", str(target_dir), "--prompt", PROMPTS[0], "--policy", "chain",
                              "--draft", str(draft_dir), "--max-new-tokens", "12"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(PROMPTS[0]) and len(res.output) > len(PROMPTS[0])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n---\n".join(PROMPTS))
    out = tmp_path / "bench.json"
    res = runner.invoke(app, ["bench", "decode", str(target_dir), "--draft", str(draft_dir), "--prompts",
                              f"file:{prompts}", "--max-new-tokens", "48", "--no-llamacpp", "--json", str(out),
                              "--baseline", str(target_dir), "--baseline", str(draft_dir),
                              "--draft", str(target_dir), "--policies", "ar,chain,chain+lookup"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    rows = {r["policy"]: r for r in data["rows"]}
    # --baseline: ar over other artifacts on the same prompts, compared with the target's ar
    same, other = (f"ar@{StepModel(d).name}" for d in (target_dir, draft_dir))
    assert rows[same]["identical_to_ar"] == 3 and rows[same]["tokens"] == rows["ar"]["tokens"]
    assert rows[other]["tokens"] > 0 and rows[other]["tokens_per_s_cpu"] > 0
    assert rows["chain"]["identical_to_ar"] == data["prompts"] == 3
    # a second --draft: the same policies with it, in the same run; the target as its own draft is
    # always accepted, so its rows take many more tokens per target call than the other draft's
    for name in ("chain", "chain+lookup"):
        second = rows[f"{name}@{target_dir.name}"]
        assert second["identical_to_ar"] == 3 and rows[name]["identical_to_ar"] == 3
        assert second["tokens_per_target_call"] > rows[name]["tokens_per_target_call"] + 1.5, (name, rows)
    assert rows["ar"]["target_calls_per_token"] == pytest.approx(1.0, abs=0.1)
    # measured call costs: every decode-phase call of each model counted once, and the target run as a draft
    # costs what it costs as the target (the same graph)
    calls = {(c["key"], c["family"]): c for c in data["cpu_calls"]}
    want: dict = {}
    for name, details in data["details"].items():
        owner = name if name.startswith("ar@") else "target"
        key = "draft0" if "@" in name and not name.startswith("ar@") else "draft"
        for d in details:
            for fam, n in d["target_calls"].items():
                want[(owner, fam)] = want.get((owner, fam), 0) + n
            for fam, n in d["draft_calls"].items():
                want[(key, fam)] = want.get((key, fam), 0) + n
    assert {k: c["calls"] for k, c in calls.items()} == {k: n for k, n in want.items() if n}
    assert calls[("target", "decode")]["vs_target_decode"] == pytest.approx(1.0)
    assert calls[("draft0", "decode")]["model"] == StepModel(target_dir).name
    assert 0.33 < calls[("draft0", "decode")]["vs_target_decode"] < 3.0
    assert all(c["ms_per_call"] > 0 for c in calls.values())
    assert "measured decode-phase calls on this CPU" in res.output
    assert rows["chain"]["phone_ms_per_token"] > 0
    # chain's speedup is ar's phone time per token over chain's (not a ratio of ar with itself)
    assert rows["chain"]["speedup_phone"] == pytest.approx(
        rows["ar"]["phone_ms_per_token"] / rows["chain"]["phone_ms_per_token"])


def test_a_mobc_process_runs_target_and_draft_on_one_thread_pool(artifacts):
    """`mobc run` as its own process shares one intra-op pool between the target's and the draft's
    sessions (toolchain/runtime/sessions.py), and decodes what the policy decodes in this process."""
    import subprocess
    import sys

    from typer.testing import CliRunner

    from toolchain.cli.main import app

    target_dir, draft_dir = artifacts
    args = ["run", str(target_dir), "--prompt", PROMPTS[1], "--policy", "chain", "--draft", str(draft_dir),
            "--max-new-tokens", "12", "--threads", "2"]
    here = CliRunner().invoke(app, args)  # this process opened sessions already: pools of their own
    assert here.exit_code == 0, here.output
    code = ("import sys; from toolchain.runtime import sessions; from toolchain.cli.main import main; "
            "sys.argv = ['mobc', *sys.argv[1:]]\n"
            "try:\n    main()\nfinally:\n    print('shared' if sessions._threads['shared'] else 'own', file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith("shared")
    assert len(done.stdout) > len(PROMPTS[1]) and done.stdout == here.stdout  # the prompt and the same text
