"""The vision encoder as its own batched step: one call per step with every scheduled image (tiles of several
images together), a per-step budget in feature tokens that spreads images over steps, and greedy tokens
still equal to HF's; a budget below the largest image is refused at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.media.mm_placeholders import media_placeholders
from services.engine import LLM
from services.engine.llm_engine import LLMEngine
from tests.checkpoints_idefics3 import build_idefics3
from tests.engine.test_idefics3 import CASES as SMOLVLM_CASES
from tests.engine.test_idefics3 import _prompt as smolvlm_prompt
from tests.engine.test_llava import GREEDY, TOKENS_PER_IMAGE, _cases, _hf_greedy, _marker, hf, llava_dir

__all__ = ["hf", "llava_dir"]  # module fixtures reused from test_llava


def _recorded(llm: LLM) -> list[int]:
    """Wrap the model's encode_images: the list gets each call's batch size (tiles / images)."""
    model = llm.engine.core.runner.model
    calls: list[int] = []
    encode = model.encode_images  # type: ignore[union-attr]

    def recording(pixels: torch.Tensor) -> torch.Tensor:
        calls.append(pixels.shape[0])
        return encode(pixels)

    model.encode_images = recording  # type: ignore[union-attr]
    return calls


def _run_steps(engine: LLMEngine, calls: list[int]) -> tuple[list[list[int]], dict[str, list[int]]]:
    """Step until done: each step's encoder calls (batch sizes) and each request's tokens."""
    per_step, tokens = [], {}
    while engine.has_unfinished():
        before = len(calls)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        per_step.append(calls[before:])
    return per_step, tokens


def _add_llava_cases(llm: LLM, llava_dir: Path) -> list[tuple[list[int], list]]:
    cases = _cases(_marker(llava_dir))
    for i, (prompt, images) in enumerate(cases):
        llm.engine.add_request(prompt, GREEDY, request_id=f"r{i}", images=images)
    return cases


def test_one_encoder_call_per_step_batches_every_image(llava_dir: Path, hf) -> None:
    """Five prompts with 7 images in all: the first step encodes all 7 in one call; tokens equal HF's."""
    llm = LLM(model=str(llava_dir), dtype="float32", num_kv_blocks=256)
    calls = _recorded(llm)
    cases = _add_llava_cases(llm, llava_dir)
    per_step, tokens = _run_steps(llm.engine, calls)
    assert per_step[0] == [7] and all(not c for c in per_step[1:])
    for i, (prompt, images) in enumerate(cases):
        assert tokens[f"r{i}"] == _hf_greedy(hf, prompt, images, _marker(llava_dir)), f"{len(images)} images"


def test_budget_of_one_image_spreads_images_over_steps(llava_dir: Path, hf) -> None:
    """A budget below two images: each step encodes one image (prompts are cut before the next one), every
    image once, and the tokens still equal HF's."""
    llm = LLM(
        model=str(llava_dir),
        dtype="float32",
        num_kv_blocks=256,
        max_num_encoder_input_tokens=2 * TOKENS_PER_IMAGE - 1,
    )
    calls = _recorded(llm)
    cases = _add_llava_cases(llm, llava_dir)
    per_step, tokens = _run_steps(llm.engine, calls)
    assert all(c in ([], [1]) for c in per_step) and sum(map(len, per_step)) == 7
    for i, (prompt, images) in enumerate(cases):
        assert tokens[f"r{i}"] == _hf_greedy(hf, prompt, images, _marker(llava_dir)), f"{len(images)} images"
    view = llm.engine.core.scheduler.encoder
    assert view is not None and view.queries - view.hits == 7


def test_tiles_of_several_images_run_in_one_call(tmp_path: Path) -> None:
    """SmolVLM: the 6 images of three prompts (their tiles and global images) go through the tower at once."""
    folder = build_idefics3(tmp_path / "smolvlm", "smolvlm")
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=256, max_num_encoder_input_tokens=4096)
    calls = _recorded(llm)
    placeholders = media_placeholders(folder)
    assert placeholders is not None
    tiles = 0
    for i, (text, images) in enumerate(SMOLVLM_CASES):
        prompt = smolvlm_prompt(folder, text, images)["prompt_token_ids"]
        llm.engine.add_request(prompt, GREEDY, request_id=f"s{i}", images=images)
        tiles += sum(p.pixels.shape[0] for p in placeholders.expand(prompt, images)[1])
    per_step, _ = _run_steps(llm.engine, calls)
    assert per_step[0] == [tiles] and tiles > 6 and sum(map(len, per_step)) == 1


def test_budget_below_the_largest_image_is_refused(llava_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens=15: below the 16 features"):
        LLM(model=str(llava_dir), dtype="float32", num_kv_blocks=64, max_num_encoder_input_tokens=15)
    short = LLM(model=str(llava_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=8)
    assert short.engine.core.scheduler.config.max_num_encoder_input_tokens == TOKENS_PER_IMAGE
