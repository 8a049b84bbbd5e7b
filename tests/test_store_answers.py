"""What the engine makes of a store's answer: anything but a list (or tuple) of the right length
answers 0 with one log line, items other than exactly 1 count as absent, and error codes that
end the hit get one line. Both cores (the ``impl`` fixture); an answer that could crash the
interpreter is tried in a child process."""

from __future__ import annotations

import logging

import pytest

import mooncake_keys as mk
from support.child import run_child

F = mk.FullAttentionSpec
HS = [bytes([i]) * 16 for i in range(8)]


def engine(store, **kw):
    kw.setdefault("layout", mk.ParallelLayout(tp_size=2, num_kv_heads=2))
    return mk.LookupEngine("m", [F(16)], kw.pop("layout"), hash_block_size=16, store=store, **kw)


@pytest.mark.parametrize("core", ["c", "py"])
def test_an_answer_that_empties_itself_while_read_does_not_crash(core):
    """An item whose ``__eq__`` empties the list used to crash the compiled core (SIGSEGV)."""
    out = run_child(f"""
        import mooncake_keys as mk
        class Emptier:
            def __init__(self, lst): self.lst = lst
            def __eq__(self, other): self.lst.clear(); return True
            __hash__ = object.__hash__
        def answer(keys):
            res = [1] * len(keys)
            res[3] = Emptier(res)
            return res
        try:
            e = mk.LookupEngine("m", [mk.FullAttentionSpec(16)], mk.ParallelLayout(tp_size=2, num_kv_heads=2),
                                hash_block_size=16, store=mk.RecordingStore(answer), core={core!r})
        except ValueError as exc:  # no compiled core here
            print("SKIP", exc); raise SystemExit(0)
        print("HIT", e.lookup(128, [bytes([i]) * 16 for i in range(8)]))
    """)
    assert out.returncode == 0, out.stderr
    if not out.stdout.startswith("SKIP"):
        assert out.stdout.split() == ["HIT", "16"]  # chunk 1's answer is not an int 1: absent


ODD = {
    "dict": lambda keys: {k: 1 for k in keys},
    "set": lambda keys: {1},
    "str": lambda keys: "1" * len(keys),
    "bytes": lambda keys: b"\x01" * len(keys),
    "None": lambda keys: None,
    "int": lambda keys: 1,
    "generator": lambda keys: (1 for _ in keys),
    "iter raises": lambda keys: type("L", (list,), {"__iter__": lambda self: iter(()).__next__()})([1] * len(keys)),
    "len raises": lambda keys: type("L", (list,), {"__len__": lambda self: 1 // 0})([1] * len(keys)),
}


@pytest.mark.parametrize("kind", sorted(ODD))
def test_an_answer_that_is_not_a_list_is_zero_with_one_line_on_both_cores(impl, kind, caplog):
    e = engine(mk.RecordingStore(ODD[kind]))
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        assert e.lookup(128, HS) == 0
    lines = [r for r in caplog.records if r.name.startswith("mooncake_keys")]
    assert len(lines) == 1 and "lookup answered 0" in lines[0].getMessage()


def test_numpy_and_list_subclasses(impl, caplog):
    np = pytest.importorskip("numpy")
    assert engine(mk.RecordingStore(lambda keys: np.ones(len(keys), dtype=np.int64))).lookup(128, HS) == 0

    class GetitemRaises(list):  # iteration does not use __getitem__: its items are read
        def __getitem__(self, i):
            raise RuntimeError("no")

    assert engine(mk.RecordingStore(lambda keys: GetitemRaises([1] * len(keys)))).lookup(129, HS) == 128
    assert engine(mk.RecordingStore(lambda keys: tuple([1] * len(keys)))).lookup(129, HS) == 128
    assert engine(mk.RecordingStore(lambda keys: [np.int64(1)] * len(keys))).lookup(128, HS) == 0  # not an int


def test_error_codes_that_end_the_hit_get_one_line(impl, caplog):
    e = mk.LookupEngine("m", [F(16)], mk.ParallelLayout(tp_size=2, num_kv_heads=2), hash_block_size=16,
                        store=mk.RecordingStore(-900))
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        assert e.lookup(128, HS) == 0
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("mooncake_keys")]
    assert len(lines) == 1 and "error code [-900]" in lines[0], lines
    caplog.clear()
    # A code past the first absent chunk does not end the hit there: no line.
    e = mk.LookupEngine("m", [F(16)], mk.ParallelLayout(tp_size=2, num_kv_heads=2), hash_block_size=16,
                        store=mk.RecordingStore(lambda keys: [1, 1, 0, 1] + [-900] * (len(keys) - 4)))
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        assert e.lookup(128, HS) == 16
    assert not [r for r in caplog.records if r.name.startswith("mooncake_keys")]


def test_an_error_code_that_ends_the_hit_is_a_fault_and_the_store_unavailable(impl):
    """Mooncake answers -900 for every key when its master cannot be reached: the hit up to the
    first absent chunk stands, but the lookup's record says fault and the unavailable clock
    runs until a call is answered without a code."""
    import time

    layout = mk.ParallelLayout(tp_size=2, num_kv_heads=2)
    hashes = [bytes([i]) * 16 for i in range(8)]
    records = []
    e = mk.LookupEngine("m", [mk.FullAttentionSpec(16)], layout, hash_block_size=16, strategy="oneshot",
                        store=mk.RecordingStore(lambda keys: [1] * 4 + [-900] * (len(keys) - 4)))
    e.observer = records.append
    assert e.lookup(128, hashes) == 32  # chunks 0 and 1 present in both namespaces
    assert records[-1].outcome == "fault" and e.stats().store_failures == 0
    time.sleep(0.01)
    assert e.stats().unavailable_seconds > 0
    e.store = mk.RecordingStore(lambda keys: [1] * 6 + [0] * (len(keys) - 6))  # answered again
    assert e.lookup(128, hashes) == 48 and records[-1].outcome == "hit"
    assert records[-1].unavailable_seconds > 0  # the down time, counted once, in the next record
    frozen = e.stats().unavailable_seconds
    time.sleep(0.01)
    assert e.stats().unavailable_seconds == frozen
