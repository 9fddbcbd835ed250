"""A LLaVA-style vision-language model: greedy tokens equal HF's with 1-3 images of different sizes,
batched with text, chunked through an image, preempted; image-aware prefix caching; the encoder cache;
bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from services.common.media.image_processor import ImageProcessor
from services.common.media.video_inputs import VideoClip
from services.engine import LLM, SamplingParams
from tests.checkpoints import build_llava

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TOKENS_PER_IMAGE = 16


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def hf(llava_dir: Path):
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(llava_dir), dtype=torch.float32).eval()
    return model, CLIPImageProcessor.from_pretrained(str(llava_dir))


def _image(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _marker(llava_dir: Path) -> int:
    import json

    return json.loads((llava_dir / "config.json").read_text())["image_token_index"]


def _hf_greedy(hf, prompt: list[int], images: list[Image.Image], marker: int) -> list[int]:
    model, proc = hf
    ids = [t for tok in prompt for t in ([tok] * TOKENS_PER_IMAGE if tok == marker else [tok])]
    kw = {"pixel_values": proc(images=images, return_tensors="pt")["pixel_values"]} if images else {}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0, **kw,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def _cases(marker: int) -> list[tuple[list[int], list[Image.Image]]]:
    """Text before, between and after 1, 2 and 3 images of different sizes, and text-only prompts."""
    text = list(range(5, 40))
    return [
        ([1, *text[:20], marker, 7, 8, 9], [_image(1, 40, 56)]),
        ([1, 11, marker, 12, 13, marker, *text], [_image(2, 64, 32), _image(3, 33, 33)]),
        (
            [1, *text[:5], marker, 14, marker, 15, marker, 16],
            [_image(4, 100, 60), _image(5, 32, 80), _image(6, 48, 48)],
        ),
        ([1, *text], []),
        ([marker, 3, 4], [_image(7, 50, 50)]),
    ]


def _check(llm: LLM, hf, llava_dir: Path) -> None:
    marker = _marker(llava_dir)
    cases = _cases(marker)
    prompts = [{"prompt_token_ids": p, "multi_modal_data": {"image": imgs}} for p, imgs in cases]
    for (prompt, images), out in zip(cases, llm.generate(prompts, GREEDY), strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, images, marker), f"{len(images)} images"


def test_processor_equals_hf(llava_dir: Path, hf) -> None:
    proc = ImageProcessor.from_folder(llava_dir, 32)
    for img in (_image(1, 40, 56), _image(2, 64, 32), _image(3, 300, 20)):
        expected = hf[1](images=img, return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(proc(img), expected, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 13}, {"num_kv_blocks": 12, "max_num_seqs": 5}])
def test_greedy_equals_hf_batched_chunked_preempted(llava_dir: Path, hf, kw: dict) -> None:
    """Batched with a text-only prompt; a 13-token budget cuts every image's 16 tokens across steps; 12
    blocks of 16 force preemption (and re-encoding, or an encoder-cache hit, on resume)."""
    llm = LLM(model=str(llava_dir), dtype="float32", **{"num_kv_blocks": 256, **kw})
    _check(llm, hf, llava_dir)
    if "num_kv_blocks" in kw:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_prefix_cache_follows_the_image(llava_dir: Path, hf) -> None:
    """Same text and image: the image's blocks are cache hits. Same text, another image: only the blocks
    of the text before the image are."""
    llm = LLM(model=str(llava_dir), dtype="float32", num_kv_blocks=256)
    marker = _marker(llava_dir)
    prompt = [1, *range(5, 40), marker, *range(40, 60)]  # 36 text tokens, then the image at 36..51

    def run(img: Image.Image):  # noqa: ANN202 - a RequestOutput
        return llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": img}}, GREEDY)[0]

    first = run(_image(1, 40, 40))
    again = run(_image(1, 40, 40))
    other = run(_image(9, 40, 40))
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 64  # blocks 0..3: through the image and past it
    assert other.num_cached_tokens == 32  # blocks 0..1: the text before the image only
    assert other.outputs[0].token_ids == _hf_greedy(hf, prompt, [_image(9, 40, 40)], marker)
    view = llm.engine.core.scheduler.encoder
    assert view is not None and view.queries >= 2 and llm.worker_stats().encoder_cache_items == 2


def test_bad_image_input_is_a_clear_error(llava_dir: Path, llama_dir: Path) -> None:
    llm = LLM(model=str(llava_dir), dtype="float32", num_kv_blocks=64)
    marker = _marker(llava_dir)
    with pytest.raises(ValueError, match="1 image placeholder\\(s\\) .* for 2 image\\(s\\)"):
        llm.generate({"prompt_token_ids": [1, marker], "multi_modal_data": {"image": [_image(1, 9, 9)] * 2}})
    clip = VideoClip(np.zeros((1, 8, 8, 3), np.uint8), (0.0,), 1.0)
    with pytest.raises(ValueError, match="videos: this model takes images only"):
        llm.generate(
            {"prompt_token_ids": [1, marker], "multi_modal_data": {"image": _image(1, 9, 9), "video": clip}}
        )
    with pytest.raises(ValueError, match="only 'image' and 'video' are supported"):
        llm.generate({"prompt_token_ids": [1, marker], "multi_modal_data": {"audio": []}})
    with pytest.raises(ValueError, match="is over 40000000 pixels"):
        llm.generate(
            {"prompt_token_ids": [1, marker], "multi_modal_data": {"image": Image.new("RGB", (8000, 6000))}}
        )
    text = LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="images: this model takes text only"):
        text.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": _image(1, 9, 9)}})
    assert llm.generate([[1, 5, 6]], GREEDY)[0].outputs[0].token_ids  # it still serves
