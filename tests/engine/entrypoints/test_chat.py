"""``/v1/chat/completions`` through the official openai client against a real ``kvferry serve``."""

from __future__ import annotations

import httpx
import openai

from tests.engine.entrypoints.helpers import MODEL

MESSAGES = [
    {"role": "system", "content": "you are a test"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "the quick brown"}, {"type": "text", "text": "fox"}],
    },
]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_chat_usage_matches_template_tokens(client: openai.OpenAI, http: httpx.Client) -> None:
    n_prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, **GREEDY)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n_prompt, 6)
    assert out.usage.total_tokens == n_prompt + 6


def test_chat_stream_role_first_finish_last(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert body[-1].choices[0].finish_reason == "length"
    assert body[-1].choices[0].delta.content is None
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in body) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_n2(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            n=2,
            seed=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role]
    finishes = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]
    first_content = min(i for i, c in enumerate(chunks) if c.choices[0].delta.content)
    assert first_content >= 2  # both role chunks come before any content


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    assert all(e.top_logprobs[0].logprob == e.logprob for e in content)  # greedy picks the best
    assert all(bytes(e.bytes).decode("utf-8") == e.token for e in content)


def test_chat_logprobs_stream(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=1, stream=True, **GREEDY
        )
    )
    entries = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 5


def test_max_completion_tokens_wins(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=9, max_completion_tokens=3, **GREEDY
    )
    assert out.usage.completion_tokens == 3


def test_chat_seed_reproducible(client: openai.OpenAI) -> None:
    kw = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 99,
        "extra_body": {"ignore_eos": True},
    }
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
