"""SharedLoads: a request waits while another request's load brings in the first block it would
load, at most hold_s; loads are forgotten when they land (one step later), finish or expire."""

import pytest

from mooncake_keys.lookup.shared_loads import SharedLoads


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def chain(prefix, n):
    return [f"{prefix}{i}".encode() for i in range(n)]


SYSTEM = chain("sys", 4)  # 4 blocks of 16 tokens shared by everyone


def test_a_follower_waits_for_the_leaders_load_then_loads_only_its_own_blocks():
    clock = Clock()
    s = SharedLoads(16, clock=clock)
    a, b = SYSTEM + chain("a", 2), SYSTEM + chain("b", 2)
    assert not s.waits("a", a, 0)
    s.loading("a", a, 0, 96)  # a loads all 6 blocks
    assert s.waits("b", b, 0) and s.holds == 1  # b's first block is in a's load
    clock.now += 0.05
    s.step([])  # a's load not finished
    assert s.waits("b", b, 0)
    s.step(["a"])  # landed: kept one step more (vLLM caches the blocks during the next schedule)
    assert s.waits("b", b, 0)
    assert not s.waits("b", b, 64)  # once cached, b's first block to load is its own
    s.step([])
    assert not s.waits("b", b, 0) and len(s) == 0


def test_a_request_never_waits_for_itself_nor_for_blocks_it_does_not_load():
    s = SharedLoads(16, clock=Clock())
    a = SYSTEM + chain("a", 2)
    s.loading("a", a, 32, 64)  # a had 2 blocks cached and loads blocks 2..5
    assert not s.waits("a", a, 32)
    assert not s.waits("c", chain("other", 6), 0)
    assert not s.waits("b", SYSTEM + chain("b", 2), 0)  # block 0 is not in a's load
    assert s.waits("b", SYSTEM + chain("b", 2), 32)
    assert not s.waits("b", SYSTEM, 64)  # nothing left to load


def test_a_hold_ends_after_hold_s_and_a_load_never_reported_is_forgotten():
    clock = Clock()
    s = SharedLoads(16, hold_s=1.0, clock=clock)
    s.loading("a", SYSTEM, 0, 64)
    assert s.waits("b", SYSTEM, 0)
    clock.now += 0.99
    assert s.waits("b", SYSTEM, 0)
    clock.now += 0.02
    assert not s.waits("b", SYSTEM, 0)  # waited 1 s: loads it itself
    s.step([])  # a's load started over 1 s ago: forgotten
    assert len(s) == 0 and not s.waits("c", SYSTEM, 0)


def test_each_wait_is_reported_once_when_the_request_goes_on():
    clock = Clock()
    waits = []
    s = SharedLoads(16, hold_s=1.0, clock=clock, on_wait=lambda seconds, expired: waits.append((seconds, expired)))
    s.loading("a", SYSTEM, 0, 64)
    assert not s.waits("a", SYSTEM, 0) and waits == []  # never held: nothing to report
    assert s.waits("b", SYSTEM, 0) and s.waits("c", SYSTEM, 0)
    clock.now += 0.25
    assert s.waits("b", SYSTEM, 0)
    s.step(["a"])
    s.step([])  # a's blocks are vLLM's now
    assert not s.waits("b", SYSTEM, 64) and not s.waits("b", SYSTEM, 64)
    assert waits == [(0.25, False)]
    s.loading("d", SYSTEM, 0, 64)
    assert s.waits("c", SYSTEM, 0)  # c, held since the start, now waits for d's load
    assert waits == [(0.25, False)]
    clock.now += 1.0
    assert not s.waits("c", SYSTEM, 0)
    assert waits == [(0.25, False), (1.25, True)]


def test_finished_and_aborted_requests_leave_nothing_behind():
    clock = Clock()
    s = SharedLoads(16, clock=clock)
    s.loading("a", SYSTEM, 0, 64)
    assert s.waits("b", SYSTEM, 0)
    s.finished(["a", "b"])
    assert len(s) == 0 and not s._owner and not s._held
    s.loading("a", SYSTEM, 0, 64)
    assert s.waits("b", SYSTEM, 0)
    clock.now += 2
    s.step([])  # b was held, then aborted: its entry is swept
    assert not s._held and not s._owner


def test_a_request_loading_again_replaces_its_previous_load():
    s = SharedLoads(16, clock=Clock())
    s.loading("a", SYSTEM, 0, 64)
    s.loading("a", SYSTEM, 32, 32)
    assert len(s) == 1 and set(s._owner) == set(SYSTEM[2:])


def test_tokens_not_a_whole_block_and_short_hash_lists():
    s = SharedLoads(16, clock=Clock())
    s.loading("a", SYSTEM[:2], 0, 1000)  # claims more than its hashes: only its hashes are held
    assert set(s._owner) == set(SYSTEM[:2])
    assert not s.waits("b", SYSTEM[:2], 32)  # index past the list
    s.loading("c", SYSTEM, 0, 40)  # 2.5 blocks: the 2 whole ones
    assert len(s._owner) == 2


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-16, ValueError), (1.5, TypeError), ("16", TypeError),
                                        (None, TypeError), (True, TypeError)])
def test_hash_block_tokens_is_checked(bad, error):
    with pytest.raises(error, match="hash_block_tokens"):
        SharedLoads(bad)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (float("nan"), ValueError), ("1", TypeError)])
def test_hold_s_is_checked(bad, error):
    with pytest.raises(error, match="hold_s"):
        SharedLoads(16, hold_s=bad)
