"""StopCarry: a stop string that starts in the failed engine's held-back text and ends in the resumed text
ends the stream there, whatever the chunking; anything else passes through once no stop can span."""

from __future__ import annotations

import pytest

from services.router.migration.stop_carry import StopCarry


def _run(held: str, stops: tuple[str, ...], chunks: list[str]) -> tuple[str, str | None]:
    carry = StopCarry(stops, held, len(held))
    out = ""
    for chunk in chunks:
        sent, stop = carry.push(chunk)
        out += sent
        if stop is not None:
            return out, stop
    return out + carry.flush(), None


@pytest.mark.parametrize("chunks", [["cde"], ["c", "d", "e"], ["", "cd", "e"]])
def test_a_stop_spanning_the_splice_ends_the_text_whatever_the_chunks(chunks: list[str]) -> None:
    assert _run("xab", ("abcd",), chunks) == ("x", "abcd")


def test_the_earliest_spanning_stop_wins_and_text_after_the_reach_passes() -> None:
    assert _run("ab", ("bc", "abc"), ["c"]) == ("", "abc")
    assert _run("ab", ("zz",), ["cd"]) == ("abcd", None)
    carry = StopCarry(("abX",), "a", 1)
    assert carry.push("b") == ("", None)  # "ab" may still become the stop
    assert carry.push("c") == ("abc", None) and not carry.active
    assert carry.push("abX") == ("abX", None)  # the resuming engine checks its own text


def test_without_stops_the_held_text_goes_out_with_the_next_text() -> None:
    assert _run("tail", (), ["next"]) == ("tailnext", None)
