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
    s = SharedLoads(16, hold_s=1.0, clock=clock, on_wait=lambda seconds, outcome: waits.append((seconds, outcome)))
    s.loading("a", SYSTEM, 0, 64)
    assert not s.waits("a", SYSTEM, 0) and waits == []  # never held: nothing to report
    assert s.waits("b", SYSTEM, 0) and s.waits("c", SYSTEM, 0)
    clock.now += 0.25
    assert s.waits("b", SYSTEM, 0)
    s.step(["a"])
    s.step([])  # a's blocks are vLLM's now
    assert not s.waits("b", SYSTEM, 64) and not s.waits("b", SYSTEM, 64)
    assert waits == [(0.25, "landed")]
    s.loading("d", SYSTEM, 0, 64)
    assert s.waits("c", SYSTEM, 0)  # c, held since the start, now waits for d's load
    assert waits == [(0.25, "landed")]
    clock.now += 1.0
    assert not s.waits("c", SYSTEM, 0)
    assert waits == [(0.25, "landed"), (1.25, "expired")]


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


def test_a_wait_on_a_load_that_never_landed_is_not_reported_landed():
    """The load a request waits for is forgotten without landing (not reported finished within
    hold_s, or its request aborted): the wait ends "dropped", never "landed"."""
    clock = Clock()
    waits = []
    s = SharedLoads(16, hold_s=1.0, clock=clock, on_wait=lambda seconds, outcome: waits.append((seconds, outcome)))
    s.loading("a", SYSTEM, 0, 64)
    clock.now += 0.6
    assert s.waits("b", SYSTEM, 0)  # b held from 100.6
    clock.now += 0.5
    s.step([])  # a's load started 1.1 s ago and never finished: forgotten
    assert len(s) == 0
    assert not s.waits("b", SYSTEM, 0)  # b's own hold has not run out (0.5 s)
    assert waits == [(pytest.approx(0.5), "dropped")]
    s.loading("c", SYSTEM, 0, 64)
    assert s.waits("d", SYSTEM, 0)
    s.finished(["c"])  # aborted before its load landed
    assert not s.waits("d", SYSTEM, 0)
    assert waits[-1] == (0.0, "dropped")
    s.loading("e", SYSTEM, 0, 64)
    assert s.waits("f", SYSTEM, 0)
    s.step(["e"])
    s.finished(["e"])  # finished once its load had landed
    assert not s.waits("f", SYSTEM, 0)
    assert waits[-1] == (0.0, "landed")
    assert [o for _, o in waits] == ["dropped", "dropped", "landed"]


def test_a_request_is_held_at_most_hold_s_in_all_even_on_one_load_then_another():
    """Held on a's load, then (a's load forgotten at the step that also ends b's hold) on c's:
    never more than hold_s in all, and a request that went on is never held again."""
    clock = Clock()
    waits = []
    s = SharedLoads(16, hold_s=1.0, clock=clock, on_wait=lambda seconds, outcome: waits.append((seconds, outcome)))
    s.loading("a", SYSTEM, 0, 64)
    assert s.waits("b", SYSTEM, 0)
    held = [clock.now]
    for _ in range(40):  # steps of 62.5 ms; a new load of the same blocks each time the last is forgotten
        clock.now += 0.0625
        s.step([])
        if not s._loads:
            s.loading(f"c{clock.now}", SYSTEM, 0, 64)
        if s.waits("b", SYSTEM, 0):
            held.append(clock.now)
    assert held[-1] - held[0] < 1.0  # every poll answered "pending" within 1 s of the first
    assert len(waits) == 1 and waits[0] == (1.0, "expired")  # reported at the step that ended it
    assert not s.waits("b", SYSTEM, 0)  # went on: never held again
    # the same with the hold swept by step() first
    s2 = SharedLoads(16, hold_s=1.0, clock=clock)
    s2.loading("a", SYSTEM, 0, 64)
    start = clock.now
    assert s2.waits("b", SYSTEM, 0)
    clock.now += 0.99
    s2.step([])
    clock.now += 0.02
    s2.step([])  # a's load forgotten and b's hold swept in one step
    s2.loading("c", SYSTEM, 0, 64)
    assert not s2.waits("b", SYSTEM, 0) and clock.now - start < 1.1


def test_a_request_held_once_is_held_again_only_after_it_finished():
    clock = Clock()
    s = SharedLoads(16, clock=clock)
    s.loading("a", SYSTEM, 0, 64)
    assert s.waits("b", SYSTEM, 0)
    s.step(["a"])
    s.step([])
    assert not s.waits("b", SYSTEM, 0)  # went on (landed)
    s.loading("c", SYSTEM, 0, 64)
    assert not s.waits("b", SYSTEM, 0)  # never held again
    s.finished(["b"])
    assert s.waits("b", SYSTEM, 0)  # a new request of the same id


def test_the_tables_stay_bounded_over_many_requests():
    from mooncake_keys.lookup import shared_loads as sl

    clock = Clock()
    s = SharedLoads(16, clock=clock)
    most = {}
    for i in range(5000):
        req = chain(f"r{i}-", 8)
        leader = f"L{i}"
        s.loading(leader, SYSTEM + req, 0, 16 * 12)
        for j in range(3):
            s.waits(f"w{i}-{j}", SYSTEM + chain(f"w{i}-{j}-", 4), 0)
        clock.now += 0.01
        s.step([f"L{i - 1}"])
        if i % 7 == 0:  # some waiters finish, some leaders are aborted
            s.finished([f"w{i - 3}-0", f"L{i - 5}"])
        for name, size in s.sizes().items():
            most[name] = max(most.get(name, 0), size)
    assert most["loads"] <= 3 and most["owned_hashes"] <= 3 * 12
    assert most["held"] <= 3 * 100 + 3  # requests held less than hold_s: 100 steps of 10 ms
    assert most["released"] <= sl.MAX_RELEASED
