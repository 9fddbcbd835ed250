"""The model-free parts of speculative decoding: n-gram lookup, the acceptance rule, the draft gate."""

from __future__ import annotations

from services.engine.worker.spec_decode.draft_gate import DraftGate
from services.engine.worker.spec_decode.ngram_proposer import NgramProposer
from services.engine.worker.spec_decode.proposal import accepted_prefix


def test_ngram_takes_the_longest_suffix_and_its_latest_occurrence() -> None:
    p = NgramProposer(num_tokens=3, min_n=2, max_n=4)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert p.lookup(tokens, 3) == (7, 8, 1)  # "1 2 3" last seen at 5 -> what followed it
    assert p.lookup(tokens, 1) == (7,)
    assert p.lookup([5, 6, 7, 8], 3) == ()  # no earlier occurrence (the suffix itself does not count)
    assert p.lookup([4, 4, 4], 3) == (4,)  # "4 4" at 0 is followed by one token only
    assert p.lookup([1, 2], 3) == ()  # too short for min_n
    longest = NgramProposer(num_tokens=2, min_n=1, max_n=3)
    assert longest.lookup([5, 1, 2, 6, 2, 9, 1, 2], 2) == (6, 2)  # "1 2" beats the later "2"


def test_acceptance_rule() -> None:
    assert accepted_prefix([4, 5, 6, 7], (4, 5, 6)) == 3
    assert accepted_prefix([4, 9, 6, 7], (4, 5, 6)) == 1
    assert accepted_prefix([1], ()) == 0


def test_gate_backs_off_and_new_requests_start_from_the_engine_wide_state() -> None:
    gate = DraftGate(min_acceptance=0.25)
    gate.record(3, 3)
    assert gate.open and not gate.poor
    gate.record(3, 0)  # 0.5 * 1.0 + 0.5 * 0 = 0.5: still fine
    assert gate.open
    gate.record(3, 0)  # 0.25 ... then below
    gate.record(3, 0)
    assert not gate.open and gate.pause_left == 4 and gate.next_pause == 8
    for _ in range(4):
        gate.step()
    assert gate.open
    gate.record(3, 0)
    assert gate.pause_left == 8  # doubled
    fresh = gate.spawn()
    assert not fresh.open and fresh.pause_left == 8 and fresh.next_pause == 16
    gate.record(3, 3)
    assert gate.spawn().open  # a good round: new requests draft at once again
