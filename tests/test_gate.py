"""The call gate shared by the Mooncake adapter and the KV pool."""

import threading
import time

from mooncake_keys._gate import CallGate


def test_close_waits_for_calls_in_flight_and_refuses_new_ones():
    gate = CallGate()
    assert gate.enter()
    closed_at = []
    closer = threading.Thread(target=lambda: closed_at.append((gate.close(), time.monotonic())))
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive() and gate.closed  # closing: new calls refused, old one still running
    assert not gate.enter()
    left_at = time.monotonic()
    gate.leave()
    closer.join(2)
    assert closed_at and closed_at[0][0] is True and closed_at[0][1] >= left_at
    assert gate.close() is False  # a second close is not the first
