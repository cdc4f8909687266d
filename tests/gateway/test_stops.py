"""Stop strings on text that arrives in pieces: cut before the first stop, hold back what could
still become one, never hold back more."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from gateway.stops import StopMatcher


def test_a_stop_string_split_across_pieces_is_found_and_cut():
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == "abc "  # "ST" may begin the stop string: held back
    assert m.push("O") == ""
    assert m.push("P tail") == ""
    assert m.matched == "STOP"
    assert m.push("more") == ""


def test_a_held_tail_is_released_when_it_stops_matching():
    m = StopMatcher(["STOP"])
    assert m.push("x S") == "x "
    assert m.push("Tx") == "STx"
    assert m.matched is None


def test_the_stop_that_completes_first_wins_whatever_the_list_order():
    m = StopMatcher(["world", "lo"])
    assert m.push("hello world") == "hel"
    assert m.matched == "lo"
    m = StopMatcher(["a", "baa"])  # "baa" starts earlier, but "a" is complete first
    assert m.push("baa") == "b"
    assert m.matched == "a"


def test_final_releases_the_held_tail():
    m = StopMatcher(["STOP"])
    assert m.push("end ST") == "end "
    assert m.push("", final=True) == "ST"


def test_no_stops_and_unchecked_text_pass_straight_through():
    assert StopMatcher([]).push("anything") == "anything"
    m = StopMatcher(["a"])
    assert m.push("banana", check=False) == "banana"
    assert m.push("xa", check=True) == "x"


@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_pieces_give_the_same_cut_as_the_whole_text(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    m = StopMatcher(stops)
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out = "".join(m.push(p) for p in pieces) + m.push("", final=True)
    # Reference: scan the whole text for the stop that completes first (then the longest).
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    assert out == (text[: min(hits)[1]] if hits else text)
    assert (m.matched is not None) == bool(hits)
