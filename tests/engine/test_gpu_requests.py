"""On a CUDA device (@gpu; `make gpu-check` part 1): the requests users send, not only greedy ones, in bf16
and fp16 on the Triton backend: sampled (seeded, top-p/top-k/penalties), constrained, n=2 with logprobs,
embeddings and speculative decoding. The same paths run on the CPU under FakeCuda in
test_device_discipline.py; here the kernels and the real device run them."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from services.common.openai.protocol_structured import StructuredSpec
from services.engine import LLM, SamplingParams
from services.engine.worker.cuda_graphs import DecodeGraphs

pytestmark = pytest.mark.gpu
DTYPES = ["bfloat16", "float16"]
PROMPTS = [[5, 9, 13, 200, 7], list(range(3, 40)), [42, 42, 43]]
SAMPLED = SamplingParams(
    temperature=0.8, top_p=0.9, top_k=40, presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.1,
    seed=11, max_tokens=12, ignore_eos=True,
)  # fmt: skip


def _llm(model: Path, dtype: str, **kw: object) -> LLM:
    return LLM(model=str(model), device="cuda", dtype=dtype, num_kv_blocks=128, **kw)


def _tokens(llm: LLM, prompts: list, params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for r in llm.generate(prompts, params) for o in r.outputs]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_requests_run_and_repeat_by_seed(llama_dir: Path, dtype: str) -> None:
    llm = _llm(llama_dir, dtype)
    first, again = _tokens(llm, PROMPTS, SAMPLED), _tokens(llm, PROMPTS, SAMPLED)
    assert [len(t) for t in first] == [12, 12, 12] and first == again
    assert _tokens(llm, PROMPTS, SAMPLED.model_copy(update={"seed": 12})) != first
    unseeded = SAMPLED.model_copy(update={"seed": None, "min_p": 0.05})
    assert [len(t) for t in _tokens(llm, PROMPTS * 4, unseeded)] == [12] * 12


def test_seeded_draws_equal_the_cpu_in_fp32(llama_dir: Path) -> None:
    """The seeded noise is a function of (seed, position) on every device: fp32 logits agree, so do tokens."""
    params = SAMPLED.model_copy(update={"repetition_penalty": 1.0})
    cpu = _tokens(
        LLM(model=str(llama_dir), device="cpu", dtype="float32", num_kv_blocks=128), PROMPTS, params
    )
    gpu = _tokens(_llm(llama_dir, "float32", attention_backend="torch"), PROMPTS, params)
    assert gpu == cpu


@pytest.mark.parametrize("dtype", DTYPES)
def test_constrained_and_n2_logprobs(llama_dir: Path, dtype: str) -> None:
    llm = _llm(llama_dir, dtype)
    spec = StructuredSpec.of("regex", r"(cat|dog)-[0-9]{2,4}")
    texts = [o.text for o in llm.generate([PROMPTS[1]], SamplingParams(
        temperature=1.0, seed=3, n=4, max_tokens=12, structured_outputs=spec))[0].outputs]  # fmt: skip
    assert all(re.fullmatch(r"(cat|dog)-[0-9]{2,4}", t) for t in texts), texts
    out = llm.generate([PROMPTS[0]], SamplingParams(n=2, temperature=1.0, logprobs=3, max_tokens=6,
                                                    ignore_eos=True))[0].outputs  # fmt: skip
    assert len(out) == 2
    for o in out:
        assert len(o.logprobs) == 6
        assert all(math.isfinite(lp.token_logprob) and len(lp.top) == 3 for lp in o.logprobs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_spec_decode_verification(llama_dir: Path, dtype: str) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(3, 30))]
    plain = _tokens(_llm(llama_dir, dtype), prompts, greedy)
    spec = _llm(llama_dir, dtype, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    drafted = _tokens(spec, prompts, greedy)
    # multi-token verification rows round differently from one-token rows in bf16/fp16: the first agree
    assert [t[:3] for t in drafted] == [t[:3] for t in plain] and all(len(t) == 10 for t in drafted)
    assert all(len(t) == 10 for t in _tokens(spec, prompts, SAMPLED.model_copy(update={"max_tokens": 10})))


@pytest.mark.parametrize("dtype", DTYPES)
def test_embeddings_on_the_gpu_equal_the_cpu(tmp_path: Path, dtype: str) -> None:
    from transformers import BertConfig, BertModel

    from tests.checkpoints import build_tokenizer

    vocab = build_tokenizer(tmp_path)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128)  # fmt: skip
    BertModel(cfg).save_pretrained(str(tmp_path))
    prompts = [[1, 5, 9, 2], [1, 7, 8, 9, 10, 2]]
    cpu = LLM(model=str(tmp_path), device="cpu", dtype="float32", task="embed").embed(prompts)
    gpu = LLM(model=str(tmp_path), device="cuda", dtype=dtype, task="embed").embed(prompts)
    for a, b in zip(cpu, gpu, strict=True):
        cos = torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0)
        assert float(cos) >= 0.999, float(cos)


@pytest.mark.parametrize("dtype", ["float32", *DTYPES])
def test_cuda_graphs_equal_eager(llama_dir: Path, dtype: str) -> None:
    """Decode steps replayed from captured graphs (three requests: bucket 4 with a pad row) give eager's
    tokens; in bf16/fp16 the graphs' split-K for the longest context rounds differently: the first agree."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eager = _tokens(_llm(llama_dir, dtype, enforce_eager=True, max_model_len=512), PROMPTS, greedy)
    llm = _llm(llama_dir, dtype, max_model_len=512)
    graphs = llm.engine.core.runner.graphs
    assert isinstance(graphs, DecodeGraphs)
    graphed = _tokens(llm, PROMPTS, greedy)
    assert graphs.replays > 0 and 4 in graphs.graphs
    if dtype == "float32":
        assert graphed == eager
    else:
        assert [t[:3] for t in graphed] == [t[:3] for t in eager]
