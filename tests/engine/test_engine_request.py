"""One request value: an API request's prompt is validated once, where the HTTP layer builds the engine's
requests, and the frozen EngineRequest reaches the scheduler unchanged (the scheduler's Request keeps it)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from services.engine import LLM, SamplingParams
from services.engine.core.engine_request import EngineRequest
from tests.engine_harness import start_in_process


def test_an_api_request_is_validated_once(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = start_in_process(llama_dir, "--num-kv-blocks", "64")
    try:
        llm_engine = engine.ctx.llm.engine
        calls: list[int] = []
        checked = llm_engine.validate_prompt

        def counting(token_ids, params, kv_transfer_params=None):  # noqa: ANN001, ANN202 - the wrapped method's
            calls.append(len(token_ids))
            return checked(token_ids, params, kv_transfer_params)

        monkeypatch.setattr(llm_engine, "validate_prompt", counting)
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 3, "n": 3, "temperature": 1.0, "seed": 1}
        response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 3
        assert calls == [4]  # one prompt, three sequences: one check
    finally:
        engine.stop()


def test_the_scheduler_keeps_the_request_value(llama_dir: Path) -> None:
    llm = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    request = engine.make_request([5, 6, 7], SamplingParams(max_tokens=2), cache_salt="s", priority=0)
    assert isinstance(request, EngineRequest) and request.prompt_token_ids == (5, 6, 7)
    with pytest.raises(Exception):  # noqa: B017, PT011 - frozen: any assignment raises
        request.priority = 3  # type: ignore[misc]
    rid = engine.add(request)
    state = engine.core.scheduler.requests[rid]
    assert state.spec == request.with_id(rid) and state.prompt_token_ids == [5, 6, 7]
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        engine.make_request([], SamplingParams())
    while engine.has_unfinished():
        engine.step()


def test_a_request_sent_while_the_loop_stops_gets_an_error_not_silence(llama_dir: Path) -> None:
    """A request queued after the engine loop's last drain (it was stopping: a rank died) is failed when
    the loop ends, and one submitted once it stopped raises at once: neither waits forever."""
    import asyncio

    from services.engine.async_llm import AsyncLLM, EngineDeadError, _Add
    from services.engine.core.config import EngineConfig

    llm = AsyncLLM(EngineConfig(model=str(llama_dir), dtype="float32", num_kv_blocks=64))
    request = llm.engine.make_request([5, 6, 7], SamplingParams(max_tokens=2), "late")

    async def scenario() -> None:
        sink: asyncio.Queue = asyncio.Queue()
        llm.shutdown()  # the loop ends ...
        llm._commands.put(_Add(request.with_id("late#1"), sink, asyncio.get_running_loop()))  # ... then this
        llm._fail_queued(EngineDeadError("stopped"))
        assert isinstance(await asyncio.wait_for(sink.get(), 5), EngineDeadError)
        with pytest.raises(EngineDeadError):
            async for _ in llm.submit(request):
                pass

    asyncio.run(scenario())
