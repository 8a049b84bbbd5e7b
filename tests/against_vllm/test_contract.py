"""mooncake_keys against the installed vLLM release's own ``MooncakeStoreWorker.lookup``.

Thousands of random deployments of the installed release (hybrids, merged and unmerged groups,
Mamba-align and chunked-local hybrids, EAGLE, TP/PP/PCP/DCP, and where the release has them
hybrid + DCP, MLA/GQA mixes, dropped groups, cache prefixes, store layouts, partial hash hits),
each built by vLLM's own constructor with only the GPU, rank and store parts replaced, then
several requests (unaligned, fully stored, stores with holes, odd codes and faults). Both sides
ask the same store function; for every request the one-shot engine must send the same keys in
one call and answer the same hit length and (0.29+) tail boundaries, and the engine asking
in rounds the same answer from no more keys. The engine uses the default core:
the suite runs once compiled and once with ``MOONCAKE_KEYS_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import logging
import os
import random
from collections import Counter

import pytest

import mooncake_keys as mk
from support import vllm_workers
from support.vllm_cases import (
    Release,
    deployment_kind,
    engine_for,
    partial_hash_hits,
    random_cfg,
    random_request,
    random_store,
    same_answers,
    sizes,
)

vllm_workers.quiet(logging.CRITICAL)  # vLLM logs every store fault it answers 0 for
RELEASE = Release.installed()
CASES = int(os.environ.get("MK_VLLM_CASES", "3000"))
SEED0 = int(os.environ.get("MK_VLLM_SEED0", "0"))  # a held-out run: another range of seeds
BATCHES = max(1, min(30, CASES))
REQUESTS = 4
#: Over every batch: deployments compared, by kind ("mamba", "chunked", "attention"; "+partial").
TOTAL: Counter = Counter()


def vllm_answer(worker, num_tokens, hashes):
    """(hit, boundaries) or the exception vLLM raised."""
    try:
        res = worker.lookup(num_tokens, hashes)
    except Exception as exc:  # noqa: BLE001 - vLLM's own failure is an outcome to compare
        return ("raised", type(exc).__name__)
    if RELEASE.contract.tail_key_boundaries:
        return (res.hit_length, tuple((b.group_id, b.num_tokens) for b in res.tail_key_boundaries))
    return (int(res), ())


def ours(engine, num_tokens, hashes):
    r = engine.lookup_result(num_tokens, hashes)
    return (r.hit_length, tuple((b.group_id, b.num_tokens) for b in r.tail_key_boundaries))


def compare_one(seed: int, tally: Counter) -> None:
    rng = random.Random(f"contract:{seed}")
    cfg = random_cfg(rng, RELEASE)
    probe = mk.RecordingStore()
    try:
        worker = vllm_workers.build_worker(cfg, probe)
    except vllm_workers.ConfigRejected:
        tally["rejected by vLLM"] += 1
        return
    try:
        described = vllm_workers.describe(worker)
        if "coord" in described:  # our size resolution and partial hash hits are vLLM's
            assert (described["coord"]["lcm_block_size"], described["coord"]["hash_block_size"]) == sizes(cfg, RELEASE), cfg
            assert described["coord"]["enable_partial_hash_hits"] == partial_hash_hits(cfg, RELEASE), cfg
        compared = tally["compared"]
        for _ in range(REQUESTS):
            num_tokens, hashes = random_request(rng, cfg, RELEASE)
            store = random_store(rng, hashes, cfg)
            mine = same_answers(store)
            engine = engine_for(cfg, RELEASE, mine, described, strategy="oneshot")
            worker.store = store
            want = vllm_answer(worker, num_tokens, hashes)
            got = ours(engine, num_tokens, hashes)
            if store.fault == "short":
                # An answer one short: vLLM raises IndexError or reads the part that is there,
                # depending on where its all() stops; ours is the store-fault answer, 0.
                assert mine.calls == store.calls and got == (0, ())
                tally["short answer: 0"] += 1
                continue
            if want[0] == "raised":
                tally[f"vLLM raised {want[1]}"] += 1  # and we answer
                assert got[0] >= 0
                continue
            context = dict(cfg=cfg, num_tokens=num_tokens, n_hashes=len(hashes), fault=store.fault)
            assert mine.calls == store.calls, ("keys sent differ", context, described.get("lookup_key_prefixes"))
            assert got == want, ("answers differ", context, got, want)
            # Asked in rounds (at any size): the same answer from no more keys.
            asked = same_answers(store)
            in_rounds = engine_for(cfg, RELEASE, asked, described, rounds_min_keys=0)
            assert ours(in_rounds, num_tokens, hashes) == want, ("rounds differ", context)
            assert sum(map(len, asked.calls)) <= sum(map(len, store.calls))
            tally["rounds"] += in_rounds.strategy == "rounds"
            tally["compared"] += 1
            tally["hit"] += bool(got[0])
            tally["store calls"] += len(store.calls)
        if tally["compared"] > compared:
            kind = deployment_kind(cfg, RELEASE)
            tally[f"deployments {kind}"] += 1
            TOTAL[kind] += 1
    finally:
        vllm_workers.release(worker)


@pytest.mark.parametrize("batch", range(BATCHES))
def test_lookup_agrees_with_vllm(batch):
    tally: Counter = Counter()
    seeds = range(SEED0 + batch * CASES // BATCHES, SEED0 + (batch + 1) * CASES // BATCHES)
    for seed in seeds:
        compare_one(seed, tally)
    print(dict(tally))
    assert tally["compared"] >= len(seeds)  # most deployments build, and each asks several times
    assert tally["hit"] > 0 and tally["rounds"] > 0


def test_every_group_kind_was_compared():
    """Mamba-align and chunked-local hybrids, and partial hash hits where the release has them,
    are among the deployments compared (not all refused by vLLM); the counts go to
    ``MK_VLLM_REPORT`` (a JSON-lines file) when it is set."""
    print(dict(TOTAL))
    assert TOTAL["attention"] > 0 and TOTAL["mamba"] + TOTAL["mamba+partial"] > 0 and TOTAL["chunked"] > 0, TOTAL
    if RELEASE.contract.partial_hash_hits:
        assert TOTAL["mamba+partial"] + TOTAL["attention+partial"] > 0, TOTAL
    report = os.environ.get("MK_VLLM_REPORT")
    if report:
        import json
        from mooncake_keys.lookup import _core

        with open(report, "a", encoding="utf-8") as f:
            f.write(json.dumps({"release": vllm_workers.VLLM_VERSION, "core": "c" if _core.ACCELERATED else "py",
                                "test": "contract", "deployments": dict(TOTAL)}) + "\n")


def test_the_engine_runs_the_expected_core():
    from mooncake_keys.lookup import _core

    assert _core.ACCELERATED == (not os.environ.get("MOONCAKE_KEYS_NO_EXTENSIONS") and _core._core_c is not None)
