"""Leases and key events on a real Mooncake 0.3.14 master (``mooncake_keys bench --leases``).

One deployment (TP 4: four namespaces; full attention, 16-token chunks), prompts of
:data:`PROMPT_TOKENS` tokens (2,048 keys), stored at 0, 10, 50 and 100 % of their chunks in every
namespace, and past that :data:`LAGGING` of the chunks in three namespaces of four (a rank whose
saves lag, or whose keys were evicted). Side by side in one run, per lookup: master calls, keys
asked, read leases the master granted, and the keys the hit loads (its chunks in every
namespace), for

* ``one-shot (vLLM)``: every key in one ``batch_is_exist`` (each present key leased);
* ``rounds, batch_is_exist``: the rounds as with a 0.3.13 client (each present key asked leased);
* ``rounds, batch_probe_key``: lease-free probes, then one lease call of the hit's keys (needs the
  0.3.14 client: absent from the table with another);
* ``rounds + key events``: the mirror answers the rounds; a hit is verified and leased in one
  call of its keys (with the 0.3.14 client its ``LastHitOnly`` call, else ``batch_is_exist``).

Then a burst of :data:`BURST` requests sharing a system prompt (stored) with a part of their own
(not stored), through a :class:`LookupBatcher`; then **churn**: a thread saving prompts into a
small segment (the master evicts) while lookups with key events run, and a master restart in
the middle; every hit is checked against a one-shot lookup made right after it (its keys were
leased by its verify call, so that one-shot must see them: the answer is at most the one-shot
answer at its verify call; checks that a restart came between are counted apart). Last, the
mirror's memory per million keys (its fingerprint set, measured with ``tracemalloc``).

Which client runs is the installed ``mooncake`` package's; ``master_executable`` is the 0.3.14
``mooncake_master`` (on a CPU machine the tests unpack it: docs/benchmarks.md says how this was
run with the 0.3.14 client).
"""

from __future__ import annotations

import random
import threading
import time
import tracemalloc
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .table import text_table

__all__ = ["run_leases", "format_leases", "mirror_bytes_per_key", "FRACTIONS", "PROMPT_TOKENS", "BURST"]

FRACTIONS = (0.0, 0.1, 0.5, 1.0)
PROMPT_TOKENS = 8192
BLOCK = 16
TP = 4
LOOKUPS = 20
BURST = 32
#: The share of a prompt's chunks past its stored prefix present in 3 namespaces of 4.
LAGGING = 0.1
SYSTEM_TOKENS, OWN_TOKENS = 4096, 1024
#: The bench master's lease (ms): long enough that a hit's keys are still leased when the
#: churn check's one-shot lookup asks right after it.
LEASE_MS = 5000


class _ExistOnly:
    """The store as a 0.3.13 client is: ``batch_is_exist`` alone (no lease-free probe)."""

    mutates_keys = False

    def __init__(self, store: Any) -> None:
        self.store = store

    def batch_is_exist(self, keys: Any) -> Any:
        return self.store.batch_is_exist(keys)


def _hashes(tag: str, n: int) -> List[bytes]:
    return [f"{tag}:{i}".encode().ljust(32, b".")[:32] for i in range(n)]


def _wait(cond: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def mirror_bytes_per_key(n: int = 1_000_000) -> float:
    """Bytes per key of the mirror's fingerprint set, ``n`` keys of 128 characters."""
    head = "cacheprefix@Qwen3-8B@tp_rank:3@pcp0@dcp0@pp_rank:0@group:1@"
    keys = [head + f"{i:064x}" for i in range(n)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        present = {hash(k) for k in keys}
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(present) == n
    return (after - before) / n


def run_leases(master_executable: Optional[str] = None, *, quick: bool = False,
               progress: Any = None) -> Dict[str, Any]:
    """The measurements of the module docstring: ``{"rows", "burst", "churn", "mirror_bytes_per_key", ...}``."""
    import mooncake_keys as mk
    from ..store.local_master import LocalMaster
    from ..store.mooncake import MooncakeStore

    say = progress or (lambda *_: None)
    lookups = 4 if quick else LOOKUPS
    layout = mk.ParallelLayout(tp_size=TP, num_kv_heads=TP)
    groups = [mk.FullAttentionSpec(BLOCK)]
    out: Dict[str, Any] = {}
    with LocalMaster(executable=master_executable, kv_events=True, default_kv_lease_ttl=LEASE_MS) as master:
        out["master"] = master.version
        events = {"endpoint": master.events_endpoint, "http": master.http_address}
        holder = MooncakeStore.connect(master.master_address, global_segment_size=512 << 20)
        client = MooncakeStore.connect(master.master_address, lookup_only=True)
        probes = client.lease_probes()
        out["client_probes"] = probes
        variants: List[Tuple[str, Any, Dict[str, Any]]] = [
            ("one-shot (vLLM)", _ExistOnly(client), {"strategy": "oneshot"}),
            ("rounds, batch_is_exist", _ExistOnly(client), {}),
        ]
        if probes:
            variants.append(("rounds, batch_probe_key", client, {}))
        variants.append(("rounds + key events", client, {"key_events": events}))
        engines = {name: mk.LookupEngine("bench", groups, layout, hash_block_size=BLOCK, store=mk.RecordingStore(store),
                                         key_cache_bytes=0, **kw) for name, store, kw in variants}
        try:
            mirrored = engines["rounds + key events"]
            _wait(lambda: mirrored.mirror.ready, 10)
            out["rows"] = _fractions(mk, engines, holder, lookups, say)
            say("burst")
            out["burst"] = _burst(mk, engines, holder)
        finally:
            for e in engines.values():
                e.close()
            client.close()
            holder.close()
    say("churn")
    out["churn"] = _churn(mk, master_executable, groups, layout, quick)
    out["mirror_bytes_per_key"] = round(mirror_bytes_per_key(200_000 if quick else 1_000_000), 1)
    return out


def _store_prefix(holder: Any, engine: Any, hashes: Sequence[bytes], chunks: int, lagging: int = 0) -> int:
    """Store ``chunks`` chunks in every namespace, then ``lagging`` more in all but the last."""
    keys = engine.candidate_keys((chunks + lagging) * BLOCK, hashes) if chunks + lagging else []
    keys = keys[:chunks * TP] + [k for i, k in enumerate(keys[chunks * TP:]) if i % TP != TP - 1]
    for k in keys:
        holder.put(k, b"kv")
    return len(keys)


def _leases(store: Any) -> int:
    """The read leases the master granted ``store``'s calls (see ``RecordingStore.leased``)."""
    return sum(map(len, store.leased))


def _fractions(mk: Any, engines: Dict[str, Any], holder: Any, lookups: int, say: Any) -> List[Dict[str, Any]]:
    rows = []
    any_engine = next(iter(engines.values()))
    mirror = engines["rounds + key events"].mirror
    chunks = PROMPT_TOKENS // BLOCK
    for f in FRACTIONS:
        say(f"{int(f * 100)} % stored")
        prompts = [_hashes(f"p{f}-{i}", chunks) for i in range(lookups)]
        stored = 0
        for hashes in prompts:
            prefix = int(chunks * f)
            stored += _store_prefix(holder, any_engine, hashes, prefix, min(chunks - prefix, int(chunks * LAGGING)))
        _wait(lambda: mirror.stats().keys >= stored, 20)  # every save's event has arrived
        for name, engine in engines.items():
            store = engine.store
            before = engine.stats()
            calls0, keys0, leases0 = store.num_calls, store.keys_asked, _leases(store)
            hits, t0 = [], time.perf_counter()
            for hashes in prompts:
                hits.append(engine.lookup(PROMPT_TOKENS + 1, hashes))
            seconds = time.perf_counter() - t0
            after = engine.stats()
            loaded = sum(h // BLOCK * TP for h in hits)
            rows.append({
                "stored": f"{int(f * 100)} %", "path": name,
                "hit": sum(hits) // len(hits),
                "calls": round((store.num_calls - calls0) / lookups, 2),
                "keys": round((store.keys_asked - keys0) / lookups, 1),
                "leases": round((_leases(store) - leases0) / lookups, 1),
                "loaded": round(loaded / lookups, 1),
                "without_call": after.answered_without_call - before.answered_without_call,
                "ms": round(seconds * 1e3 / lookups, 3),
            })
        holder.remove_all(force=True)
        _wait(lambda: mirror.stats().keys == 0 or not mirror.ready, 20)
    return rows


def _burst(mk: Any, engines: Dict[str, Any], holder: Any) -> List[Dict[str, Any]]:
    from ..lookup.batch import LookupBatcher

    any_engine = next(iter(engines.values()))
    mirror = engines["rounds + key events"].mirror
    system = _hashes("system", SYSTEM_TOKENS // BLOCK)
    stored = _store_prefix(holder, any_engine, system, SYSTEM_TOKENS // BLOCK)
    _wait(lambda: mirror.stats().keys >= stored, 20)
    rows = []
    for name, engine in engines.items():
        if name.startswith("one-shot"):
            continue
        requests = {i: system + _hashes(f"own-{name}-{i}", OWN_TOKENS // BLOCK) for i in range(BURST)}
        store = engine.store
        calls0, keys0, leases0 = store.num_calls, store.keys_asked, _leases(store)
        batcher = LookupBatcher(engine)
        try:
            for rid, hashes in requests.items():
                batcher.submit(rid, len(hashes) * BLOCK, hashes)
            answers: Dict[int, int] = {}
            deadline = time.monotonic() + 30
            while len(answers) < BURST and time.monotonic() < deadline:
                for rid in requests:
                    if rid not in answers:
                        got = batcher.poll(rid)
                        if got is not None:
                            answers[rid] = got.hit_length
                time.sleep(0.001)
        finally:
            batcher.close()
        rows.append({"path": name, "requests": BURST, "answered": len(answers),
                     "hit": min(answers.values()) if answers else 0,
                     "calls": store.num_calls - calls0, "keys": store.keys_asked - keys0,
                     "leases": _leases(store) - leases0,
                     "loaded": sum(answers.values()) // BLOCK * TP,
                     "distinct": max(answers.values(), default=0) // BLOCK * TP})  # the shared prompt's keys
    holder.remove_all(force=True)
    return rows


def _churn(mk: Any, master_executable: Optional[str], groups: Any, layout: Any, quick: bool) -> Dict[str, Any]:
    """Saves (into the one 32 MiB segment of a master of its own: it evicts) while lookups with
    key events run; a master restart half way. Each hit is checked against a one-shot lookup
    right after it."""
    from ..store.local_master import LocalMaster
    from ..store.mooncake import MooncakeStore, MooncakeStoreError

    with LocalMaster(executable=master_executable, kv_events=True, default_kv_lease_ttl=LEASE_MS) as master:
        client = MooncakeStore.connect(master.master_address, lookup_only=True)
        engine = mk.LookupEngine("bench", groups, layout, hash_block_size=BLOCK, store=client, key_cache_bytes=0,
                                 key_events={"endpoint": master.events_endpoint, "http": master.http_address})
        try:
            return _churn_on(mk, master, client, engine, groups, layout, quick)
        finally:
            engine.close()
            client.close()


def _churn_on(mk: Any, master: Any, client: Any, engine: Any, groups: Any, layout: Any, quick: bool) -> Dict[str, Any]:
    from ..store.mooncake import MooncakeStore, MooncakeStoreError

    seconds = 4.0 if quick else 12.0
    _wait(lambda: engine.mirror.ready, 10)
    writer = MooncakeStore.connect(master.master_address, global_segment_size=32 << 20)
    reference = mk.LookupEngine("bench", groups, layout, hash_block_size=BLOCK, store=_ExistOnly(client),
                                strategy="oneshot", key_cache_bytes=0)
    prompts = [_hashes(f"churn-{i}", 64) for i in range(40)]
    value = b"v" * (256 << 10)  # 32 MiB hold ~128 keys: saves evict
    stop = threading.Event()
    saved = [0]
    restarts = [0]

    def saver() -> None:
        rng = random.Random(3)
        while not stop.is_set():
            hashes = prompts[rng.randrange(len(prompts))]
            for k in reference.candidate_keys(rng.randint(1, 64) * BLOCK, hashes):
                try:
                    if writer.put(k, value) == 0:
                        saved[0] += 1
                except MooncakeStoreError:
                    time.sleep(0.05)  # the master restarts
                if stop.is_set():
                    return

    thread = threading.Thread(target=saver, daemon=True)
    thread.start()
    checked = violations = spanning = lookups = hits = 0
    rng = random.Random(5)
    t0 = time.monotonic()
    restarted = False
    try:
        while time.monotonic() - t0 < seconds:
            if not restarted and time.monotonic() - t0 > seconds / 2:
                master.restart()
                restarts[0] += 1
                restarted = True
            hashes = prompts[rng.randrange(len(prompts))]
            generation = restarts[0]
            hit = engine.lookup(64 * BLOCK + 1, hashes)
            lookups += 1
            if hit == 0:
                continue
            hits += 1
            after = reference.lookup(64 * BLOCK + 1, hashes)
            if restarts[0] != generation:
                spanning += 1
                continue
            checked += 1
            violations += hit > after
    finally:
        stop.set()
        thread.join(5)
        writer.close()
    stats = engine.stats()
    return {"seconds": seconds, "lookups": lookups, "hits": hits, "checked": checked, "violations": violations,
            "spanning_a_restart": spanning, "keys_saved": saved[0], "lease_misses": stats.lease_misses,
            "mirror": engine.mirror.stats().__dict__}


def format_leases(out: Dict[str, Any]) -> str:
    """The run as text tables."""
    lines = [f"Mooncake master {out['master']}, client with batch_probe_key: {out['client_probes']}; "
             f"TP {TP}, {PROMPT_TOKENS}-token prompts ({PROMPT_TOKENS // BLOCK * TP} keys); per lookup:"]
    cols = [("stored", "6"), ("path", "24"), ("hit", "6d"), ("calls", "6.2f"), ("keys", "8.1f"), ("leases", "8.1f"),
            ("loaded", "8.1f"), ("no call", "7d"), ("ms", "7.3f")]
    fields = ["stored", "path", "hit", "calls", "keys", "leases", "loaded", "without_call", "ms"]
    lines.append(text_table(cols, [[r[f] for f in fields] for r in out["rows"]]))
    lines.append(f"\nA burst of {BURST} requests ({SYSTEM_TOKENS} shared tokens stored + {OWN_TOKENS} of their own), "
                 "through a LookupBatcher:")
    cols = [("path", "24"), ("requests", "8d"), ("answered", "8d"), ("hit", "6d"), ("calls", "6d"), ("keys", "7d"),
            ("leases", "7d"), ("loaded", "7d"), ("distinct", "8d")]
    fields = ["path", "requests", "answered", "hit", "calls", "keys", "leases", "loaded", "distinct"]
    lines.append(text_table(cols, [[r[f] for f in fields] for r in out["burst"]]))
    c = out["churn"]
    lines.append(f"\nChurn ({c['seconds']} s, saves evicting, a master restart): {c['lookups']} lookups, "
                 f"{c['hits']} hits, "
                 f"{c['checked']} checked against a one-shot right after, {c['violations']} above it; "
                 f"{c['spanning_a_restart']} spanned the restart (not checked); lease misses {c['lease_misses']}; "
                 f"mirror gaps {c['mirror']['gaps']}, rebuilds {c['mirror']['rebuilds']}, "
                 f"forgotten {c['mirror']['forgotten']}")
    lines.append(f"Mirror memory: {out['mirror_bytes_per_key']} bytes per key "
                 f"({out['mirror_bytes_per_key'] * 1e6 / 2**20:.0f} MiB per million keys)")
    return "\n".join(lines)
