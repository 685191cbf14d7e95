"""`mobc train draft --kind head` on a tiny target: the saved head loads for its target and is measured."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.tiny import chat_tokenizer, eos_prone_model, save_tiny, write_recipe
from toolchain.compile.head import load_head
from toolchain.train.draft import DraftTrainError
from toolchain.train.head import (
    HEAD_FILE,
    REPORT_FILE,
    EndOfTurn,
    HeadConfig,
    cached_onpolicy,
    cached_teacher,
    chain_acceptance,
    draft_chains,
    draft_vocabulary,
    end_of_turn,
    extra_onpolicy,
    gather_rows_in_place,
    generate_onpolicy,
    greedy_tokens,
    head_losses,
    held_out_sample,
    held_out_table,
    onpolicy_data,
    round0_windows,
    rows_until_end,
    train_head,
    training_loss,
    vocab_coverage,
)
from toolchain.train.head_model import DraftHead, grow
from toolchain.train.onpolicy import self_chat_requests


def test_greedy_tokens_in_chunks_are_the_argmax_of_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    states, lm_head = torch.randn(5, 6, 8, generator=g), torch.randn(40, 8, generator=g)
    want = (states @ lm_head.T).argmax(-1)
    for rows in (1, 2, 4, 8):  # chunks that divide the batch, leave a remainder, and exceed it
        assert torch.equal(greedy_tokens(states, lm_head, rows), want)
    assert greedy_tokens(states[:0], lm_head).shape == (0, 6)


def test_vocab_coverage_counts_the_answer_tokens_of_each_window():
    greedy = torch.tensor([[9, 9, 1, 2, 3, 9], [9, 1, 4, 2, 9, 9]])  # after positions 0..5; answers at 3, 4, 5
    assert vocab_coverage(greedy, torch.tensor([1, 2, 3]), prompt_len=3) == pytest.approx(4 / 6)  # 1 2 3 | 4 2 9


def test_draft_vocabulary_keeps_the_most_frequent_tokens_and_eos():
    streams = [np.array([5, 5, 5, 7, 7, 9, 1, 1, 1, 1])]
    assert draft_vocabulary(streams, 3, 16, always=[2]).tolist() == [1, 2, 5]  # eos 2 ranks first, then 1, 5
    assert draft_vocabulary(streams, 100, 16, always=[2]).tolist() == list(range(16))


def test_a_short_training_run_writes_a_head_its_target_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = save_tiny(tmp_path / "hf", "llama")
    recipe = write_recipe(tmp_path / "t.yaml", hf)
    cfg = HeadConfig(minutes=0.5, corpus_tokens=4096, generated_windows=2, held_out_windows=1, seq_len=64,
                     prompt_len=16, draft_vocab=128, answer_batch=8,  # a small first batch: the budget is 30 s
                     onpolicy_cache=str(tmp_path / "scratch" / "gen.pt"))
    report = train_head(recipe, tmp_path / "head", cfg, log=lambda _m: None)
    assert report["steps"] > 0 and report["loss_last"] < report["loss_first"]
    assert report["draft_vocab"] == 128 and 0 < report["vocab_coverage_held_out"] <= 1
    held = report["held_out"]
    assert 1.0 <= held["tokens_per_call"] <= 1 + cfg.gamma and held["rounds"] > 0
    written = json.loads((tmp_path / "head" / REPORT_FILE).read_text())
    assert written["steps"] == report["steps"]
    assert written["config"]["onpolicy_cache"] == "gen.pt"  # the file's name, not this machine's path
    head = load_head(AutoModelForCausalLM.from_pretrained(hf).float(), tmp_path / "head" / HEAD_FILE)
    assert len(head.vocab_ids) == 128


def _windows(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"gen": torch.randint(0, 100, (2, 8), generator=g), "gen_held": torch.randint(0, 100, (1, 8), generator=g),
            "app": torch.randint(0, 100, (3, 8), generator=g), "requests": ["write a poem about rain"],
            "held_sets": {"app": torch.randint(0, 100, (1, 8), generator=g)}}


def test_the_onpolicy_cache_is_written_once_then_read_and_refused_for_other_settings(tmp_path):
    cache = tmp_path / "c" / "onpolicy.pt"
    cfg = HeadConfig(onpolicy_cache=str(cache))
    first, read = cached_onpolicy(cfg, "t", lambda _m: None, lambda: _windows(0))
    assert not read and [p.name for p in cache.parent.iterdir()] == [cache.name]  # no partial file beside it

    def must_not_generate():
        raise AssertionError("generated although the cache holds these windows")

    again, read = cached_onpolicy(cfg, "t", lambda _m: None, must_not_generate)
    assert read  # the teacher pass then gets the generation's freed time
    assert torch.equal(again["app"], first["app"]) and again["requests"] == first["requests"]
    assert torch.equal(again["held_sets"]["app"], first["held_sets"]["app"])
    with pytest.raises(DraftTrainError, match=r"--seed 0 \(this run: 1\)"):
        cached_onpolicy(HeadConfig(onpolicy_cache=str(cache), seed=1), "t", lambda _m: None, must_not_generate)
    with pytest.raises(DraftTrainError, match="--self-chat"):  # decides which prompts are answered
        cached_onpolicy(HeadConfig(onpolicy_cache=str(cache), self_chat=5), "t", lambda _m: None, must_not_generate)
    with pytest.raises(DraftTrainError, match="target"):
        cached_onpolicy(cfg, "another target", lambda _m: None, must_not_generate)
    with pytest.raises(DraftTrainError, match=r"with other settings: prompt_len 64 \(this run: 32\)"):  # no option
        cached_onpolicy(HeadConfig(onpolicy_cache=str(cache), prompt_len=32), "t", lambda _m: None, must_not_generate)
    assert torch.equal(torch.load(cache, weights_only=True)["app"], first["app"])  # refused, not overwritten
    assert cached_onpolicy(HeadConfig(), "t", lambda _m: None, lambda: _windows(3))[0]["app"].shape == (3, 8)


def test_the_teacher_cache_reads_the_windows_it_holds_and_computes_only_the_others(tmp_path):
    cache = tmp_path / "c" / "teacher.pt"
    cfg = HeadConfig(teacher_cache=str(cache))
    windows = torch.randint(0, 100, (3, 8), generator=torch.Generator().manual_seed(0))
    full = torch.randn(3, 8, 4)
    asked: list[torch.Tensor] = []

    def teacher(stop_after: int):
        def compute(w):  # each window's states are its own (full's row), as a real pass's are
            asked.append(w.clone())
            rows = [next(i for i in range(3) if torch.equal(windows[i], r)) for r in w]
            return full[rows][:stop_after]
        return compute

    said: list[str] = []
    kept, first = cached_teacher(cfg, "t", windows, said.append, teacher(2))  # out of time after 2 of the 3
    assert torch.equal(kept, windows[:2]) and torch.equal(first, full[:2].half())  # the rows the file keeps
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]
    saved = torch.load(cache, weights_only=True)
    assert saved["states"].dtype == torch.float16 and saved["windows"].dtype == torch.int32  # half the bytes
    asked.clear()
    kept, again = cached_teacher(cfg, "t", windows.clone(), said.append, teacher(3))
    assert len(asked) == 1 and torch.equal(asked[0], windows[2:])  # the pass ran over the missing window only
    assert torch.equal(kept, windows) and again.dtype == torch.float16  # as the file keeps them, new rows too
    torch.testing.assert_close(again.float(), full, rtol=1e-3, atol=1e-3)  # in the run's order, read and new alike
    assert torch.equal(again[2], torch.load(cache, weights_only=True)["states"][2])  # the new row as written
    assert "for 2 of 3 windows; the pass runs over the other 1" in said[-2]
    assert said[-1].endswith("(3 windows, 1 new)")

    def must_not_compute(_w):
        raise AssertionError("the teacher ran although the cache holds its states for these windows")

    kept, third = cached_teacher(cfg, "t", windows[[2, 0]], said.append, must_not_compute)
    assert third.dtype == torch.float16  # no fp32 copy of a whole file's states: the training widens each batch
    torch.testing.assert_close(third.float(), full[[2, 0]], rtol=1e-3, atol=1e-3)
    assert said[-1].endswith("(2 windows; teacher pass skipped)")
    other = windows.clone()
    other[0, 7] += 1  # one token of one window differs: that window is another one
    asked.clear()
    full[0] = torch.randn(8, 4)
    windows[0] = other[0]
    kept, fourth = cached_teacher(cfg, "t", other, said.append, teacher(3))
    assert len(asked) == 1 and torch.equal(asked[0], other[:1])
    assert torch.equal(kept, other)  # the new window first, as in the run, before the two read ones
    torch.testing.assert_close(fourth.float(), full, rtol=1e-3, atol=1e-3)
    assert len(torch.load(cache, weights_only=True)["windows"]) == 4  # the file keeps both versions
    before = torch.load(cache, weights_only=True)["states"]
    with pytest.raises(DraftTrainError, match=r"another run \(--teacher-precision\)"):
        cached_teacher(HeadConfig(teacher_cache=str(cache), teacher_precision="bf16"), "t", windows, said.append,
                       must_not_compute)
    with pytest.raises(DraftTrainError, match=r"another run \(the target\)"):
        cached_teacher(cfg, "another target", windows, said.append, must_not_compute)
    with pytest.raises(DraftTrainError, match="holds 8-token windows \\(this run: --seq-len 4\\)"):
        cached_teacher(cfg, "t", windows[:, :4], said.append, must_not_compute)
    assert torch.equal(torch.load(cache, weights_only=True)["states"], before)  # refused, not overwritten
    junk = tmp_path / "junk.pt"
    torch.save({"key": {}, "states": before}, junk)  # as an older mobc wrote it: no windows
    with pytest.raises(DraftTrainError, match="not a teacher cache this command wrote"):
        cached_teacher(HeadConfig(teacher_cache=str(junk)), "t", windows, said.append, must_not_compute)
    kept, states = cached_teacher(HeadConfig(), "t", windows, said.append, teacher(2))  # no cache: no file
    assert torch.equal(kept, windows[:2]) and len(states) == 2



def test_a_new_teacher_cache_keeps_the_passs_states_without_a_second_copy(tmp_path):
    """A run with nothing to read hands back the pass's own tensor (fp16: train_head asks the pass for what the
    file keeps): for 7274 windows a copy was 4.3 GB more (measured on 1.18 GB of states: 3.46 GB above the
    start before, 1.74 GB after)."""
    windows = torch.arange(24).reshape(6, 4)
    made = torch.randn(6, 4, 3).half()
    cfg = HeadConfig(teacher_cache=str(tmp_path / "t.pt"))
    kept, states = cached_teacher(cfg, "tiny", windows, lambda _m: None, lambda w: made[: len(w)])
    assert states.data_ptr() == made.data_ptr() and torch.equal(kept, windows)
    kept, states = cached_teacher(cfg, "tiny", windows, lambda _m: None, lambda w: 1 / 0)  # all read back
    assert torch.equal(states, torch.load(tmp_path / "t.pt", weights_only=True)["states"])  # the file's fp16 rows
    assert torch.equal(states, made) and torch.equal(kept, windows)

def test_rows_are_gathered_in_the_tensors_own_memory():
    g = torch.Generator().manual_seed(0)
    for n, k in ((1, 1), (7, 7), (9, 5), (30, 12)):
        t = torch.randn(n, 3, 2, generator=g).half()
        order = torch.randperm(n, generator=g)[:k].tolist()
        want, ptr = t[order].clone(), t.data_ptr()
        got = gather_rows_in_place(t, order)
        assert torch.equal(got, want) and got.data_ptr() == ptr  # the rows asked for, no second tensor
    t = torch.randn(4, 3, generator=g)
    assert torch.equal(gather_rows_in_place(t.clone(), [2, 0, 2, 3, 1]), t[[2, 0, 2, 3, 1]])  # a row asked twice


def test_a_file_that_is_no_onpolicy_cache_is_refused_by_name(tmp_path):
    junk = tmp_path / "notes.pt"
    junk.write_text("not a cache")
    with pytest.raises(DraftTrainError, match="not a cache this command wrote"):
        cached_onpolicy(HeadConfig(onpolicy_cache=str(junk)), "t", lambda _m: None, lambda: _windows(0))
    assert junk.read_text() == "not a cache"
    torch.save(torch.zeros(3), junk)  # a loadable file of another kind
    with pytest.raises(DraftTrainError, match="not a cache this command wrote"):
        cached_onpolicy(HeadConfig(onpolicy_cache=str(junk)), "t", lambda _m: None, lambda: _windows(0))


def test_the_cache_stores_int32_token_ids_and_hands_back_int64(tmp_path):
    cache = tmp_path / "onpolicy.pt"
    cached_onpolicy(HeadConfig(onpolicy_cache=str(cache)), "t", lambda _m: None, lambda: _windows(0))
    saved = torch.load(cache, weights_only=True)
    assert saved["app"].dtype == torch.int32 and saved["held_sets"]["app"].dtype == torch.int32  # half the bytes
    again, read = cached_onpolicy(HeadConfig(onpolicy_cache=str(cache)), "t", lambda _m: None, lambda: {})
    assert read and again["app"].dtype == torch.int64 and again["held_sets"]["app"].dtype == torch.int64
    assert again["app"].tolist() == _windows(0)["app"].tolist()


def test_a_cache_written_before_a_setting_existed_reads_as_that_settings_default(tmp_path):
    cache = tmp_path / "onpolicy.pt"
    cached_onpolicy(HeadConfig(onpolicy_cache=str(cache)), "t", lambda _m: None, lambda: _windows(0))
    saved = torch.load(cache, weights_only=True)
    del saved["key"]["self_chat_openers"]  # as the shipped head's cache was written
    torch.save(saved, cache)
    assert cached_onpolicy(HeadConfig(onpolicy_cache=str(cache)), "t", lambda _m: None, lambda: {})[1]
    with pytest.raises(DraftTrainError, match=r"--self-chat-openers False \(this run: True\)"):
        cached_onpolicy(HeadConfig(onpolicy_cache=str(cache), self_chat_openers=True), "t", lambda _m: None,
                        lambda: {})


def test_generate_only_writes_the_cache_a_training_run_then_reads(tmp_path):
    hf = save_tiny(tmp_path / "hf", "llama")
    recipe = write_recipe(tmp_path / "t.yaml", hf)
    cfg = HeadConfig(corpus_tokens=4096, generated_windows=2, held_out_windows=1, seq_len=64, prompt_len=16,
                     answer_batch=8, onpolicy_cache=str(tmp_path / "gen.pt"))
    said: list[str] = []
    counts = generate_onpolicy(recipe, cfg, log=said.append)
    assert counts["app_windows"] > 0 and counts["stdlib_continuations"] == 2
    assert any(m.startswith("answers: ") for m in said)  # generation reports its progress
    with pytest.raises(DraftTrainError, match="--onpolicy-cache"):
        generate_onpolicy(recipe, HeadConfig(), log=said.append)
    run = HeadConfig(**{**cfg.__dict__, "minutes": 0.2, "draft_vocab": 64, "teacher_precision": "bf16",
                        "teacher_cache": str(tmp_path / "teacher.pt")})
    report = train_head(recipe, tmp_path / "head", run, log=said.append)
    assert report["app_windows"] == counts["app_windows"]
    assert any("generation skipped" in m for m in said)
    assert report["config"]["teacher_cache"] == "teacher.pt"  # the file's name, not this machine's path
    assert any(m.startswith("teacher states written to") for m in said)
    said.clear()
    again = train_head(recipe, tmp_path / "head2", run, log=said.append)  # the same windows: the pass is skipped
    assert any("teacher pass skipped" in m for m in said) and again["train_windows"] == report["train_windows"]



def test_a_run_of_fixed_steps_makes_the_same_head_twice(tmp_path):
    """--steps: the step count and the lr schedule follow the steps, not the clock, so a slower or busier machine
    trains the same head (a run by the clock would differ in both)."""
    from safetensors.torch import load_file

    hf = save_tiny(tmp_path / "hf", "llama")
    recipe = write_recipe(tmp_path / "t.yaml", hf)
    cfg = HeadConfig(steps=7, corpus_tokens=4096, generated_windows=2, held_out_windows=1, seq_len=64, prompt_len=16,
                     answer_batch=8, draft_vocab=64, onpolicy_cache=str(tmp_path / "gen.pt"))
    first = train_head(recipe, tmp_path / "a", cfg, log=lambda _m: None)
    assert first["steps"] == 7 and first["config"]["steps"] == 7 and first["config"]["minutes"] is None
    again = train_head(recipe, tmp_path / "b", cfg, log=lambda _m: None)
    assert again["steps"] == 7 and again["loss_last"] == first["loss_last"]
    a, b = load_file(tmp_path / "a" / HEAD_FILE), load_file(tmp_path / "b" / HEAD_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

def test_a_training_stopped_midway_resumes_from_its_checkpoint_to_the_same_head(tmp_path, monkeypatch):
    """--checkpoint: a rerun after a stop goes on from the saved step and writes the head an unstopped run
    writes; the file goes once the head is written, and a run with other settings is refused it."""
    from safetensors.torch import load_file

    from toolchain.train import head as head_mod
    from toolchain.train.checkpoint import CheckpointError

    hf = save_tiny(tmp_path / "hf", "llama")
    recipe = write_recipe(tmp_path / "t.yaml", hf)
    ckpt = tmp_path / "state.pt"
    cfg = HeadConfig(steps=9, corpus_tokens=4096, generated_windows=2, held_out_windows=1, seq_len=64, prompt_len=16,
                     answer_batch=8, draft_vocab=64, onpolicy_cache=str(tmp_path / "gen.pt"), head_layers=2)
    whole = train_head(recipe, tmp_path / "whole", cfg, log=lambda _m: None)
    stopped = HeadConfig(**{**cfg.__dict__, "checkpoint": str(ckpt), "checkpoint_seconds": 0.0})
    real_loss, calls = head_mod.training_loss, []

    def stop_at_six(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(head_mod, "training_loss", stop_at_six)
    with pytest.raises(KeyboardInterrupt):
        train_head(recipe, tmp_path / "resumed", stopped, log=lambda _m: None)
    monkeypatch.setattr(head_mod, "training_loss", real_loss)
    assert torch.load(ckpt, weights_only=True)["step"] == 5 and not (tmp_path / "resumed").exists()
    other = HeadConfig(**{**stopped.__dict__, "lr": 2e-3})
    with pytest.raises(CheckpointError, match="differs in lr"):
        train_head(recipe, tmp_path / "other", other, log=lambda _m: None)
    lines: list[str] = []
    resumed = train_head(recipe, tmp_path / "resumed", stopped, log=lines.append)
    assert any("resumed from" in m and "at step 5" in m for m in lines)
    assert resumed["steps"] == 9 and resumed["loss_last"] == whole["loss_last"] and not ckpt.exists()
    a, b = load_file(tmp_path / "whole" / HEAD_FILE), load_file(tmp_path / "resumed" / HEAD_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(DraftTrainError, match="--checkpoint: a run resumes step for step"):
        train_head(recipe, tmp_path / "timed", HeadConfig(**{**stopped.__dict__, "steps": None, "minutes": 0.5}),
                   log=lambda _m: None)


def test_init_goes_on_training_the_saved_head_with_its_layers_and_vocabulary(tmp_path):
    """--init: a run starts from the saved head's weights and draft vocabulary (not a fresh head over the
    settings' vocabulary size and layer count), and the report names the file it went on from."""
    from safetensors.torch import load_file

    from toolchain.artifact.integrity import sha256_path

    hf = save_tiny(tmp_path / "hf", "llama")
    recipe = write_recipe(tmp_path / "t.yaml", hf)
    cfg = HeadConfig(steps=12, corpus_tokens=4096, generated_windows=2, held_out_windows=1, seq_len=64, prompt_len=16,
                     answer_batch=8, draft_vocab=64, head_layers=2, onpolicy_cache=str(tmp_path / "gen.pt"))
    train_head(recipe, tmp_path / "first", cfg, log=lambda _m: None)
    saved, saved_sha = load_file(tmp_path / "first" / HEAD_FILE), sha256_path(tmp_path / "first" / HEAD_FILE)
    more = HeadConfig(**{**cfg.__dict__, "steps": 3, "draft_vocab": 32, "head_layers": 1,
                         "init": str(tmp_path / "first")})
    lines: list[str] = []
    went_on = train_head(recipe, tmp_path / "first", more, log=lines.append)  # in place: --out is --init's folder
    continued = load_file(tmp_path / "first" / HEAD_FILE)
    assert torch.equal(continued["vocab_ids"], saved["vocab_ids"]) and continued.keys() == saved.keys()
    assert went_on["draft_vocab"] == 64 and went_on["config"]["head_layers"] == 2
    # three AdamW steps at lr 1e-3 move each weight by a few thousandths from the saved head's
    drift = max(float((continued[k].float() - saved[k].float()).abs().max()) for k in saved if k != "vocab_ids")
    assert drift < 0.01
    assert went_on["config"]["init"] == "first"
    assert went_on["init_sha256"] == saved_sha  # the head it went on from, not the one it wrote over it
    assert any("continuing" in m and "2 layers" in m for m in lines)
    grown = train_head(recipe, tmp_path / "grown", HeadConfig(**{**more.__dict__, "head_layers": 3}),
                       log=lambda _m: None)
    assert grown["config"]["head_layers"] == 3 and grown["init_layers"] == 2
    assert load_head(target_of(hf), tmp_path / "grown" / HEAD_FILE).config.num_hidden_layers == 3


def target_of(hf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf).float().eval()


def test_a_grown_head_drafts_as_before_and_its_new_layer_learns(tmp_path):
    """grow appends layers that start as the identity: the same features out, so the same drafts, and the
    new layer's output projections get gradients (a zeroed layer that could not learn would stay dead)."""
    target = target_of(save_tiny(tmp_path / "hf", "llama"))
    torch.manual_seed(0)
    head = DraftHead(target, torch.arange(64), init_layer=-1, layers=2).eval()
    windows = torch.randint(0, 64, (2, 16))
    states = torch.randn(2, 16, target.config.hidden_size)
    positions = torch.arange(16)[None].expand(2, -1)
    before = head.forward_train(states, windows, positions, normalized=False)
    assert grow(head, 3) == 1 and grow(head, 2) == 0 and len(head.layers) == 3
    assert head.config.num_hidden_layers == 3
    after = head.forward_train(states, windows, positions, normalized=False)
    assert torch.allclose(before, after, atol=1e-6)
    new = head.layers[2]
    assert not torch.equal(new.self_attn.q_proj.weight, torch.zeros_like(new.self_attn.q_proj.weight))
    head.logits(after).logsumexp(-1).sum().backward()
    assert new.self_attn.o_proj.weight.grad.abs().max() > 0 and new.mlp.down_proj.weight.grad.abs().max() > 0


def test_bf16_training_runs_the_loss_in_bf16_close_to_fp32(tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "hf", "llama")).float().eval()
    torch.manual_seed(0)
    head = DraftHead(target, torch.arange(64), init_layer=None)
    windows = torch.randint(0, 64, (2, 16))
    states = torch.randn(2, 16, target.config.hidden_size)
    fp32 = training_loss(head, windows, states, HeadConfig(precision="fp32")).item()
    bf16 = training_loss(head, windows, states, HeadConfig(precision="bf16"))
    assert bf16.dtype == torch.float32  # the loss itself is reduced in fp32
    assert bf16.item() != fp32 and abs(bf16.item() - fp32) < 0.02 * abs(fp32)  # bf16 matmuls, same loss


def test_a_later_round_answers_only_new_self_written_requests():
    tok = chat_tokenizer()
    model = eos_prone_model(tok)
    cfg = HeadConfig(self_chat=6, seq_len=32, prompt_len=16, answer_batch=8, held_out_windows=1)
    first = onpolicy_data(model, tok, np.zeros(0, np.int64), np.zeros(0, np.int64),
                          HeadConfig(**{**cfg.__dict__, "onpolicy_round": 1}), float("inf"))
    assert len(first["requests"]) > 0 and len(first["app"]) == len(first["requests"])  # every request answered
    assert len(first["gen"]) == len(first["gen_held"]) == 0 and first["held_sets"] == {}  # round 0's alone
    second = onpolicy_data(model, tok, np.zeros(0, np.int64), np.zeros(0, np.int64),
                           HeadConfig(**{**cfg.__dict__, "onpolicy_round": 2}), float("inf"))
    round0 = set(self_chat_requests(model, tok, 7, seed=0))
    assert not set(first["requests"]) & set(second["requests"])  # each round writes other requests
    assert not set(first["requests"]) & round0


def _round(cache, round_: int, app: torch.Tensor, target: str = "t", **settings) -> None:
    cfg = HeadConfig(onpolicy_cache=str(cache), onpolicy_round=round_, **settings)
    cached_onpolicy(cfg, target, lambda _m: None, lambda: {**_windows(round_), "app": app})


def test_extra_rounds_add_their_new_windows_and_are_refused_when_they_do_not_fit(tmp_path):
    base = _windows(0)
    new = torch.randint(100, 200, (2, 8), generator=torch.Generator().manual_seed(5))
    # a known answer, a held-out answer (must stay out of training), two new ones, one of them twice
    _round(tmp_path / "r1.pt", 1, torch.stack([base["app"][0], base["held_sets"]["app"][0], new[0], new[1], new[0]]))
    _round(tmp_path / "r2.pt", 2, torch.stack([new[1], new[0] + 1]))
    known = round0_windows(base)
    said: list[str] = []
    cfg = HeadConfig(onpolicy_extra=(str(tmp_path / "r1.pt"), str(tmp_path / "r2.pt")))
    got = extra_onpolicy(cfg, "t", known, said.append)
    assert got.dtype == torch.long and got.tolist() == [new[0].tolist(), new[1].tolist(), (new[0] + 1).tolist()]
    assert said[0].endswith("2 from " + str(tmp_path / "r1.pt") + " (round 1; 3 already known)")

    def refused(match: str, path, **settings) -> None:
        with pytest.raises(DraftTrainError, match=match):
            extra_onpolicy(HeadConfig(onpolicy_extra=(str(path),), **settings), "t", known, said.append)

    _round(tmp_path / "r0.pt", 0, base["app"])
    refused("a round-0 cache", tmp_path / "r0.pt")
    _round(tmp_path / "other.pt", 1, new, target="another target")
    refused("not of 't'", tmp_path / "other.pt")
    refused(r"other shape: seq_len 256 \(this run: 128\)", tmp_path / "r1.pt", seq_len=128)
    refused("no such file", tmp_path / "missing.pt")
    with pytest.raises(DraftTrainError, match=r"the same round \(--seed 0 --onpolicy-round 1\)"):
        extra_onpolicy(HeadConfig(onpolicy_extra=(str(tmp_path / "r1.pt"),) * 2), "t", known, said.append)


def test_a_training_run_reads_extra_rounds_and_refuses_to_be_one(tmp_path):
    hf = save_tiny(tmp_path / "hf", "llama")
    recipe = write_recipe(tmp_path / "t.yaml", hf)
    cfg = HeadConfig(corpus_tokens=4096, generated_windows=2, held_out_windows=1, seq_len=64, prompt_len=16,
                     answer_batch=8, onpolicy_cache=str(tmp_path / "gen.pt"))
    generate_onpolicy(recipe, cfg, log=lambda _m: None)
    target = torch.load(tmp_path / "gen.pt", weights_only=True)["key"]["target"]
    extra = torch.randint(3, 100, (9, 64), generator=torch.Generator().manual_seed(1))
    _round(tmp_path / "r1.pt", 1, extra, target=target, seq_len=64, prompt_len=16)
    said: list[str] = []
    run = HeadConfig(**{**cfg.__dict__, "minutes": 0.2, "draft_vocab": 64, "onpolicy_extra": (str(tmp_path / "r1.pt"),),
                        "extra_held_out": 2})
    report = train_head(recipe, tmp_path / "head", run, log=said.append)
    assert report["extra_windows"] == 7 and report["config"]["onpolicy_extra"] == ["r1.pt"]  # 2 of 9 held out
    assert any(m.startswith("extra on-policy windows: 9 from") for m in said)
    held = report["held_out_extra"]
    assert held["rounds"] == 2 * (64 - 16 - cfg.gamma - 1)  # both held-out windows measured, from every start
    assert held["to_end_of_turn"]["rounds"] <= held["rounds"]  # also up to where the target ends each answer
    assert any("up to its end-of-turn" in m for m in said if m.startswith("held-out chain gamma=4 on the target's answers"))
    with pytest.raises(DraftTrainError, match="--onpolicy-round 1: a later round only writes"):
        train_head(recipe, tmp_path / "head2", HeadConfig(**{**cfg.__dict__, "onpolicy_round": 1}), log=said.append)
    with pytest.raises(DraftTrainError, match="--onpolicy-extra: extra rounds are read by a training run"):
        generate_onpolicy(recipe, run, log=said.append)
    assert not (tmp_path / "head2").exists()


def _chains_one_by_one(head, windows, states, gamma):
    """The chains drafted as the runtime drafts them: one start at a time, one causal pass per draft."""
    b, t = windows.shape
    out = torch.zeros(b, gamma, t, dtype=torch.long)
    hidden = torch.zeros(b, gamma, t, states.shape[-1])
    for s in range(t):
        feats = torch.cat([torch.zeros_like(states[:, :1]), states[:, :s]], 1)
        toks = windows[:, : s + 1]
        for a in range(gamma):
            g = head.forward_train(feats, toks, torch.arange(toks.shape[1])[None].expand(b, -1), normalized=True)
            d = head.vocab_ids[head.logits(g[:, -1]).argmax(-1)]
            out[:, a, s] = d
            hidden[:, a, s] = g[:, -1]
            feats = torch.cat([feats, head.norm(g[:, -1:])], 1)
            toks = torch.cat([toks, d[:, None]], 1)
    return out, hidden


def test_all_chains_in_gamma_passes_draft_what_one_chain_at_a_time_drafts(tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "hf", "llama")).float().eval()
    torch.manual_seed(0)
    head = DraftHead(target, torch.arange(0, 256, 2), init_layer=-1).eval()
    head.config._attn_implementation = "sdpa"
    windows = torch.randint(0, 256, (3, 20))
    states = torch.randn(3, 20, target.config.hidden_size)
    with torch.no_grad():
        want, want_hidden = _chains_one_by_one(head, windows, states, 3)
    got, hidden = draft_chains(head, windows, states, 3, rows=2)  # two blocks of windows
    assert torch.equal(got, want)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-4, atol=1e-4)  # the rows that drafted them, too
    assert len(set(want[:, 1:].flatten().tolist())) > 3  # the drafts vary: the check compares something
    # targets that take the first two drafts of the chains from even starts: those accept two or more
    targets = want[:, 0].clone()
    targets[:, 1::2] = want[:, 1, 0:-1:2]
    acc = chain_acceptance(head, windows, states, targets, 4, 3)
    starts = range(4, 20 - 3 - 1)
    counts = [int(want[b, 0, s] == targets[b, s]) * (1 + int(want[b, 1, s] == targets[b, s + 1])
              * (1 + int(want[b, 2, s] == targets[b, s + 2]))) for s in starts for b in range(3)]
    assert acc["rounds"] == len(counts) and acc["tokens_per_call"] == pytest.approx(1 + sum(counts) / len(counts))
    assert acc["accept_at_depth"] == pytest.approx([sum(c >= k for c in counts) / len(counts) for k in (1, 2, 3)])
    assert acc["accept_at_depth"][1] > 0 and acc["accept_at_depth"][0] < 1  # chains accept two drafts, others none
    # a run ends window 1 at row 8: starts after it do not count, nor drafts past it (start 8 took two)
    keep = torch.ones(3, 20, dtype=torch.bool)
    keep[1, 9:] = False
    cut = chain_acceptance(head, windows, states, targets, 4, 3, keep)
    kept = [int(want[b, 0, s] == targets[b, s]) * (1 + int(want[b, 1, s] == targets[b, s + 1] and keep[b, s + 1])
            * (1 + int(want[b, 2, s] == targets[b, s + 2] and keep[b, s + 2]))) for s in starts for b in range(3)
            if keep[b, s]]
    assert cut["rounds"] == len(kept) < len(counts) and sum(kept) < sum(counts)
    assert cut["tokens_per_call"] == pytest.approx(1 + sum(kept) / len(kept))


def test_the_extra_held_out_windows_are_spread_over_the_rounds_windows():
    windows = torch.arange(20)[:, None].expand(-1, 3)
    rest, held = held_out_sample(windows, 4)
    assert held[:, 0].tolist() == [0, 5, 10, 15] and len(rest) == 16
    assert not set(held[:, 0].tolist()) & set(rest[:, 0].tolist())
    assert len(held_out_sample(windows, 64)[1]) == 5  # at most a quarter
    assert len(held_out_sample(windows[:3], 4)[1]) == 0 and len(held_out_sample(windows, 0)[1]) == 0


def _tiny_head_and_batch(tmp_path):
    """A tiny target, a head over every other token of it, and 2 random windows of 12 with random states."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "hf", "llama")).float().eval()
    torch.manual_seed(0)
    head = DraftHead(target, torch.arange(0, 256, 2), init_layer=-1)
    head.config._attn_implementation = "sdpa"
    return target, head, torch.randint(0, 256, (2, 12)), torch.randn(2, 12, target.config.hidden_size)


def test_the_chain_unroll_trains_each_row_on_what_the_chain_policy_would_feed_it(tmp_path):
    import torch.nn.functional as F
    target, head, windows, states = _tiny_head_and_batch(tmp_path)
    one_chain, _ = head_losses(head, windows, states, 1, 1.0, mode="chain")
    assert one_chain.item() == pytest.approx(head_losses(head, windows, states, 1, 1.0)[0].item(), rel=1e-6)
    _, parts = head_losses(head, windows, states, 2, 1.0, mode="chain")
    # the second pass, one start at a time: the true prefix up to s, then the head's own feature for s and the
    # true token at s+1, trained on the target's next token after s+1
    t_logp = F.log_softmax(F.linear(states, head.lm_rows), -1)
    logp = _chain_second_pass_logp(head, windows, states)
    kls = [F.kl_div(logp[:, s], t_logp[:, s + 1], log_target=True, reduction="sum") / 2 for s in range(11)]
    assert parts["kl1"] == pytest.approx(torch.stack(kls).mean().item(), rel=1e-5)  # a position off: 9e-5
    assert parts["kl1"] != pytest.approx(head_losses(head, windows, states, 2, 1.0)[1]["kl1"], rel=1e-3)  # not shift's


def test_the_shipped_extra_rounds_read_as_new_answers_beside_the_shipped_round_0():
    from pathlib import Path

    assets = Path(__file__).resolve().parents[3] / "assets" / "heads" / "smollm2-135m"
    round0 = torch.load(assets / "onpolicy-1600.pt", weights_only=True)
    known = round0_windows(round0)
    rounds = sorted(assets.glob("onpolicy-*-r*.pt"), key=lambda p: int(p.stem.rsplit("-r", 1)[1]))
    assert [p.name for p in rounds] == ["onpolicy-1600-r1.pt", "onpolicy-800-r2.pt", "onpolicy-1024-r3.pt",
                                        "onpolicy-1024-r4.pt", "onpolicy-1024-r5.pt", "onpolicy-1024-r6.pt",
                                        "onpolicy-1536-r7.pt", "onpolicy-1536-r8.pt"]
    said: list[str] = []
    extra = extra_onpolicy(HeadConfig(onpolicy_extra=tuple(map(str, rounds))), round0["key"]["target"], known, said.append)
    # one of round 4's answers, two of round 5's, three of round 7's and four of round 8's repeat an earlier
    # window (the same greedy answer to a repeated request): dropped
    assert extra.shape == (1600 + 800 + 1024 + 1023 + 1022 + 1024 + 1533 + 1532, 256)
    assert [s.rsplit("(", 1)[1] for s in said] == ["round 1; 0 already known)", "round 2; 0 already known)",
                                                   "round 3; 0 already known)", "round 4; 1 already known)",
                                                   "round 5; 2 already known)", "round 6; 0 already known)",
                                                   "round 7; 3 already known)", "round 8; 4 already known)"]


def test_the_shipped_head_recipes_name_the_command_its_report_records():
    """made_by is how a user re-creates the shipped head: every option of its last command must be what the
    training ran with (its head_report.json's config), in both recipes of those weights; a last command that goes
    on from a head (--init) goes on from the one the command before it wrote."""
    import re
    import shlex
    from pathlib import Path

    from toolchain.compile.recipe import load_recipe

    root = Path(__file__).resolve().parents[3]
    config = json.loads((root / "assets" / "heads" / "smollm2-135m" / REPORT_FILE).read_text())["config"]
    for name in ("smollm2-135m-head.yaml", "smollm2-135m-head-cpu.yaml"):
        made_by = load_recipe(root / "recipes" / name).head.made_by
        commands = [shlex.split(c) for c in re.findall(r"`(mobc train draft [^`]*)`", made_by)]
        words = commands[-1]
        given: dict[str, list[str]] = {}
        for i, w in enumerate(words):
            if w.startswith("--"):
                flag = i + 1 == len(words) or words[i + 1].startswith("--")
                given.setdefault(w[2:].replace("-", "_"), []).append("True" if flag else words[i + 1])
        assert given.pop("kind") == ["head"] and given.pop("out") == ["assets/heads/smollm2-135m"]
        given.pop("teacher_cache", None)  # a local scratch file; the report keeps only its name
        if "init" in given:  # the report keeps the folder's name
            assert len(commands) > 1 and given["init"] == [commands[-2][commands[-2].index("--out") + 1]], name
            given["init"] = [Path(given["init"][0]).name]
        assert given, name
        for key, values in given.items():
            want = config[key] if isinstance(config[key], list) else [config[key]]
            if key.startswith("onpolicy"):  # the report keeps file names, not paths
                values = [Path(v).name for v in values]
            assert len(values) == len(want) and all(map(_same_setting, values, want)), (name, key, values, want)


def _same_setting(given: str, recorded: object) -> bool:
    """`--minutes 108` is the report's 108.0; `--precision bf16` its "bf16"; a flag's True its true."""
    try:
        return float(given) == float(recorded)
    except (TypeError, ValueError):
        return given == str(recorded)


def test_rows_until_end_keeps_each_window_up_to_its_first_end_of_turn_after_the_prompt():
    t_logp = torch.zeros(3, 8, 5)
    t_logp[0, 1, 2] = t_logp[0, 5, 2] = t_logp[0, 6, 2] = 1.0  # ends at 1 (in the prompt: ignored), 5 and 6
    t_logp[1, :, 3] = 1.0  # never ends
    t_logp[2, 3, 2] = 1.0  # ends on the prompt's last row: the answer's first token is end-of-turn
    keep = rows_until_end(t_logp.argmax(-1) == 2, 3)
    assert keep.tolist() == [[True] * 6 + [False] * 2, [True] * 8, [True] * 4 + [False] * 4]


@pytest.mark.parametrize("mode", ["shift", "chain"])
def test_until_end_of_turn_the_loss_ignores_what_follows_the_targets_end(tmp_path, mode):
    target, head, windows, states = _tiny_head_and_batch(tmp_path)
    end = EndOfTurn(row=5, first=3)
    states[0, 6] = 40 * head.lm_rows[end.row] / head.lm_rows[end.row].norm()  # the target ends window 0 at 6
    keep = rows_until_end(torch.nn.functional.linear(states, head.lm_rows).argmax(-1) == end.row, end.first)
    assert keep[0].tolist() == [True] * 7 + [False] * 5 and bool(keep[1].all())
    loss = head_losses(head, windows, states, 2, 1.0, mode=mode, end=end)[0].item()
    changed_w, changed_s = windows.clone(), states.clone()
    changed_w[0, 7:] = torch.randint(0, 256, (5,))
    changed_s[0, 7:] = torch.randn(5, target.config.hidden_size)
    assert head_losses(head, changed_w, changed_s, 2, 1.0, mode=mode, end=end)[0].item() == pytest.approx(loss, rel=1e-6)
    every_row = head_losses(head, changed_w, changed_s, 2, 1.0, mode=mode)[0].item()
    assert every_row != pytest.approx(head_losses(head, windows, states, 2, 1.0, mode=mode)[0].item(), rel=1e-3)
    # no end inside the windows: the same loss as counting every row
    never = EndOfTurn(row=end.row, first=12)
    assert head_losses(head, changed_w, changed_s, 2, 1.0, mode=mode, end=never)[0].item() == pytest.approx(
        every_row, rel=1e-5)


def test_end_of_turn_is_the_tokenizers_eos_as_a_draft_row_and_is_required(tmp_path):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "hf", "llama")).float().eval()
    head = DraftHead(target, torch.tensor([3, 7, 11, 40]), init_layer=None)
    assert end_of_turn(head, SimpleNamespace(eos_token_id=11), HeadConfig(prompt_len=16)) == EndOfTurn(2, 15)
    with pytest.raises(DraftTrainError, match="no end-of-turn"):
        end_of_turn(head, SimpleNamespace(eos_token_id=None), HeadConfig())


def test_the_held_out_table_gives_the_to_end_figure_where_it_was_measured():
    chain = {"tokens_per_call": 2.5, "accept_at_depth": [0.7, 0.4, 0.25, 0.15]}
    report = {"held_out": chain, "held_out_app": None,
              "held_out_chat": {**chain, "to_end_of_turn": {**chain, "tokens_per_call": 2.75}}}
    header, rows = held_out_table(report)
    assert header[2] == "up to its end-of-turn"
    assert rows == [["stdlib continuations", "2.50", "-", "0.700 0.400 0.250 0.150"],
                    ["answers to self-written chat requests", "2.50", "2.75", "0.700 0.400 0.250 0.150"]]


@pytest.mark.parametrize("mode", ["shift", "chain"])
def test_the_argmax_term_is_the_cross_entropy_on_the_targets_greedy_rows(tmp_path, mode):
    """--argmax-weight w adds w * CE(head's logits, the target's greedy row) per pass; the first pass's CE is
    counted here from the head's own forward, only over the rows kept up to the target's end-of-turn."""
    import torch.nn.functional as F

    target, head, windows, states = _tiny_head_and_batch(tmp_path)
    end = EndOfTurn(row=5, first=3)
    states[0, 6] = 40 * head.lm_rows[end.row] / head.lm_rows[end.row].norm()  # the target ends window 0 at 6
    base, base_parts = head_losses(head, windows, states, 2, 1.0, mode=mode, end=end)
    loss, parts = head_losses(head, windows, states, 2, 1.0, mode=mode, end=end, argmax_weight=0.7)
    assert "ce0" not in base_parts and {k: parts[k] for k in base_parts} == pytest.approx(base_parts, rel=1e-6)
    assert loss.item() == pytest.approx(base.item() + 0.7 * (parts["ce0"] + parts["ce1"]) / 2, rel=1e-5)
    with torch.no_grad():
        greedy = F.linear(states, head.lm_rows).argmax(-1)
        keep = rows_until_end(greedy == end.row, end.first)
        feats = torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], 1)
        logp = F.log_softmax(F.linear(head.norm(head.forward_train(
            feats, windows, torch.arange(12)[None].expand(2, -1), normalized=True)), head.lm_rows), -1)
        ce = -logp.gather(-1, greedy[..., None])[..., 0]
    assert parts["ce0"] == pytest.approx(ce[keep].mean().item(), rel=1e-5)
    assert parts["ce0"] != pytest.approx(ce.mean().item(), rel=1e-3)  # the rows after the end do not count
    if mode == "chain":  # pass 1, one start at a time: row s continues the chain, on the greedy row at s+1
        ces = -_chain_second_pass_logp(head, windows, states).gather(-1, greedy[:, 1:, None])[..., 0]
        assert parts["ce1"] == pytest.approx(ces[keep[:, 1:]].mean().item(), rel=1e-5)


def _chain_second_pass_logp(head, windows: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """The chain unroll's second pass computed one start s at a time, as the chain policy feeds it: the true
    prefix up to s, then the head's own feature for s and the true token at s+1. Log-probs [B, T-1, V]."""
    import torch.nn.functional as F

    feats = torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], 1)
    rows = []
    with torch.no_grad():
        for s in range(windows.shape[1] - 1):
            pos = torch.arange(s + 2)[None].expand(len(windows), -1)
            g1 = head.forward_train(feats[:, : s + 1], windows[:, : s + 1], pos[:, :-1])[:, -1:]
            g2 = head.forward_train(torch.cat([feats[:, : s + 1], head.norm(g1)], 1), windows[:, : s + 2], pos)[:, -1]
            rows.append(F.log_softmax(F.linear(head.norm(g2), head.lm_rows), -1))
    return torch.stack(rows, 1)
