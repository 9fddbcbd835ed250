"""Trace JSONL: rows validated (a bad row refused naming its line and field), generators reproducible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.sim.trace import TraceError, TraceRow, draw, load_trace, write_trace
from services.sim.trace_generators import GENERATORS, GeneratorSettings, generate


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"t": 1.0, "output_len": 4}, "prompt_token_ids and prompt_len"),
        ({"t": 1.0, "prompt_len": 8, "output_len": 0}, "output_len"),
        ({"t": -1.0, "prompt_len": 8, "output_len": 2}, "t:"),
        (
            {"t": 1.0, "prompt_len": 8, "prefix_group": "g", "prefix_len": 9, "output_len": 2},
            "prefix_len 9 exceeds",
        ),
        ({"t": 1.0, "prompt_len": 8, "output_len": 2, "colour": "red"}, "colour"),
    ],
)
def test_a_bad_row_is_refused_naming_its_line_and_field(tmp_path: Path, bad: dict, field: str) -> None:
    good = {"t": 0.5, "prompt_len": 8, "output_len": 2}
    path = _write(tmp_path / "t.jsonl", [good, good, bad])
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert "t.jsonl:3:" in str(err.value) and field in str(err.value)


def test_a_row_that_is_not_json_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 0, "prompt_len": 4, "output_len": 1}\n{nope\n')
    with pytest.raises(TraceError, match=r"t.jsonl:2: not JSON"):
        load_trace(path)


def test_rows_share_their_group_prefix_and_sessions_continue_their_output() -> None:
    a = TraceRow(t=0, prompt_len=40, prefix_group="doc", prefix_len=32, output_len=4, id="a")
    b = TraceRow(t=1, prompt_len=50, prefix_group="doc", prefix_len=32, output_len=4, id="b")
    ta, tb = a.tokens(0, 1000), b.tokens(1, 1000)
    assert ta[:32] == tb[:32] and ta[32:] != tb[32:40] and len(tb) == 50
    turn1 = TraceRow(t=0, prompt_len=20, prefix_group="s", prefix_len=20, output_len=5)
    turn2 = TraceRow(t=3, prompt_len=30, prefix_group="s", prefix_len=30, output_len=5)
    assert turn2.tokens(1, 1000)[:25] == turn1.tokens(0, 1000) + turn1.output_tokens(0, 1000)
    assert draw("k", 5, 100) == draw("k", 9, 100)[:5]


@pytest.mark.parametrize("name", GENERATORS)
def test_generators_are_reproducible_and_round_trip(tmp_path: Path, name: str) -> None:
    settings = GeneratorSettings(rate=1.0, duration_s=20, seed=3)
    rows = generate(name, settings)
    assert (
        rows
        and rows == generate(name, settings)
        and rows != generate(name, settings.model_copy(update={"seed": 4}))
    )
    assert all(b.t >= a.t for a, b in zip(rows, rows[1:], strict=False))
    write_trace(rows, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == rows
