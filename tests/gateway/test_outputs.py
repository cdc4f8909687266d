"""TokenTracker: outputs that repeat (a restarted ledger re-runs from scratch) or arrive out of
order still give each token once, in order, with no gap."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.output_reader import TokenTracker
from services.wire.messages import RequestOutput


def out(position, ids, reason=None, **kw):
    return RequestOutput(
        "r", ids, position, finished=reason is not None, finish_reason=reason, **kw
    )


def test_in_order_outputs_accumulate_and_the_last_one_finishes():
    t = TokenTracker()
    assert t.accept(out(0, [1, 2], num_cached_tokens=16)) == [1, 2]
    assert t.accept(out(2, [3], "length")) == [3]
    assert t.token_ids == [1, 2, 3] and t.finished and t.final.finish_reason == "length"
    assert t.num_cached_tokens == 16
    assert t.accept(out(3, [4])) == []  # nothing counts after the finish


def test_repeated_positions_are_dropped_and_overlaps_keep_only_new_tokens():
    t = TokenTracker()
    t.accept(out(0, [1, 2, 3]))
    assert t.accept(out(0, [1, 2, 3])) == []  # a whole repeat
    assert t.accept(out(2, [3, 4, 5])) == [4, 5]  # a re-run that overtakes
    assert t.token_ids == [1, 2, 3, 4, 5]


def test_an_output_after_a_gap_waits_for_the_missing_positions():
    t = TokenTracker()
    assert t.accept(out(2, [3], "stop", stop_token_id=3)) == []
    assert t.accept(out(1, [2])) == []
    assert not t.finished
    assert t.accept(out(0, [1])) == [1, 2, 3]
    assert t.finished and t.final.stop_token_id == 3


def test_abort_and_error_end_the_request_wherever_they_sit():
    t = TokenTracker()
    t.accept(out(0, [1]))
    assert t.accept(out(5, [], "error", error="boom")) == []
    assert t.finished and t.final.error == "boom" and t.token_ids == [1]


@given(
    tokens=st.lists(st.integers(0, 255), min_size=1, max_size=20),
    chunk=st.integers(1, 4),
    data=st.data(),
)
def test_any_delivery_order_with_repeats_gives_the_exact_sequence(tokens, chunk, data):
    starts = range(0, len(tokens), chunk)
    outs = [out(i, tokens[i : i + chunk]) for i in starts]
    outs[-1] = out(outs[-1].position, outs[-1].new_token_ids, "length")
    delivered = data.draw(st.permutations(outs + data.draw(st.lists(st.sampled_from(outs)))))
    t = TokenTracker()
    seen = [i for o in delivered for i in t.accept(o)]
    assert seen == tokens == t.token_ids
    assert t.finished
