"""Declared model capabilities: a plugin model that declares a TP plan and LoRA targets gets tensor
parallelism and LoRA with no change to kvferry; one that declares neither is refused, naming what is missing."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from services.engine import LLM, SamplingParams
from services.engine.worker.models.capabilities import ModelCapabilities, TPPlan
from services.engine.worker.models.llama import LlamaForCausalLM
from tests.engine.worker.lora.test_lora import ADAPTERS, _write_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 7], list(range(3, 40)), [42, 43]]


@pytest.fixture
def plugin_models(llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """The plugins installed (a dist-info on sys.path) and a copy of the tiny Llama per architecture."""
    site = tmp_path / "site"
    info = site / "kvferry_test_plugins-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvferry-test-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[kvferry.models]\nDeclaredForCausalLM = tests.engine.plugin_model:DeclaredLM\n"
        "BareForCausalLM = tests.engine.plugin_model:BareLM\n"
    )
    monkeypatch.syspath_prepend(str(site))
    folders = {}
    for arch in ("DeclaredForCausalLM", "BareForCausalLM"):
        folder = tmp_path / arch
        shutil.copytree(llama_dir, folder)
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
        folders[arch] = folder
    yield folders
    sys.modules.pop("tests.engine.plugin_model", None)


def _greedy(llm: LLM, lora: str | None = None) -> list[list[int]]:
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora_name=lora)]
    finally:
        llm.shutdown()


def test_a_declaring_plugin_gets_tp_and_lora(
    plugin_models: dict[str, Path], llama_dir: Path, tmp_path: Path
) -> None:
    adapter = _write_adapter(llama_dir, tmp_path / "a", 0, *ADAPTERS["a"])  # q_proj, v_proj
    lora = dict(enable_lora=True, max_lora_rank=16, lora_modules={"a": str(adapter)})
    builtin = _greedy(LLM(model=str(llama_dir), dtype="float32", num_kv_blocks=64, **lora), "a")
    plugin = LLM(model=str(plugin_models["DeclaredForCausalLM"]), dtype="float32", num_kv_blocks=64,
                 tensor_parallel_size=2, **lora)  # fmt: skip
    assert _greedy(plugin, "a") == builtin
    mlp = _write_adapter(llama_dir, tmp_path / "c", 2, *ADAPTERS["c"])  # gate_proj, down_proj: not declared
    with pytest.raises(ValueError, match=r"target_modules \['down_proj', 'gate_proj'\] are not supported"):
        LLM(model=str(plugin_models["DeclaredForCausalLM"]), dtype="float32", num_kv_blocks=64,
            enable_lora=True, lora_modules={"c": str(mlp)})  # fmt: skip


def test_a_plugin_without_declarations_is_refused_by_name(plugin_models: dict[str, Path]) -> None:
    bare = str(plugin_models["BareForCausalLM"])
    with pytest.raises(ValueError, match="BareForCausalLM declares no tp_plan"):
        LLM(model=bare, dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="declares no lora_targets"):
        LLM(model=bare, dtype="float32", num_kv_blocks=64, enable_lora=True)
    assert _greedy(LLM(model=bare, dtype="float32", num_kv_blocks=64))  # it serves without them


def test_malformed_declarations_are_named() -> None:
    class Wrong(LlamaForCausalLM):
        tp_plan = {"column": ["q_proj"]}

    with pytest.raises(ValueError, match="model class Wrong: tp_plan must be a TPPlan, not dict"):
        ModelCapabilities.of(Wrong)
    with pytest.raises(ValueError, match="unknown part kinds \\['third'\\]"):
        TPPlan(fused={"qkv_proj": ("q", "third")})
    caps = ModelCapabilities.of(LlamaForCausalLM)
    assert (
        caps.tp_plan is not None
        and caps.lora is not None
        and caps.pipeline
        and caps.logits
        and not caps.vision
    )
