"""The tenants file: bad config is refused at start-up naming the field; keys become client keys (auth)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import build_parser
from services.common.openai.http_middleware import tenant_of
from services.router.admission.tenants import Band, load_tenants
from services.router.cli import run, settings_from_args


def _file(tmp_path: Path, tenants: object) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


@pytest.mark.parametrize(
    ("tenant", "field"),
    [
        ({"name": "a", "apiKey": "k" * 10, "band": "urgent"}, "band: 'urgent' is not one of critical"),
        (
            {"name": "a", "apiKey": "k" * 10, "quota": {"tokensPerMinute": -5}},
            "tenants.0.quota.tokensPerMinute",
        ),
        ({"name": "a", "apiKey": "k" * 10, "quota": {"maxConcurent": 2}}, "tenants.0.quota.maxConcurent"),
        ({"name": "a"}, "give exactly one of apiKey and apiKeyEnv"),
        ({"name": "A B", "apiKey": "k" * 10}, "tenants.0.name"),
        (
            {"name": "a", "apiKeyEnv": "NOT_SET_ANYWHERE"},
            "tenants.[0].apiKeyEnv: $NOT_SET_ANYWHERE is not set",
        ),
    ],
)
def test_bad_tenants_are_refused_naming_the_field(tmp_path: Path, tenant: dict, field: str) -> None:
    with pytest.raises(ValueError, match="--tenants-file") as refused:
        load_tenants(_file(tmp_path, [tenant]), env={})
    assert field in str(refused.value)


def test_the_router_refuses_to_start_on_a_bad_tenants_file(
    tmp_path: Path, llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _file(tmp_path, [{"name": "a", "apiKey": "k" * 10, "quota": {"requestsPerMinute": 0}}])
    argv = [
        "router",
        "--tokenizer",
        str(llama_dir),
        "--engine",
        "http://127.0.0.1:9",
        "--tenants-file",
        str(bad),
    ]
    assert run(build_parser(argv).parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert "kvferry router: error: --tenants-file" in err and "tenants.0.quota.requestsPerMinute" in err


def test_tenant_keys_are_client_keys_and_the_file_turns_flow_control_on(
    tmp_path: Path, llama_dir: Path
) -> None:
    good = _file(
        tmp_path,
        [
            {"name": "gold", "apiKeyEnv": "GOLD_KEY", "band": "critical"},
            {"name": "bulk", "apiKey": "bulk-key-0001", "quota": {"tokensPerMinute": 1000}},
        ],
    )
    tenants, keys = load_tenants(good, env={"GOLD_KEY": "gold-key-0001\n"})
    assert keys == ["gold-key-0001", "bulk-key-0001"]
    assert tenants[0].band is Band.critical and tenants[0].key_id == tenant_of(b"gold-key-0001")
    assert tenants[1].band is Band.standard and tenants[1].quota.tokens_per_minute == 1000
    argv = [
        "router",
        "--tokenizer",
        str(llama_dir),
        "--engine",
        "http://127.0.0.1:9",
        "--tenants-file",
        str(good),
    ]
    monkey = {"GOLD_KEY": "gold-key-0001"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in monkey.items():
            mp.setenv(k, v)
        settings = settings_from_args(build_parser(argv).parse_args(argv))
    assert settings.api_keys == keys and settings.admission.flow_control
