"""RecordingStore, the one store double: each way of answering, each fault, what it records."""

from __future__ import annotations

import logging

import pytest

import mooncake_keys as mk
from mooncake_keys.store.recording import NOT_A_LIST, SHORT

KEYS = ["a", "b", "c"]


@pytest.mark.parametrize("store, answer", [
    (mk.RecordingStore(), [0, 0, 0]),
    (mk.RecordingStore(1), [1, 1, 1]),
    (mk.RecordingStore(True), [True] * 3),
    (mk.RecordingStore(-900), [-900] * 3),
    (mk.RecordingStore([1, 0]), [1, 0]),  # a scripted answer, whatever the keys
    (mk.RecordingStore(lambda keys: [len(k) for k in keys]), [1, 1, 1]),
    (mk.RecordingStore(present={"b"}), [0, 1, 0]),
    (mk.RecordingStore(present=["c", "a"]), [1, 0, 1]),
    (mk.RecordingStore(present={"a": 1, "b": -704}), [1, -704, 0]),
    (mk.RecordingStore(present=lambda k: 1 if k < "b" else 2), [1, 2, 2]),
])
def test_each_way_of_answering(store, answer):
    assert store.batch_is_exist(list(KEYS)) == answer
    assert store.calls == [KEYS] and (store.num_calls, store.keys_asked) == (1, 3)


def test_a_scripted_answer_is_the_very_list():
    answer = [1, 1, 1]
    assert mk.RecordingStore(answer).batch_is_exist(KEYS) is answer


def test_a_store_behind_answers_and_serves_every_other_call():
    backing = mk.MemoryStore()
    backing.put("b")
    store = mk.RecordingStore(backing)
    assert store.batch_is_exist(KEYS) == [0, 1, 0] and store.calls == [KEYS]
    assert store.put("c") == 0 and store.keys() == ["b", "c"]
    assert store.mutates_keys is False  # the MemoryStore's promise
    with pytest.raises(AttributeError, match="register_memory"):
        mk.RecordingStore().register_memory


@pytest.mark.parametrize("fault, outcome", [
    (ConnectionError("master unreachable"), ConnectionError),
    (TimeoutError, TimeoutError),
    (SHORT, [1, 1]),
    (NOT_A_LIST, None),
    (-900, [-900] * 3),
])
def test_each_fault(fault, outcome):
    store = mk.RecordingStore(1, fault=fault)
    for _ in range(2):  # the same exception again and again
        if isinstance(outcome, type):
            with pytest.raises(outcome):
                store.batch_is_exist(KEYS)
        else:
            assert store.batch_is_exist(KEYS) == outcome
    assert store.calls == [KEYS, KEYS]  # faulty calls are recorded too


def test_faults_on_chosen_calls_only():
    store = mk.RecordingStore(present={"a"}, fault=ConnectionError("gone"), fault_calls={1})
    assert store.batch_is_exist(KEYS) == [1, 0, 0]
    with pytest.raises(ConnectionError):
        store.batch_is_exist(KEYS)
    assert store.batch_is_exist(KEYS) == [1, 0, 0]


def test_counting_without_recording_keeps_no_key():
    store = mk.RecordingStore([1, 1, 1], record_keys=False)
    store.batch_is_exist(KEYS)
    assert store.calls == [] and (store.num_calls, store.keys_asked, store.keys_present) == (1, 3, 0)


def test_keys_present_counts_the_answers_exactly_one():
    """The read leases a real store would have granted: answers of exactly 1, faulty calls none."""
    store = mk.RecordingStore(present={"a": 1, "b": True, "c": -900}, fault=ConnectionError("gone"), fault_calls={1})
    store.batch_is_exist(KEYS)
    with pytest.raises(ConnectionError):
        store.batch_is_exist(KEYS)
    assert (store.num_calls, store.keys_asked, store.keys_present) == (2, 6, 2)


def test_check_keys_refuses_anything_but_a_list_of_str():
    store = mk.RecordingStore(check_keys=True)
    assert store.batch_is_exist(["a"]) == [0]
    for keys in (("a",), ["a", b"b"]):
        with pytest.raises(TypeError, match="not a list of str"):
            store.batch_is_exist(keys)


def test_mutates_keys_is_false_only_where_it_is_true():
    assert mk.RecordingStore().mutates_keys is False
    assert mk.RecordingStore(present={"a"}).mutates_keys is False
    assert mk.RecordingStore(lambda keys: keys).mutates_keys is True  # a function may keep the list

    class Unknown:
        def batch_is_exist(self, keys):
            return [0] * len(keys)

    assert mk.RecordingStore(Unknown()).mutates_keys is True


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="either answer or present"):
        mk.RecordingStore(1, present={"a"})
    with pytest.raises(ValueError, match="fault must be"):
        mk.RecordingStore(fault="slow")
    with pytest.raises(TypeError, match="answer must be"):
        mk.RecordingStore(answer=1.5)


def test_close_does_nothing_and_the_engine_uses_it(caplog):
    store = mk.RecordingStore(1, fault=SHORT)
    engine = mk.LookupEngine("m", [mk.FullAttentionSpec(16)], mk.ParallelLayout(), hash_block_size=16, store=store)
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        assert engine.lookup(64, [bytes([i]) * 16 for i in range(4)]) == 0
    assert "returned 3 results for 4 keys" in caplog.text
    store.close()
    assert store.num_calls == 1
