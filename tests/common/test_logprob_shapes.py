"""Chat logprobs rebuilt from completions logprobs: entries, alternatives, bytes."""

from __future__ import annotations

from services.common.openai.logprob_shapes import (
    chat_logprob_entry,
    chat_logprobs_from_completion,
    top_logprob,
)


def test_entry_carries_utf8_bytes_and_alternatives_in_order() -> None:
    entry = chat_logprob_entry("é", -0.5, [("é", -0.5), ("e", -1.5)])
    assert (entry.token, entry.logprob, entry.bytes) == ("é", -0.5, [0xC3, 0xA9])
    assert [t.token for t in entry.top_logprobs] == ["é", "e"]
    assert top_logprob("a", -1.0).bytes == [97]


def test_completion_logprobs_become_chat_logprobs() -> None:
    completion = {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.1, None],
        "top_logprobs": [{"a": -0.1, "c": -2.0, "d": -3.0}, None],
        "text_offset": [0, 1],
    }
    chat = chat_logprobs_from_completion(completion, top_n=2)
    assert chat is not None
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.content] == [
        ("a", -0.1, ["a", "c"]),
        ("b", 0.0, []),
    ]
    assert chat_logprobs_from_completion(completion, None) is None
    assert chat_logprobs_from_completion(None, 2) is None
