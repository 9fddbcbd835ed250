"""SmolVLM video: our decoding and frame sampling equal HF's (PyAV, SmolVLM's fps / max-frames / skip rule),
frame pixels and the frame prompt (timestamps, frame count in words) equal HF's, greedy tokens equal HF's
for a video prompt, also chunked; bad videos are clear errors."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from services.common.media.idefics3_processor import Idefics3ImageProcessor
from services.common.media.mm_placeholders import media_placeholders
from services.common.media.video_inputs import VideoClip, VideoSampling, decode_video
from services.common.openai.tokenizer import Tokenizer
from services.engine import LLM, SamplingParams
from tests.checkpoints_idefics3 import VIDEO_SAMPLING, build_idefics3
from tests.videos import clip_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SAMPLING = VideoSampling(fps=2, max_frames=6, longest_edge=32)
PROMPT = "<|im_start|>user\n<video>\nwhat happens in the video?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_idefics3(tmp_path_factory.mktemp("tiny-smolvlm-video"), "smolvlm")


def _hf_load(path: Path, sampling: VideoSampling) -> tuple[np.ndarray, object]:
    """HF's PyAV loader with SmolVLM's own sample_frames (its processor needs torchvision; the rule does not)."""
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor
    from transformers.video_utils import load_video

    stub = SimpleNamespace(num_frames=sampling.max_frames, fps=sampling.fps)
    return load_video(
        str(path), backend="pyav", sample_indices_fn=partial(SmolVLMVideoProcessor.sample_frames, stub)
    )


@pytest.mark.parametrize(
    ("frames", "fps", "sampling"),
    [
        (45, 10, SAMPLING),
        (160, 10, SAMPLING),
        (3, 10, SAMPLING),
        (40, 24, VideoSampling(fps=1, max_frames=64)),
    ],
)
def test_sampled_frames_equal_hf(tmp_path: Path, frames: int, fps: int, sampling: VideoSampling) -> None:
    """A short clip, a long one (one second skipped at each end), one shorter than a sample, a 1 fps model."""
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip_bytes(frames, fps))
    ours = decode_video(path.read_bytes(), sampling)
    expected, meta = _hf_load(path, sampling)
    assert np.array_equal(ours.frames, expected)
    assert list(ours.timestamps) == pytest.approx(meta.timestamps)  # type: ignore[attr-defined]
    assert ours.duration == pytest.approx(meta.duration)  # type: ignore[attr-defined]


def _hf_prompt_ids(folder: Path, clip: VideoClip, text: str) -> list[int]:
    """HF's SmolVLM frame prompt (its own replace_video_token) put in the text, tokenized as a whole."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor
    from transformers.video_utils import VideoMetadata

    stub = SimpleNamespace(
        image_seq_len=16, image_token="<image>", fake_image_token="<fake_token_around_image>",
        global_image_token="<global-img>",
    )  # fmt: skip
    fps = 10.0
    meta = VideoMetadata(
        total_num_frames=int(round(clip.duration * fps)), fps=fps, duration=clip.duration,
        frames_indices=[int(round(t * fps)) for t in clip.timestamps],
    )  # fmt: skip
    inputs = {"pixel_values": torch.zeros(1, len(clip.frames)), "video_metadata": [meta]}
    expanded = text.replace("<video>", SmolVLMProcessor.replace_video_token(stub, inputs, 0))
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json")).encode(expanded)


def test_frame_pixels_and_prompt_equal_hf(smolvlm_dir: Path) -> None:
    """Frames: resized to the video size then to one square tile, as HF's (unsplit) SmolVLM preprocessing;
    the prompt: HF's intro, timestamps and per-frame global images."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    clip = decode_video(clip_bytes(45), SAMPLING)
    hf = Idefics3ImageProcessorPil.from_pretrained(str(smolvlm_dir))
    ours = Idefics3ImageProcessor.from_folder(smolvlm_dir)
    expected = hf(
        images=[list(clip.frames)],
        do_image_splitting=False,
        size=VIDEO_SAMPLING["video_size"],
        return_tensors="np",
    )["pixel_values"][0]
    from PIL import Image

    np.testing.assert_allclose([ours.frame(Image.fromarray(f), 32) for f in clip.frames], expected, atol=1e-6)
    placeholders = media_placeholders(smolvlm_dir)
    assert placeholders is not None and placeholders.video_sampling == SAMPLING
    for prompt in (
        PROMPT,
        "User: <video>what happens? the dog",
        "<video> and then",
    ):  # text merges at both ends
        ids, placed = placeholders.expand(
            Tokenizer(smolvlm_dir).encode(prompt, add_special_tokens=False), [clip]
        )
        assert ids == _hf_prompt_ids(smolvlm_dir, clip, prompt), prompt
        assert placed[0].is_embed is not None and sum(placed[0].is_embed) == 6 * 16
        again, found = placeholders.expand(ids, [clip])  # expanded ids (as the router sends them) are found
        assert again == ids and [p.span() for p in found] == [p.span() for p in placed]


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 24}])
def test_video_greedy_equals_hf(smolvlm_dir: Path, kw: dict) -> None:
    """A video prompt batched with an image prompt, and a budget that cuts through the frames."""
    from transformers import SmolVLMForConditionalGeneration

    clip = decode_video(clip_bytes(45), SAMPLING)
    ids = Tokenizer(smolvlm_dir).encode(PROMPT, add_special_tokens=False)
    llm = LLM(model=str(smolvlm_dir), dtype="float32", **{"num_kv_blocks": 128, **kw})
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"video": clip}}, GREEDY)[0]
    model = SmolVLMForConditionalGeneration.from_pretrained(str(smolvlm_dir), dtype=torch.float32).eval()
    hf_ids = _hf_prompt_ids(smolvlm_dir, clip, PROMPT)
    frames = Idefics3ImageProcessor.from_folder(smolvlm_dir)
    from PIL import Image

    pixels = torch.from_numpy(np.stack([frames.frame(Image.fromarray(f), 32) for f in clip.frames]))[None]
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([hf_ids]), pixel_values=pixels, max_new_tokens=8, do_sample=False, eos_token_id=None,
            attention_mask=torch.ones(1, len(hf_ids), dtype=torch.long), pad_token_id=0,
        )  # fmt: skip
    assert out.prompt_token_ids == hf_ids
    assert out.outputs[0].token_ids == ref[0, len(hf_ids) :].tolist()


def test_a_webm_without_a_frame_count_is_sampled_alike() -> None:
    """WebM headers carry no frame count: it is counted from the packets, and sampling is the same."""
    mp4, webm = (decode_video(clip_bytes(45, container_format=f), SAMPLING) for f in ("mp4", "webm"))
    assert webm.timestamps == mp4.timestamps and webm.duration == mp4.duration
    assert webm.frames.shape == mp4.frames.shape


def test_bad_videos_are_clear_errors() -> None:
    """(Frames over the pixel limit: tests/engine/test_idefics3_http.py.)"""
    with pytest.raises(ValueError, match="video_url: the video cannot be decoded"):
        decode_video(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 100, SAMPLING)
    with pytest.raises(ValueError, match="45 frames is over this server's limit of 10"):
        decode_video(clip_bytes(45), SAMPLING, max_frames=10)
