"""The scheduler's forgets, one directory call out at a time (planning/coalesced_forgets.py):
what steps forget while a call is out goes in the next call, in order, merged per group;
an idle directory is called at once; a failed call is logged and the next one still made.
The forget calls themselves over a real pool: test_tracker_link.py."""

import concurrent.futures
from typing import Any, List

import pytest

from xinference.model.llm.vllm.xavier.planning.coalesced_forgets import CoalescedForgets


class Directory:
    """Records each forget call and answers it when the test says."""

    def __init__(self) -> None:
        self.calls: List[Any] = []
        self.futures: List[concurrent.futures.Future] = []

    def send(self, forgotten):
        self.calls.append({g: list(p) for g, p in forgotten.items()})
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.futures.append(fut)
        return fut


def test_forgets_made_while_a_call_is_out_go_in_the_next_call():
    d = Directory()
    forgets = CoalescedForgets(d.send)
    forgets.add({0: [(1, 2)]})
    assert d.calls == [{0: [(1, 2)]}]  # idle: at once
    forgets.add({0: [(3, 2)], 1: [(3, 2)]})
    forgets.add({0: [(4, 5)]})
    assert len(d.calls) == 1 and forgets.coalesced == 1
    d.futures[0].set_result(1)  # answered: what waited goes now, in one call
    assert d.calls[1] == {0: [(3, 2), (4, 5)], 1: [(3, 2)]}
    assert not forgets.flush(0.05)  # (its call is out)
    d.futures[1].set_result(3)
    assert forgets.flush(1.0) and forgets.calls == 2
    forgets.add({2: [(9, 1)]})  # idle again: at once
    assert d.calls[2] == {2: [(9, 1)]}


def test_a_failed_call_is_logged_and_the_next_still_made(caplog):
    d = Directory()
    forgets = CoalescedForgets(d.send)
    forgets.add({0: [(1, 2)]})
    forgets.add({0: [(2, 2)]})
    with caplog.at_level("WARNING"):
        d.futures[0].set_exception(ConnectionError("directory restarting"))
    assert "forgetting 1 reused in-place blocks failed" in caplog.text
    assert d.calls[1] == {0: [(2, 2)]}
    d.futures[1].set_result(1)
    assert forgets.flush(1.0)


def test_a_send_that_raises_does_not_stop_the_forgets():
    calls: List[Any] = []

    def send(forgotten):
        calls.append(forgotten)
        if len(calls) == 1:
            raise RuntimeError("no directory")
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(1)
        return done

    forgets = CoalescedForgets(send)
    forgets.add({0: [(1, 2)]})
    forgets.add({0: [(2, 2)]})
    assert calls == [{0: [(1, 2)]}, {0: [(2, 2)]}] and forgets.flush(1.0)


@pytest.mark.parametrize("steps", [1, 50])
def test_nothing_is_lost_whatever_the_answers_order(steps):
    d = Directory()
    forgets = CoalescedForgets(d.send)
    for i in range(steps):
        forgets.add({0: [(i, 1)]})
        if i % 7 == 3:
            d.futures[-1].set_result(1)
    while not forgets.flush(0.01):
        d.futures[-1].set_result(1)
    sent = [pair for call in d.calls for pair in call[0]]
    assert sent == [(i, 1) for i in range(steps)]
