"""What a lookup asked in rounds guarantees when the store changes between its rounds, on a real
mooncake_master (docs/mooncake.md, "A lookup while the store changes").

Every chunk a lookup counts present was present in every namespace when its round asked it. On
Mooncake each key answered present also took a read lease (``--default_kv_lease_ttl``; the
test master's is 200 ms): it cannot be removed or evicted meanwhile, so at the end of a lookup
shorter than the lease, every chunk it counts present is still there, and the hit is at most
the one-shot hit of the store as it is then (keys saved during the lookup may be missed: a
smaller hit, never one that cannot load). Against each release's master (0.3.13.post1's and
0.3.14's, with the 0.3.13.post1 client: its batch_is_exist leases on both).
"""

from __future__ import annotations

import pytest

import mooncake_keys as mk

pytestmark = pytest.mark.mooncake

F = mk.FullAttentionSpec
LAYOUT = mk.ParallelLayout(tp_size=2, num_kv_heads=2)
HASHES = [bytes([i % 256, i // 256]) * 16 for i in range(1024)]


class ChangeBetweenRounds:
    """The real store, which ``change`` alters once, after the lookup's first round."""

    def __init__(self, store, change):
        self.store = store
        self.change = change
        self.calls = 0
        self.changed = None

    def batch_is_exist(self, keys):
        if self.calls == 1:
            self.changed = self.change()
        self.calls += 1
        return self.store.batch_is_exist(keys)


def engine(store, strategy="rounds"):
    return mk.LookupEngine("m", [F(16)], LAYOUT, hash_block_size=16, store=store, strategy=strategy,
                           rounds_min_keys=0, key_cache_bytes=0)


def put_all(store, keys):
    for k in keys:
        assert store.put(k, b"kv") == 0, k


def test_a_save_and_a_removal_between_rounds_never_give_a_hit_that_cannot_load(each_master_store):
    store = each_master_store
    keys = engine(mk.RecordingStore()).candidate_keys(1024 * 16, HASHES)
    put_all(store, keys[: 300 * 2])  # 300 chunks stored, both namespaces

    def change():
        # Remove the first chunks (answered present by round 1: leased, so refused) and save
        # chunks 300-599 (round 1 found them absent).
        refused = [rc for rc in store.batch_remove(keys[:16 * 2]) if rc != 0]
        put_all(store, keys[300 * 2: 600 * 2])
        return refused

    live = ChangeBetweenRounds(store, change)
    hit = engine(live).lookup(1024 * 16, HASHES)
    assert live.calls >= 2 and len(live.changed) == 32  # every removal refused: the keys are leased
    after = engine(store, "oneshot").lookup(1024 * 16, HASHES)
    assert after == 600 * 16  # the store as it is now
    assert 300 * 16 <= hit <= after
    # Every chunk the lookup counts is in the store now: the hit loads.
    assert all(store.batch_is_exist(keys[: hit // 16 * 2]))


def test_without_leases_a_chunk_counted_may_have_gone(each_master_store):
    """A forced removal (or a store without leases) takes keys the first round found: the hit
    still counts them; what holds is only that each was present when it was asked."""
    store = each_master_store
    keys = engine(mk.RecordingStore()).candidate_keys(1024 * 16, HASHES)
    put_all(store, keys[: 300 * 2])
    live = ChangeBetweenRounds(store, lambda: store.batch_remove(keys[:2], force=True))
    hit = engine(live).lookup(1024 * 16, HASHES)
    assert hit == 300 * 16  # chunk 0 was present when round 1 asked it
    assert engine(store, "oneshot").lookup(1024 * 16, HASHES) == 0  # gone now
