"""The call gate shared by the Mooncake adapter and the KV pool."""

import threading
import time

import pytest

from mooncake_keys.store.gate import CallGate, GateClosed


def test_close_waits_for_calls_in_flight_and_refuses_new_ones():
    gate = CallGate()
    inside, release = threading.Event(), threading.Event()
    left_at = []

    def call():
        with gate.call():
            inside.set()
            release.wait(5)
            left_at.append(time.monotonic())

    caller = threading.Thread(target=call)
    caller.start()
    assert inside.wait(5)
    closed_at = []
    closer = threading.Thread(target=lambda: closed_at.append((gate.close(), time.monotonic())))
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive() and gate.closed  # closing: new calls refused, old one still running
    with pytest.raises(GateClosed, match="closed"):
        with gate.call():
            pass
    release.set()
    caller.join(2)
    closer.join(2)
    assert closed_at and closed_at[0][0] is True and closed_at[0][1] >= left_at[0]
    assert gate.close() is False  # a second close is not the first


def test_a_call_that_raises_still_leaves():
    gate = CallGate()
    with pytest.raises(RuntimeError):
        with gate.call():
            raise RuntimeError("boom")
    done = []
    t = threading.Thread(target=lambda: done.append(gate.close()))
    t.start()
    t.join(2)
    assert done == [True]  # nothing left in flight: close did not hang


def test_a_second_close_waits_for_the_first_to_finish():
    gate = CallGate()
    started, finish = threading.Event(), threading.Event()
    order = []

    def on_close():
        started.set()
        finish.wait(5)
        order.append("first done")

    first = threading.Thread(target=lambda: gate.close(on_close))
    first.start()
    assert started.wait(5)
    second = threading.Thread(target=lambda: order.append(("second returned", gate.close(lambda: order.append("ran twice")))))
    second.start()
    time.sleep(0.1)
    assert second.is_alive()  # still waiting for the first close's on_close
    finish.set()
    first.join(2)
    second.join(2)
    assert order == ["first done", ("second returned", False)]
