"""Idefics3 / SmolVLM: our preprocessing and prompt expansion equal HF's processor; greedy tokens equal HF's
with 1-3 images of different sizes (different tile grids), batched with text, chunked through an image,
preempted; image-aware prefix caching."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from services.common.media.idefics3_processor import Idefics3ImageProcessor
from services.common.media.mm_placeholders import media_placeholders
from services.common.openai.tokenizer import Tokenizer
from services.engine import LLM, SamplingParams
from tests.checkpoints_idefics3 import build_idefics3

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_idefics3(tmp_path_factory.mktemp("tiny-smolvlm"), "smolvlm")


@pytest.fixture(scope="module")
def hf(smolvlm_dir: Path):
    from transformers import SmolVLMForConditionalGeneration

    model = SmolVLMForConditionalGeneration.from_pretrained(str(smolvlm_dir), dtype=torch.float32).eval()
    return model, hf_processor(smolvlm_dir)


def hf_processor(folder: Path):  # noqa: ANN201 - HF's Idefics3Processor
    """HF's processor with its PIL image backend (the torchvision one, where installed, resizes otherwise)."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return Idefics3Processor.from_pretrained(
        str(folder), image_processor=Idefics3ImageProcessorPil.from_pretrained(str(folder))
    )


def _image(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


# text before, between and after 1, 2 and 3 images of different sizes (3x3, 1x3, 2x3 tile grids), text only
CASES = [
    ("the quick brown fox<image>jumps over", [_image(1, 40, 56)]),
    ("paris<image> is the capital <image>of france and", [_image(2, 100, 20), _image(3, 300, 200)]),
    ("a<image>b<image>\n<image> the lazy dog", [_image(4, 64, 30), _image(5, 20, 90), _image(6, 48, 48)]),
    ("hello world, the quick brown fox jumps over the lazy dog", []),
]


def _hf_ids_pixels(hf, text: str, images: list[Image.Image]) -> tuple[list[int], dict]:
    model, proc = hf
    if not images:
        return proc.tokenizer(text, add_special_tokens=False)["input_ids"], {}
    r = proc(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    return r["input_ids"][0].tolist(), {"pixel_values": r["pixel_values"]}


def _hf_greedy(hf, text: str, images: list[Image.Image]) -> list[int]:
    ids, kw = _hf_ids_pixels(hf, text, images)
    with torch.no_grad():
        out = hf[0].generate(
            torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0, **kw,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def _prompt(folder: Path, text: str, images: list[Image.Image]) -> dict:
    ids = Tokenizer(folder).encode(text, add_special_tokens=False)
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def test_preprocessing_and_expansion_equal_hf(smolvlm_dir: Path, hf) -> None:
    """Pixels of every tile, the tile grid and the expanded ids (tile and row tokens, newlines) as HF's."""
    proc = Idefics3ImageProcessor.from_folder(smolvlm_dir)
    for w, h in [(40, 56), (100, 20), (300, 200), (20, 20), (97, 31), (5, 400)]:
        img = _image(w, w, h)
        expected = hf[1].image_processor(images=[img], return_tensors="np", return_row_col_info=True)
        ours = proc(img)
        assert (ours.rows, ours.cols) == (expected["rows"][0][0], expected["cols"][0][0])
        np.testing.assert_allclose(ours.pixels, expected["pixel_values"][0], atol=1e-6)
    placeholders = media_placeholders(smolvlm_dir)
    assert placeholders is not None
    for text, images in CASES[:3]:
        ids, placed = placeholders.expand(_prompt(smolvlm_dir, text, images)["prompt_token_ids"], images)
        assert ids == _hf_ids_pixels(hf, text, images)[0]
        assert [p.pixels.shape[0] for p in placed] == [proc(i).pixels.shape[0] for i in images]


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 13}, {"num_kv_blocks": 27, "max_num_seqs": 4}])
def test_greedy_equals_hf_batched_chunked_preempted(smolvlm_dir: Path, hf, kw: dict) -> None:
    """All cases in one batch; a 13-token budget cuts every image (tiles, separators) across steps; 27 blocks
    of 16 for 52 blocks of prompts force preemption (and an encoder-cache hit on resume)."""
    llm = LLM(model=str(smolvlm_dir), dtype="float32", **{"num_kv_blocks": 256, **kw})
    outs = llm.generate([_prompt(smolvlm_dir, t, imgs) for t, imgs in CASES], GREEDY)
    for (text, images), out in zip(CASES, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, text, images), f"{len(images)} images"
    if "num_kv_blocks" in kw:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_prefix_cache_follows_the_image(smolvlm_dir: Path, hf) -> None:
    """Same text and image: the image's blocks are hits. Same text, another image of the same size (same ids):
    only the blocks of the text before the image are."""
    llm = LLM(model=str(smolvlm_dir), dtype="float32", num_kv_blocks=256)
    text = "the quick brown fox jumps over the lazy dog while paris is the capital of france" * 2
    n_text = len(Tokenizer(smolvlm_dir).encode(text, add_special_tokens=False))

    def run(img: Image.Image):  # noqa: ANN202 - a RequestOutput
        return llm.generate(_prompt(smolvlm_dir, text + "<image> and", [img]), GREEDY)[0]

    first, again, other = run(_image(1, 40, 40)), run(_image(1, 40, 40)), run(_image(9, 40, 40))
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16  # all full blocks
    assert other.num_cached_tokens == n_text // 16 * 16  # the blocks before the image's first token
    assert other.outputs[0].token_ids == _hf_greedy(hf, text + "<image> and", [_image(9, 40, 40)])
    assert llm.worker_stats().encoder_cache_items == 2


def test_idefics3_architecture_equals_hf(tmp_path: Path) -> None:
    """The same model saved as Idefics3ForConditionalGeneration (model_type idefics3) runs the same."""
    from transformers import Idefics3ForConditionalGeneration

    folder = build_idefics3(tmp_path / "idefics3", "idefics3", seed=1)
    ref = (
        Idefics3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval(),
        hf_processor(folder),
    )
    text, images = CASES[1]
    out = LLM(model=str(folder), dtype="float32", num_kv_blocks=64).generate(
        _prompt(folder, text, images), GREEDY
    )[0]
    assert out.outputs[0].token_ids == _hf_greedy(ref, text, images)


def test_bad_input_is_a_clear_error(smolvlm_dir: Path) -> None:
    llm = LLM(model=str(smolvlm_dir), dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="1 image and 0 video placeholder\\(s\\) for 2 image\\(s\\)"):
        llm.generate(_prompt(smolvlm_dir, "a<image>", [_image(1, 9, 9)] * 2))
    with pytest.raises(ValueError, match="is over 40000000 pixels"):
        llm.generate(_prompt(smolvlm_dir, "a<image>", [Image.new("RGB", (8000, 6000))]))
    assert llm.generate([[1, 5, 6]], GREEDY)[0].outputs[0].token_ids  # it still serves
