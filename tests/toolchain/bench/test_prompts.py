"""Prompt specs: HumanEval, the shipped chat prompts (through the chat template), files, and joins."""

from __future__ import annotations

import pytest

from tests.tiny import tiny_tokenizer
from toolchain.bench.prompts import BenchError, ChatPrompt, encode, load_prompts, prompt_ids


def test_sets_join_in_order_and_chat_prompts_are_marked():
    he, chat = load_prompts("humaneval:3"), load_prompts("chat:24")
    assert len(he) == 3 and "def has_close_elements" in he[0]
    assert len(chat) == 24 and all(isinstance(p, ChatPrompt) for p in chat)
    assert len(set(chat)) == 24 and not any(p.startswith("#") or "---" in p for p in chat)
    both = load_prompts("humaneval:3+chat:2")
    assert both == he + chat[:2] and isinstance(both[3], ChatPrompt) and not isinstance(both[0], ChatPrompt)


def test_chat_prompts_go_through_the_template(tmp_path):
    class Templated:
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt):
            assert add_generation_prompt
            return [1, len(messages[0]["content"]), 2]

        def __call__(self, text):
            raise AssertionError("a chat prompt was encoded as plain text")

    p = load_prompts("chat:1")[0]
    assert encode(Templated(), p) == [1, len(p), 2]
    tok = tiny_tokenizer()
    assert encode(tok, "def f():") == tok("def f():").input_ids
    with pytest.raises(BenchError, match="chat template"):
        encode(tok, p)  # the tiny tokenizer has none


def test_bad_specs_name_the_fix(tmp_path):
    for spec, msg in [("chat:100", "ships 24"), ("chat:x", "positive number"), ("web:3", "humaneval:N, chat:N"),
                      (f"file:{tmp_path}/none.txt", "not a file")]:
        with pytest.raises(BenchError, match=msg):
            load_prompts(spec)
    f = tmp_path / "p.txt"
    f.write_text("# a header line\nfirst\n---\nsecond\n")
    assert load_prompts(f"file:{f}") == ["first", "second"]
    assert prompt_ids(tiny_tokenizer(), "humaneval:2", skip=1) == [tiny_tokenizer()(load_prompts("humaneval:3")[1]).input_ids,
                                                                  tiny_tokenizer()(load_prompts("humaneval:3")[2]).input_ids]
