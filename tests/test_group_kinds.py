"""Mamba (align mode) and chunked local attention groups: the hit rules, namespaces and refusals
of each vLLM release, on worked examples read from vLLM's code and checked against its real
workers (tests/against_vllm compares thousands of random deployments of every release).

Chunk ``j`` of a group of ``bs`` tokens is keyed by the request's hash at index
``(j + 1) * bs // hash_block_size - 1``; the stores below say which (group, hash index) exist.
"""

from __future__ import annotations

import re

import pytest

import mooncake_keys as mk

F, SWA, M, CL = mk.FullAttentionSpec, mk.SlidingWindowSpec, mk.MambaSpec, mk.ChunkedLocalAttentionSpec
HASHES = [bytes([i]) * 32 for i in range(80)]
_INDEX = {h.hex(): i for i, h in enumerate(HASHES)}


def store(present):
    """A store holding ``(group, hash index)`` pairs for which ``present(g, i)`` is true, in every
    namespace."""
    def answer(key):
        g = int(re.search(r"@group:(\d+)@", key).group(1))
        return int(bool(present(g, _INDEX[key.rsplit("@", 1)[1]])))

    return mk.RecordingStore(present=answer)


def engine(groups, present, *, compat="0.33", hbs=64, layout=None, **kw):
    return mk.LookupEngine("m", groups, layout or mk.ParallelLayout(), hash_block_size=hbs, store=store(present),
                           vllm_compat=compat, strategy="oneshot", **kw)


def chunks(*js, bs=64, hbs=64):
    """The hash indices keying chunks ``js`` of a group of ``bs`` tokens."""
    return {(j + 1) * bs // hbs - 1 for j in js}


def test_mamba_hits_the_last_stored_state_with_full_attention_before_it():
    states = chunks(3, 6)
    hybrid = [F(64), M(64)]
    full_everywhere = engine(hybrid, lambda g, i: g == 0 or i in states)
    # 640 tokens: every full chunk, states after 256 and 448 tokens; the hit of all 640 is
    # re-derived at 576 (the last token is computed) and ends at the state after 448.
    assert full_everywhere.lookup(640, HASHES[:10]) == 448
    full_short = engine(hybrid, lambda g, i: (g == 0 and i < 5) or (g == 1 and i in states))
    assert full_short.lookup(640, HASHES[:10]) == 256  # full attention ends at 320: the state at 256
    # A state whose end is not aligned to the scheduler block (lcm 128) is skipped, not a stop.
    wider = engine([F(128), M(64)], lambda g, i: g == 0 or i in chunks(1, 2))
    assert wider.lookup(640, HASHES[:10]) == 128


def test_mamba_partial_hash_hits_end_on_the_last_stored_unit():
    hybrid = engine([F(64), M(64)], lambda g, i: g == 0 or i in (13, 22), hbs=16, partial_hash_hits=True)
    assert hybrid.lookup(640, HASHES[:40]) == 368  # unit 22 ends at 368 tokens
    # Tail key boundaries: full attention's tail block is keyed at its block end (320 is the
    # first present unit at or after 288), Mamba's at the hit itself.
    units = engine([F(64), M(64)], lambda g, i: (g == 0 and i % 4 == 3 and i < 20) or (g == 1 and i in (13, 17)),
                   hbs=16, partial_hash_hits=True)
    r = units.lookup_result(640, HASHES[:40])
    assert (r.hit_length, [(b.group_id, b.num_tokens) for b in r.tail_key_boundaries]) == (288, [(0, 320), (1, 288)])


def test_a_pure_mamba_model_before_and_after_the_rederivation():
    states = chunks(3, 9)
    assert engine([M(64)], lambda g, i: i in states, compat="0.33").lookup(640, HASHES[:10]) == 256
    assert engine([M(64)], lambda g, i: i in states, compat="0.33").lookup(600, HASHES[:10]) == 256
    assert engine([M(64)], lambda g, i: i in states, compat="0.25").lookup(640, HASHES[:10]) == 640


@pytest.mark.parametrize("compat, all_present, full_short", [
    ("0.25", 640, 384), ("0.26", 640, 384),  # EAGLE looks a block past the hit in the Mamba group too
    ("0.27", 576, 320), ("0.30", 576, 320), ("0.33", 576, 320),  # no look-ahead for a state
])
def test_mamba_with_eagle_per_release(compat, all_present, full_short):
    hybrid = [F(64), M(64)]
    assert engine(hybrid, lambda g, i: True, compat=compat, use_eagle=True).lookup(640, HASHES[:10]) == all_present
    short = engine(hybrid, lambda g, i: g == 1 or i < 6, compat=compat, use_eagle=True)
    assert short.lookup(640, HASHES[:10]) == full_short


def test_chunked_local_attention_reads_only_the_last_attention_chunk():
    hybrid = [F(64), CL(64, 256)]
    assert engine(hybrid, lambda g, i: True).lookup(1280, HASHES[:20]) == 1216  # re-derived at 1216
    # Full attention ends at 704 (11 chunks): the window from 512 needs chunks 8..10.
    assert engine(hybrid, lambda g, i: g == 1 and i >= 8 or g == 0 and i < 11).lookup(1280, HASHES[:20]) == 704
    assert engine(hybrid, lambda g, i: g == 1 and i in (8, 9) or g == 0 and i < 11).lookup(1280, HASHES[:20]) == 640
    # Chunks before the window are asked (as vLLM asks them) but never read.
    e = engine(hybrid, lambda g, i: g == 0 and i < 11 or g == 1 and i >= 8)
    e.lookup(1280, HASHES[:20])
    assert len(e.store.calls[0]) == 40


def test_mamba_has_one_namespace_per_rank_where_namespaces_are_per_group():
    layout = mk.ParallelLayout(tp_size=2, num_kv_heads=1)
    old = engine([F(64), M(64)], lambda g, i: True, compat="0.26", layout=layout)
    assert [len(ns) for ns in old.group_namespaces] == [1, 1]  # the layout decides for every group
    new = engine([F(64), M(64)], lambda g, i: True, compat="0.27", layout=layout)
    assert new.group_namespaces == (((0, 0, 0, 0),), ((0, 0, 0, 0), (1, 0, 0, 0)))
    # Each TP rank writes its own state.
    assert new.deployment.writer(1, (1, 0, 0, 0)) == ((1, 0, 0, 0), 1)


def test_what_vllm_cannot_look_up_is_refused():
    with pytest.raises(ValueError, match="chunked local attention group .* cannot be an EAGLE group"):
        engine([F(64), CL(64, 256)], lambda g, i: True, use_eagle=True)
    with pytest.raises(ValueError, match="chunked local attention group .* aligned to its block size"):
        engine([F(128), CL(64, 256)], lambda g, i: True)
    with pytest.raises(ValueError, match="aligned to its block size, not 16 tokens"):
        engine([F(64), CL(64, 256), M(64)], lambda g, i: True, hbs=16, partial_hash_hits=True)
    # vLLM 0.27-0.29 raise on every lookup of partial hash hits beside a wider sliding window.
    for compat in ("0.27", "0.28", "0.29"):
        with pytest.raises(ValueError, match=f"vLLM {compat} cannot look up partial hash hits with a sliding-window"):
            engine([F(64), M(64), SWA(64, 100)], lambda g, i: True, hbs=16, partial_hash_hits=True, compat=compat)
    assert engine([F(64), M(64), SWA(64, 100)], lambda g, i: True, hbs=16, partial_hash_hits=True,
                  compat="0.30").lookup(640, HASHES[:40]) > 0


def test_new_kinds_check_their_arguments():
    with pytest.raises(ValueError, match="attention_chunk_size"):
        CL(64, 0)
    with pytest.raises(TypeError, match="variant must be hashable"):
        M(64, variant={"a": 1})
    with pytest.raises(TypeError, match="spec must be one of FullAttentionSpec, SlidingWindowSpec, "
                                        "ChunkedLocalAttentionSpec, MambaSpec"):
        mk.KVCacheGroup("mamba")
    # A variant tells apart specs vLLM would not merge (another spec class, another dtype...).
    e = engine([F(64), F(64, variant="sink")], lambda g, i: True)
    assert len(e.deployment.coordinator.attention_groups) == 2
