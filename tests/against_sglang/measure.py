"""Keys, calls and time per storage query: SGLang 0.5.23's own lookup against mooncake_keys' (the
plugin), side by side in one run on a real ``mooncake_master``, by stored fraction.

Run it in the SGLang oracle venv (``bash scripts/dev.sh test`` builds it)::

    SG=$MOONCAKE_KEYS_CACHE/sglang-0.5.23
    PYTHONPATH=$SG/pkg:tests/against_sglang/stubs:tests/against_sglang TORCH_EXTENSIONS_DIR=$SG/torch_extensions \\
        $SG/bin/python tests/against_sglang/measure.py [--repeats 7] [--quick]

Per deployment, prompt length and stored fraction (the first pages of the span stored, every
object of every rank), per rank: the keys and ``batch_is_exist`` calls of one query through
SGLang's own ``HybridCacheController._storage_hit_query`` on SGLang's store and on ours, the keys
a re-poll of it asks within the negative TTL, and the median wall time of a query (the page
hash, the keys, the RPCs and the answer; ours and SGLang's alternated, medians of ``repeats``),
of which the time outside ``batch_is_exist`` is the client's. Every answer is checked equal to
SGLang's (reduced over the ranks where the single querier answers with a bound).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

DEPLOYMENTS = [  # name, Case fields, prompt tokens
    ("MHA TP2, page 64", dict(tp=2, page=64, model="meta-llama/Llama-3.1-8B-Instruct"), (32768, 131072)),
    ("MLA TP4, page 64", dict(mla=True, tp=4, page=64, model="deepseek-ai/DeepSeek-V3"), (131072,)),
    ("MHA + Mamba (1 conv), page 64", dict(page=64, model="Qwen/Qwen3-Next-80B-A3B",
                                          pools=[("mamba", "trailing_pages", 1)]), (32768,)),
]
FRACTIONS = (0.0, 0.1, 0.5, 1.0)


def measure(master: str, holder: Any, repeats: int, quick: bool = False, deployments: Any = DEPLOYMENTS,
            fractions: Any = FRACTIONS) -> List[Dict[str, Any]]:
    import harness
    from harness import Case, Pool
    from mooncake_keys.sglang import plugin
    from mooncake_keys.sglang.hits import reduce_ranks

    rows = []
    seed = 1000
    for name, fields, lengths in deployments:
        for tokens in lengths[:1] if quick else lengths:
            for fraction in fractions:
                seed += 1
                f = dict(fields)
                pools = [Pool(n, pol, w) for n, pol, w in f.pop("pools", [])]
                case = Case(seed=seed, pages=tokens // f["page"], pools=pools, **f)
                hashes = harness.page_hashes(case)
                ranks = case.ranks()
                theirs = {r: harness.build_store(case, r, master) for r in ranks}
                ours = {r: harness.build_store(case, r, master, {"negative_ttl": 0}) for r in ranks}
                repoll = {r: harness.build_store(case, r, master, {"negative_ttl": 60}) for r in ranks}
                stored = int(case.pages * fraction)
                put = []
                for r in ranks:
                    kv, pool_keys = harness.sglang_keys(theirs[r], case, hashes)
                    per = len(kv) // case.pages
                    put += kv[: stored * per]
                    for keys in pool_keys:
                        put += keys[: stored * (len(keys) // case.pages)]
                put = list(dict.fromkeys(put))
                for i in range(0, len(put), 8192):
                    assert holder.put_batch(put[i:i + 8192], [b"x"] * len(put[i:i + 8192])) == 0
                results = {}
                for side, stores in (("sglang", theirs), ("ours", ours), ("repoll", repoll)):
                    results[side] = {r: harness.result_of(stores[r], case, hashes) for r in ranks}
                for r in ranks:  # the re-poll: the same query again, within the TTL
                    results["repoll"][r] = harness.result_of(repoll[r], case, hashes)
                red = {side: reduce_ranks([harness.rank_result(results[side][r]) for r in ranks], case.page,
                                          case.pages, harness.trailing(case)) for side in results}
                assert red["ours"] == red["sglang"] == red["repoll"], (name, tokens, fraction, red)
                assert red["sglang"][0] == stored * case.page
                times = {r: _times(harness, theirs[r], ours[r], case, hashes, repeats) for r in ranks}
                for r in ranks:
                    lookup = plugin.lookup_of(ours[r])
                    rows.append(dict(
                        deployment=name, tokens=tokens, stored=fraction, rank=r[0], pages=case.pages,
                        sglang_keys=sum(map(len, results["sglang"][r]["calls"])),
                        sglang_calls=len(results["sglang"][r]["calls"]),
                        ours_keys=sum(map(len, results["ours"][r]["calls"])),
                        ours_calls=len(results["ours"][r]["calls"]),
                        repoll_keys=sum(map(len, results["repoll"][r]["calls"])),
                        bound=not lookup.asks(), **times[r]))
    return rows


def _times(harness: Any, theirs: Any, ours: Any, case: Any, hashes: List[str], repeats: int) -> Dict[str, float]:
    """Median wall and client (outside batch_is_exist) milliseconds per query, alternating sides."""
    spent: Dict[str, List[float]] = {"sglang": [], "ours": [], "sglang_rpc": [], "ours_rpc": []}
    for store, side in ((theirs, "sglang"), (ours, "ours")):
        inner = store._batch_exist

        def timed(keys: List[str], inner: Any = inner, side: str = side) -> List[int]:
            t = time.perf_counter()
            try:
                return inner(keys)
            finally:
                spent[side + "_rpc"][-1] += time.perf_counter() - t

        store._batch_exist = timed
    for i in range(repeats + 1):
        for store, side in ((theirs, "sglang"), (ours, "ours")) if i % 2 else ((ours, "ours"), (theirs, "sglang")):
            spent[side + "_rpc"].append(0.0)
            op = harness.operation(case, hashes)
            t = time.perf_counter()
            harness.MiniController(store, case.page)._storage_hit_query(op)
            spent[side].append(time.perf_counter() - t)
    out = {}
    for side in ("sglang", "ours"):
        wall, rpc = spent[side][1:], spent[side + "_rpc"][1:]  # the first of each: a warm-up
        out[side + "_ms"] = 1e3 * statistics.median(wall)
        out[side + "_client_ms"] = 1e3 * statistics.median(w - r for w, r in zip(wall, rpc))
    return out


def table(rows: List[Dict[str, Any]]) -> str:
    head = ("| deployment | prompt | stored | rank | SGLang keys / calls | ours keys / calls | re-poll keys "
            "| SGLang ms (client) | ours ms (client) |")
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        ours = f"{r['ours_keys']:,} / {r['ours_calls']}" + (" (bound)" if r["bound"] else "")
        lines.append(
            f"| {r['deployment']} | {r['tokens'] // 1024}k | {r['stored']:.0%} | {r['rank']} "
            f"| {r['sglang_keys']:,} / {r['sglang_calls']} | {ours} | {r['repoll_keys']:,} "
            f"| {r['sglang_ms']:.2f} ({r['sglang_client_ms']:.2f}) | {r['ours_ms']:.2f} ({r['ours_client_ms']:.2f}) |")
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed queries per side (medians)")
    parser.add_argument("--quick", action="store_true", help="the first prompt length of each deployment only")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import harness
    from mooncake_keys.store.local_master import LocalMaster
    from mooncake_keys.store.mooncake import MooncakeStore

    with LocalMaster() as master:
        holder = MooncakeStore.connect(master.master_address, global_segment_size=512 << 20)
        try:
            harness.OracleStore.client = holder.client
            start = time.perf_counter()
            rows = measure(master.master_address, holder.client, args.repeats, args.quick)
            print(table(rows))
            print(f"\n({len(rows)} rows in {time.perf_counter() - start:.0f} s; every answer equal to SGLang's)")
        finally:
            holder.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
