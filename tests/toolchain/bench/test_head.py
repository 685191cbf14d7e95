"""`mobc bench head` on a tiny target: each head's chains are counted on the target's own greedy answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cli_main import run_main
from tests.tiny import save_tiny, write_recipe
from toolchain.bench.head import (
    CONFIDENCE,
    confidence_cells,
    first_drafts_by_confidence,
    head_labels,
    prompt_sets,
    table_rows,
)
from toolchain.bench.prompts import encode, load_prompts
from toolchain.bench.replay import head_distribution, replay_chain, tokens_per_call
from toolchain.compile.head import load_head
from toolchain.train.head import chain_acceptance, draft_chains, load_target
from toolchain.train.head_model import DraftHead, save_head


def test_prompt_sets_name_each_set_and_keep_repeated_kinds_apart():
    assert prompt_sets("humaneval:20+chat:24") == {"humaneval": "humaneval:20", "chat": "chat:24"}
    assert prompt_sets("file:a.txt+file:b.txt+chat:2") == {"file:a.txt": "file:a.txt", "file:b.txt": "file:b.txt",
                                                            "chat": "chat:2"}


def test_the_rows_add_answers_by_their_chains_and_take_ratios_to_the_first_head_only():
    def answer(rounds, accepted, depth1, tokens, in_vocab):
        return {"rounds": rounds, "accepted": accepted, "at_depth": [depth1, 0.0], "answer_tokens": tokens,
                "in_vocab": in_vocab, "by_confidence": [[tokens, in_vocab - 1], *[[k, k // 2] for k in range(4)]]}

    per = {("a", "h1"): [answer(0, 0.0, 0.0, 1, 1)], ("a", "h2"): [answer(2, 1.0, 1.0, 3, 2)],  # h1: too short
           ("b", "h1"): [answer(4, 2.0, 2.0, 8, 8), answer(6, 6.0, 4.0, 10, 9)],
           ("b", "h2"): [answer(4, 4.0, 3.0, 8, 8), answer(6, 3.0, 3.0, 10, 10)]}
    rows = {(r["set"], r["head"]): r for r in table_rows(per, ["a", "b"], ["h1", "h2"], 2)}
    assert rows[("a", "h1")]["tokens_per_call"] is None and rows[("a", "h2")]["tokens_per_call"] == 1.5
    assert rows[("a", "h2")]["vs_first"] is None  # not a ratio to itself
    assert rows[("b", "h1")]["tokens_per_call"] == pytest.approx(1.8) and rows[("b", "h1")]["vs_first"] == 1
    assert rows[("b", "h2")]["tokens_per_call"] == pytest.approx(1.7)
    assert rows[("b", "h2")]["vs_first"] == pytest.approx(1.7 / 1.8)
    assert rows[("b", "h1")]["accept_at_depth"] == pytest.approx([0.6, 0.0])
    assert rows[("all", "h2")]["vocab_coverage"] == pytest.approx(20 / 21) and rows[("all", "h2")]["rounds"] == 12
    assert rows[("all", "h2")]["tokens_per_call"] == pytest.approx(1 + 8 / 12)
    # first drafts by the target's confidence: each bucket's positions and accepted drafts added up
    assert rows[("all", "h2")]["first_draft_by_confidence"] == [[21, 17], [0, 0], [3, 0], [6, 3], [9, 3]]
    assert rows[("a", "h1")]["first_draft_by_confidence"] == [[1, 0], [0, 0], [1, 0], [2, 1], [3, 1]]


def test_first_drafts_are_split_by_the_targets_confidence_in_the_token_they_guess():
    first = torch.tensor([5, 1, 2, 3, 9, 7])  # first[s] guesses the target's token after row s
    greedy = torch.tensor([0, 1, 2, 4, 9, 8])
    confidence = torch.tensor([0.99, 0.1, 0.3, 0.95, 0.5, 0.2])
    # rows 1..4 (the last row has no token after it in the answer; row 0 is before the start): a bucket's lower
    # edge is in it (0.3 and 0.5 open theirs), and only row 3's draft is wrong
    assert first_drafts_by_confidence(first, greedy, confidence, 1) == [[1, 1], [1, 1], [1, 1], [0, 0], [1, 0]]
    assert len(CONFIDENCE) == 6
    assert confidence_cells([[10, 4], [0, 0], [30, 30]]) == {"conf0": "0.400 of 25%", "conf1": None,
                                                              "conf2": "1.000 of 75%"}


def test_heads_are_labelled_by_their_folders_unless_two_share_a_name():
    assert head_labels([Path("a/h0"), Path("b/h1/head.safetensors"), Path("c/best.safetensors")]) == [
        "h0", "h1", "best.safetensors"]
    same = [Path("a/h"), Path("b/h/head.safetensors")]
    assert head_labels(same) == ["a/h", "b/h/head.safetensors"]


def _answer(target, tok, prompt, max_new):
    """The target's prompt + greedy answer [1, T] to one prompt, and the prompt's length."""
    ids = torch.tensor([encode(tok, prompt)])
    with torch.no_grad():
        seq = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                              pad_token_id=tok.eos_token_id)
    return seq, ids.shape[1]


def _expected(target, tok, head, spec, max_new, gamma):
    """Tokens per call and chains of `head` on `spec`'s answers, one answer at a time, without the bench's code."""
    total, rounds = 0.0, 0
    for prompt in load_prompts(spec):
        seq, plen = _answer(target, tok, prompt, max_new)
        with torch.no_grad():
            states = target.model(seq).last_hidden_state
            greedy = target.lm_head(states).argmax(-1)
        acc = chain_acceptance(head, seq, states, greedy, plen, gamma)  # drafts from the 2nd answer token on
        total += (acc["tokens_per_call"] - 1) * acc["rounds"]
        rounds += acc["rounds"]
    return 1 + total / rounds, rounds


def test_the_bench_counts_each_heads_chains_on_the_targets_answers(tmp_path):
    hf = save_tiny(tmp_path / "hf", "llama")
    recipe = write_recipe(tmp_path / "t.yaml", hf)
    target, tok, _, _ = load_target(recipe)
    heads = []
    for seed, vocab in ((0, torch.arange(0, 512)), (1, torch.arange(0, 512, 2))):  # the second drafts no odd token
        torch.manual_seed(seed)
        head = DraftHead(target, vocab, init_layer=-1).float().eval()
        head.config._attn_implementation = "sdpa"
        (tmp_path / f"h{seed}").mkdir()
        save_head(head, tmp_path / f"h{seed}" / "head.safetensors")
        heads.append(load_head(target, tmp_path / f"h{seed}" / "head.safetensors"))  # its fp16 weights, as the bench
    (tmp_path / "code.txt").write_text("def add(a, b):\n---\nclass Stack:\n    def push(self, x):\n---\nimport os\n")
    (tmp_path / "text.txt").write_text("The cat sat on the\n---\nWrite a short poem about\n")
    spec = f"file:{tmp_path / 'code.txt'}+file:{tmp_path / 'text.txt'}"
    out = tmp_path / "r.json"
    # an on-policy cache as a training reads it: windows of a 6-token prompt and its answer
    windows = torch.randint(0, 512, (5, 20), generator=torch.Generator().manual_seed(3))
    torch.save({"key": {"prompt_len": 6, "seq_len": 20}, "app": windows.to(torch.int32)}, tmp_path / "r1.pt")
    # the first head as its folder, the second as its file
    r = run_main("bench", "head", tmp_path / "h0", tmp_path / "h1" / "head.safetensors", "--recipe", recipe,
                 "--prompts", spec, "--max-new-tokens", "24", "--gamma", "3", "--windows", f"{tmp_path / 'r1.pt'}:3",
                 "--json", out)
    assert r.code == 0, r.err
    assert "tokens/target call" in r.out and "vs first head" in r.out and "as chain+lookup runs" in r.out
    assert "first drafts by the target's own probability" in r.out and "p ≥ 0.9" in r.out
    res = json.loads(out.read_text())
    rows = {(row["set"], row["head"]): row for row in res["rows"]}
    labels = ["h0", "h1"]  # the folder's name, the file's folder's name
    assert res["heads"] == {"h0": str(tmp_path / "h0"), "h1": str(tmp_path / "h1" / "head.safetensors")}
    assert {s for s, _ in rows} == {*prompt_sets(spec), "all", "r1.pt"} and res["answers"] == 5
    for head, label in zip(heads, labels, strict=True):  # windows 0, 2 and 4, evenly spaced; in no "all" row
        picked = windows[[0, 2, 4]]
        with torch.no_grad():
            states = target.model(picked).last_hidden_state
        acc = chain_acceptance(head, picked, states, target.lm_head(states).argmax(-1), 6, 3)
        assert rows[("r1.pt", label)]["rounds"] == acc["rounds"] == 3 * (20 - 3 - 1 - 6)  # starts 6..15 per window
        assert rows[("r1.pt", label)]["tokens_per_call"] == pytest.approx(acc["tokens_per_call"], abs=1e-5)
    for head, label in zip(heads, labels, strict=True):
        want = {name: _expected(target, tok, head, part, 24, 3) for name, part in prompt_sets(spec).items()}
        for name, (tpc, n) in want.items():
            assert rows[(name, label)]["rounds"] == n
            assert rows[(name, label)]["tokens_per_call"] == pytest.approx(tpc, abs=1e-5)
        n_all = sum(n for _, n in want.values())
        assert rows[("all", label)]["rounds"] == n_all
        assert rows[("all", label)]["tokens_per_call"] == pytest.approx(
            sum(t * n for t, n in want.values()) / n_all, abs=1e-5)
    # every prompt's answer and the target's states over it, once for the checks below
    seqs = []
    for part in prompt_sets(spec).values():
        for p in load_prompts(part):
            seq, plen = _answer(target, tok, p, 24)
            with torch.no_grad():
                seqs.append((seq, plen, target.model(seq).last_hidden_state))
    # first drafts by the target's confidence: every answer row but the last, each once, counted accepted where
    # the head's first draft is the target's greedy token
    for head, label in zip(heads, labels, strict=True):
        n = ok = 0
        for seq, plen, states in seqs:
            with torch.no_grad():
                greedy = target.lm_head(states).argmax(-1)[0]
            chains, _ = draft_chains(head, seq, states, 1)
            n += seq.shape[1] - 1 - plen
            ok += int((chains[0, 0, plen:-1] == greedy[plen:-1]).sum())
        buckets = rows[("all", label)]["first_draft_by_confidence"]
        assert [sum(b[i] for b in buckets) for i in (0, 1)] == [n, ok] and n > 0
    first, second = rows[("all", labels[0])], rows[("all", labels[1])]
    assert first["tokens_per_call"] != second["tokens_per_call"]  # two heads that differ: the check compares something
    assert first["tokens_per_call"] > 1 or second["tokens_per_call"] > 1
    assert first["vs_first"] == 1 and second["vs_first"] == pytest.approx(second["tokens_per_call"] / first["tokens_per_call"])
    assert all(len(row["accept_at_depth"]) == 3 for row in res["rows"])
    # the second head's vocabulary is the even tokens: its coverage is the answers' share of even tokens
    assert first["vocab_coverage"] == 1 and 0 < second["vocab_coverage"] < 1
    # the tokens a run drafts: the first answer token comes from the target's prefill
    answers = [seq[0, plen + 1 :] for seq, plen, _ in seqs]
    assert second["vocab_coverage"] == pytest.approx(sum(int((a % 2 == 0).sum()) for a in answers)
                                                      / sum(len(a) for a in answers))

    # the replayed runs: chain's defaults (extension at 0.8 up to an 8-row graph; with lookup, runs from a
    # 3-token match), with and without lookup, over
    # the same answers (the replay itself is checked against the runtime's chain in test_replay.py)
    for head, label in zip(heads, labels, strict=True):
        for lookup, key in ((False, "run:chain"), (True, "run:chain+lookup")):
            pairs = []
            for seq, plen, states in seqs:
                chains, hidden = draft_chains(head, seq, states, 7)
                rounds = replay_chain(seq[0], plen, chains[0], head_distribution(head, hidden[0]), head.vocab_ids,
                                      3, 0.8, 7, lookup, 3 if lookup else 0)
                pairs.append((seq.shape[1] - plen, rounds))
            assert rows[("all", label)][key] == pytest.approx(tokens_per_call(pairs)), key

def test_the_bench_names_a_missing_head_a_repeated_head_and_a_missing_recipe(tmp_path):
    recipe = write_recipe(tmp_path / "t.yaml", tmp_path / "hf")
    r = run_main("bench", "head", tmp_path / "none", "--recipe", recipe)
    assert r.clean_error and f"no head at {tmp_path / 'none'}" in r.err
    (tmp_path / "h").mkdir()
    r = run_main("bench", "head", tmp_path / "h", tmp_path / "h" / "head.safetensors", "--recipe", recipe)
    assert r.clean_error and "the same head is given twice" in r.err
    r = run_main("bench", "head", tmp_path / "h", "--recipe", tmp_path / "none.yaml")
    assert r.clean_error and "none.yaml: no such recipe" in r.err
    (tmp_path / "h" / "head.safetensors").write_bytes(b"")
    r = run_main("bench", "head", tmp_path / "h", "--recipe", recipe, "--prompts", "poems:3")
    assert r.clean_error and "--prompts 'poems:3'" in r.err  # refused before the (here missing) target loads
    r = run_main("bench", "head", tmp_path / "h", "--recipe", recipe, "--windows", tmp_path / "r1.pt")
    assert r.clean_error and f"--windows {tmp_path / 'r1.pt'}: no such file" in r.err
    torch.save({"key": {"prompt_len": 2}, "app": torch.zeros(3, 8, dtype=torch.int32)}, tmp_path / "r1.pt")
    r = run_main("bench", "head", tmp_path / "h", "--recipe", recipe, "--windows", f"{tmp_path / 'r1.pt'}:0")
    assert r.clean_error and "give FILE or FILE:N with N >= 1" in r.err
    r = run_main("bench", "head", tmp_path / "h", "--recipe", recipe, "--windows", tmp_path / "r1.pt",
                 "--windows", f"{tmp_path / 'r1.pt'}:2")
    assert r.clean_error and "the same cache is given twice" in r.err
