"""On-policy prompts for draft training: self-written chat requests and the target's answers as windows."""

from __future__ import annotations

import torch

from tests.tiny import chat_tokenizer, eos_prone_model, tiny_model, tiny_tokenizer
from toolchain.train.onpolicy import interleave, prompt_continuations, self_chat_requests


def test_self_written_requests_end_their_turn_are_distinct_and_reproducible():
    tok = chat_tokenizer()
    model = eos_prone_model(tok)
    reqs = self_chat_requests(model, tok, 12, seed=0, batch=16, max_tokens=48)
    assert 0 < len(reqs) <= 12
    assert len(set(reqs)) == len(reqs) and all(len(r.split()) >= 4 for r in reqs)
    assert all("</s>" not in r and "<s>" not in r for r in reqs)  # the turn's end is cut off
    assert self_chat_requests(model, tok, 12, seed=0, batch=16, max_tokens=48) == reqs  # seeded
    assert self_chat_requests(model, tok, 12, seed=1, batch=16, max_tokens=48) != reqs


def test_a_tokenizer_without_a_chat_template_writes_no_requests():
    assert self_chat_requests(tiny_model("llama", 0), tiny_tokenizer(), 4, seed=0) == []


def test_answers_fill_the_window_after_the_whole_of_a_short_prompt():
    tok = tiny_tokenizer()
    model = tiny_model("llama", 0).eval()
    prompts = [list(range(10, 20)), list(range(30, 60)), list(range(5, 8))]  # 10, 30 and 3 tokens
    win = prompt_continuations(model, prompts, seq_len=24, keep_prompt=16, batch=4, seconds=1e9,
                               pad_id=tok.pad_token_id, min_prompt=8)
    assert win.shape == (2, 24)  # the 3-token prompt is skipped
    rows = {tuple(w[:10].tolist()) for w in win} | {tuple(w[:16].tolist()) for w in win}
    assert tuple(range(10, 20)) in rows  # a short prompt is kept whole
    assert tuple(range(44, 60)) in rows  # a long one keeps its last keep_prompt tokens
    short = next(w for w in win if w[0] == 10)  # kept whole: the same context as in the batch
    ref = model.generate(short[None, :10], attention_mask=torch.ones(1, 10, dtype=torch.long), max_new_tokens=14,
                         min_new_tokens=14, do_sample=False, pad_token_id=tok.pad_token_id)
    assert short.tolist() == ref[0].tolist()  # the target's own greedy answer, unpadded


def test_interleave_takes_one_of_each_until_each_runs_out():
    assert interleave([1, 2, 3], ["a"], [10, 20]) == [1, "a", 10, 2, 20, 3]


def test_openers_start_each_batch_of_requests_in_turn():
    tok = chat_tokenizer()
    model = eos_prone_model(tok)
    said: list[str] = []
    asked, generate = [], model.generate
    model.generate = lambda x, **kw: asked.append(tok.decode(x[0])) or generate(x, **kw)
    reqs = self_chat_requests(model, tok, 40, seed=0, batch=8, max_tokens=48, openers=("alpha", "beta"),
                              log=said.append)
    starts = [next((o for o in ("alpha", "beta") if r.startswith(o)), None) for r in reqs]
    assert reqs and None not in starts  # the opener is part of the request
    assert set(starts) == {"alpha", "beta"}
    assert [a[-5:] for a in asked[:3]] == ["alpha", "\nbeta", "alpha"]  # the target continues each batch's opener
    assert said and said[-1].startswith(f"self-written chat requests: {len(reqs)}/40")
