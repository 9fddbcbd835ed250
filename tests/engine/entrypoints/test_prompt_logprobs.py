"""Prompt logprobs over HTTP: OpenAI's echo + logprobs and vLLM's prompt_logprobs, through the openai client."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.engine.entrypoints.helpers import MODEL

PROMPT = [11, 57, 203, 98, 31, 77, 140, 6, 19, 250, 45, 88]


@pytest.fixture(scope="module")
def hf_rows(llama_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0], -1)


def test_echo_logprobs_score_the_prompt(client: openai.OpenAI, hf_rows: torch.Tensor) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        echo=True,
        logprobs=2,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 3 and len(lp.token_logprobs) == len(PROMPT) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(PROMPT)):
        assert math.isclose(lp.token_logprobs[p], float(hf_rows[p - 1, PROMPT[p]]), abs_tol=1e-4)
        assert 1 <= len(lp.top_logprobs[p]) <= 3
    assert all(v is not None for v in lp.token_logprobs[len(PROMPT) :])
    assert out.usage.prompt_tokens_details is None or out.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_echo_logprobs_equal_non_streamed(client: openai.OpenAI) -> None:
    kw = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 4,
        "echo": True,
        "logprobs": 1,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    offsets = [v for c in chunks if c.logprobs for v in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


def test_vllm_prompt_logprobs_field(client: openai.OpenAI, hf_rows: torch.Tensor) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)  # cache the prompt's blocks
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 3}
    )
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    for p in range(1, len(PROMPT)):
        entry = plp[p]
        assert str(PROMPT[p]) in entry and len(entry) in (3, 4)
        mine = entry[str(PROMPT[p])]
        assert math.isclose(mine["logprob"], float(hf_rows[p - 1, PROMPT[p]]), abs_tol=1e-4)
        assert mine["rank"] == int((hf_rows[p - 1] > hf_rows[p - 1, PROMPT[p]]).sum()) + 1
        assert isinstance(mine["decoded_token"], str)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # scoring recomputes the whole prompt


def test_chat_prompt_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    plp = out.model_extra["prompt_logprobs"]
    assert len(plp) == out.usage.prompt_tokens and plp[0] is None
    assert all(len(entry) == 1 for entry in plp[1:])
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=2
    )
    assert plain.model_extra.get("prompt_logprobs") is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "kv_transfer_params": {"do_remote_decode": True}}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 1, "kv_transfer_params": {"do_remote_decode": True}}, "echo"),
    ],
)
def test_bad_prompt_logprobs_requests(http: httpx.Client, extra: dict, param: str) -> None:
    response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
