"""Images over the OpenAI API: chat image_url parts and completions multi_modal_data on a LLaVA engine
(the same tokens as offline), 400s naming the part, and through the router: image-aware prefix routing."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from services.common.openai.tokenizer import Tokenizer
from services.engine import LLM, SamplingParams
from tests.checkpoints import build_llava
from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import start_in_process
from tests.redis_server import redis_server  # noqa: F401 - fixture
from tests.router.stack import start_router


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava(tmp_path_factory.mktemp("tiny-llava-http"))


def _data_url(seed: int, size: tuple[int, int] = (40, 48), fmt: str = "PNG") -> str:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _decode(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def _chat(text: str, *urls: str) -> list[dict]:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


def test_chat_and_completions_with_images_equal_offline(llava_dir: Path) -> None:
    engine = start_in_process(llava_dir, "--num-kv-blocks", "64")
    try:
        client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="x", max_retries=0)
        a, b = _data_url(1), _data_url(2, (64, 30))
        got = client.chat.completions.create(
            model=MODEL, messages=_chat("what is this?", a, b), max_tokens=8, temperature=0
        )
        ids = Tokenizer(llava_dir).encode_chat(
            [{"role": "user", "content": "what is this?\n<image>\n<image>"}], True
        )
        offline = LLM(model=str(llava_dir), dtype="float32", num_kv_blocks=64).generate(
            {"prompt_token_ids": ids, "multi_modal_data": {"image": [_decode(a), _decode(b)]}},
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        )[0]
        assert got.choices[0].message.content == offline.outputs[0].text
        assert got.usage.prompt_tokens == len(ids) + 2 * 15  # each placeholder became 16 tokens
        comp = client.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=8,
            temperature=0,
            extra_body={"multi_modal_data": {"image": [a, b]}},
        )
        assert comp.choices[0].text == offline.outputs[0].text
    finally:
        assert engine.stop() == 0


def test_bad_images_are_400s_naming_the_part(llava_dir: Path, llama_dir: Path, tmp_path: Path) -> None:
    engine = start_in_process(llava_dir, "--num-kv-blocks", "64", "--limit-mm-per-prompt", '{"image": 2}')
    text = start_in_process(llama_dir, "--num-kv-blocks", "64")
    try:
        tiff = _data_url(3, fmt="TIFF")
        cases = [
            (
                engine,
                _chat("x", "data:image/png;base64,AAAA"),
                "image 0: image_url: the image cannot be decoded",
            ),
            (engine, _chat("x", tiff), "TIFF images are not supported"),
            (engine, _chat("x", "https://example.com/cat.png"), "fetching http(s) URLs is disabled"),
            (engine, _chat("x", "file:///etc/passwd"), "file:// URLs need --allowed-local-media-path"),
            (
                engine,
                _chat("x", *[_data_url(i) for i in range(3)]),
                "3 images is over this server's limit of 2",
            ),
            (text, _chat("x", _data_url(1)), "this one takes text only"),
        ]
        for server, messages, message in cases:
            body = {"model": MODEL, "messages": messages, "max_tokens": 2}
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        body = {"model": MODEL, "messages": _chat("still here"), "max_tokens": 2}
        assert httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    finally:
        engine.stop()
        text.stop()


def test_the_router_routes_by_image_prefix(llava_dir: Path, tmp_path: Path, redis_server) -> None:  # noqa: F811
    """Two engines behind a router with the shared prefix index: the second identical image request lands on
    the engine that cached it; another image with the same text finds only the text before it cached."""
    args = ("--num-kv-blocks", "128", "--redis-url", redis_server.url)
    engines = [start_in_process(llava_dir, *args) for _ in range(2)]
    (tmp_path / "logs").mkdir()
    router = start_router(llava_dir, tmp_path / "logs", [e.url for e in engines], redis_url=redis_server.url)
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        text = "describe the picture in the image below, in detail please: " * 2
        first = client.chat.completions.create(
            model=MODEL, messages=_chat(text, _data_url(5)), max_tokens=4, temperature=0
        )
        for _ in range(3):
            again = client.chat.completions.create(
                model=MODEL, messages=_chat(text, _data_url(5)), max_tokens=4, temperature=0
            )
            assert again.choices[0].message.content == first.choices[0].message.content
            assert again.usage.prompt_tokens_details.cached_tokens >= 32  # through the image's blocks
        other = client.chat.completions.create(
            model=MODEL, messages=_chat(text, _data_url(6)), max_tokens=4, temperature=0
        )
        assert (
            other.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
        )
    finally:
        router.stop()
        for e in engines:
            e.stop()


# A template that places content parts itself, as llava-hf's do: an image part is "<image>" where it stands
PARTS_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _hf_chat_greedy(llava_dir: Path, template: Path, messages: list[dict], images: list, n: int) -> list[int]:
    """HF's rendering (its tokenizer's apply_chat_template with the parts) and LlavaForConditionalGeneration."""
    import torch
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(llava_dir / "tokenizer.json"))
    tok.chat_template = template.read_text()
    parts = [{"role": m["role"], "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
             for m in messages]  # fmt: skip
    text = tok.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    model = LlavaForConditionalGeneration.from_pretrained(str(llava_dir), dtype=torch.float32).eval()
    marker = model.config.image_token_index
    ids = [t for tok_id in tok(text, add_special_tokens=False)["input_ids"]
           for t in ([tok_id] * 16 if tok_id == marker else [tok_id])]  # fmt: skip
    pixels = CLIPImageProcessor.from_pretrained(str(llava_dir))(images=images, return_tensors="pt")[
        "pixel_values"
    ]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), pixel_values=pixels, max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("images_first", [False, True])
def test_chat_renders_parts_through_the_models_template_as_hf_does(
    llava_dir: Path, tmp_path: Path, images_first: bool
) -> None:
    """Odd image sizes, the image parts after or before the text: the server's answer is HF's."""
    template = tmp_path / "parts.jinja"
    template.write_text(PARTS_TEMPLATE)
    a, b = _data_url(11, (61, 47)), _data_url(12, (40, 90))
    text = [{"type": "text", "text": "compare these two pictures"}]
    pics = [{"type": "image_url", "image_url": {"url": u}} for u in (a, b)]
    messages = [{"role": "user", "content": pics + text if images_first else text + pics}]
    engine = start_in_process(llava_dir, "--num-kv-blocks", "64", "--chat-template", str(template))
    try:
        client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="x", max_retries=0)
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                             logprobs=True)  # fmt: skip
        ours = [t.token for t in got.choices[0].logprobs.content]  # each token's own text
    finally:
        engine.stop()
    expected = _hf_chat_greedy(llava_dir, template, messages, [_decode(a), _decode(b)], 6)
    tok = Tokenizer(llava_dir)
    assert ours == [tok.decode([t]) for t in expected]
