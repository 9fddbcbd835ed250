"""Speculative decoding behind the OpenAI API: greedy completions (base model and a LoRA adapter, whole and
streamed) equal a plain engine's, the spec_decode metrics count drafts, a bad flag is named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from services.cli import build_parser
from services.engine.entrypoints.cli import ServeError, build
from services.serve_cli import ROLE_FACTORIES
from tests.engine.entrypoints.helpers import MODEL
from tests.engine.worker.lora.test_lora import ADAPTERS, _write_adapter
from tests.engine_harness import start_in_process

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7], [3] * 10, list(range(20, 60))]
GREEDY = dict(max_tokens=24, temperature=0, extra_body={"ignore_eos": True})


def _texts(url: str) -> dict[tuple[str, int, bool], str]:
    """Greedy texts of every (model, prompt, streamed) through the official client."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    out = {}
    for model in (MODEL, "a"):
        for i, prompt in enumerate(PROMPTS):
            out[(model, i, False)] = (
                client.completions.create(model=model, prompt=prompt, **GREEDY).choices[0].text
            )
            chunks = client.completions.create(model=model, prompt=prompt, stream=True, **GREEDY)
            out[(model, i, True)] = "".join(c.choices[0].text for c in chunks if c.choices)
    return out


def test_speculative_engine_serves_what_a_plain_one_does(llama_dir: Path, tmp_path: Path) -> None:
    adapter = _write_adapter(llama_dir, tmp_path / "a", 0, *ADAPTERS["a"])
    common = ("--num-kv-blocks", "128", "--enable-lora", "--lora-modules", f"a={adapter}")
    plain = start_in_process(llama_dir, *common)
    try:
        expected = _texts(plain.url)
    finally:
        assert plain.stop() == 0
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    engine = start_in_process(llama_dir, *common, "--speculative-config", spec)
    try:
        assert _texts(engine.url) == expected
        metrics = httpx.get(f"{engine.url}/metrics", timeout=30).text
        drafted = float(re.search(r"^kvferry_spec_decode_num_draft_tokens_total (\S+)$", metrics, re.M)[1])
        accepted = float(
            re.search(r"^kvferry_spec_decode_num_accepted_tokens_total (\S+)$", metrics, re.M)[1]
        )
        assert 0 < accepted <= drafted
        assert 'kvferry_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in metrics
        assert "kvferry_spec_decode_num_drafts_total" in metrics
    finally:
        assert engine.stop() == 0


def test_a_bad_speculative_flag_is_named(llama_dir: Path) -> None:
    argv = ["serve", str(llama_dir), "--speculative-config", '{"method": "ngram"}']
    with pytest.raises(ServeError, match="--speculative-config: num_speculative_tokens"):
        build(build_parser(argv).parse_args(argv), ROLE_FACTORIES)
