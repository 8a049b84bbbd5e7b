"""A plain, slow reference of vLLM 0.25's lookup (namespaces, lookup masks, the coordinator;
docs/architecture.md), written straight from the contract with (group, hash) sets and block
lists, for full attention, sliding windows, Mamba states and chunked local attention. It shares
no code with the package."""

from __future__ import annotations

from math import ceil, lcm

FULL, SWA, MAMBA, CHUNKED = "full", "swa", "mamba", "chunked"


def kind(spec):
    if hasattr(spec, "sliding_window"):
        return SWA
    if hasattr(spec, "attention_chunk_size"):
        return CHUNKED
    return MAMBA if type(spec).__name__ == "MambaSpec" else FULL


def ref_namespaces(tp, pp, pcp, dcp, heads, mla):
    if mla:
        heads = 1
    out = []
    if dcp > 1:
        for c in range(pcp):
            for t in range(tp):
                for p in range(pp):
                    out.append((t, c, t % dcp, p))
    else:
        for c in range(pcp):
            for t in range(min(tp, heads)):
                for p in range(pp):
                    out.append((t, c, 0, p))
    return out


def ref_prefix(model, t, c, d, p, g, cache_prefix=""):
    s = f"{cache_prefix}@" if cache_prefix != "" else ""
    return s + model + "@tp_rank:" + str(t) + "@pcp" + str(c) + "@dcp" + str(d) + "@pp_rank:" + str(p) + "@group:" + str(g)


class RefCoordinator:
    def __init__(self, specs, eagle_flags, lcm_bs, hash_bs, use_eagle):
        self.specs = specs
        self.lcm = lcm_bs
        self.hash_bs = hash_bs
        flagged = [i for i, f in enumerate(eagle_flags) if f]
        self.eagle_ids = set(flagged or (list(range(len(specs))) if use_eagle else []))
        attn = []
        for g, s in enumerate(specs):
            for a in attn:
                if a[0] == s:
                    a[1].append(g)
                    break
            else:
                attn.append((s, [g]))
        attn.sort(key=lambda a: kind(a[0]) != FULL)
        self.attn = attn
        self.eagle_attn = {i for i, a in enumerate(attn) if set(a[1]) & self.eagle_ids}

    def view(self, hashes, spec):
        scale = spec.block_size // self.hash_bs
        if scale == 1:
            return list(hashes)
        return [hashes[j * scale + scale - 1] for j in range(len(hashes) // scale)]

    def need(self, spec, eagle):
        return ceil((spec.sliding_window - 1) / spec.block_size) + (1 if eagle else 0)

    def lookup_mask(self, token_len):
        assert token_len % self.lcm == 0
        masks = []
        for g, s in enumerate(self.specs):
            if kind(s) != SWA:  # every chunk of the others may end a hit (or is read by one)
                masks.append(None)
                continue
            eagle = g in self.eagle_ids
            need = self.need(s, eagle)
            shift = 1 if eagle else 0
            per = self.lcm // s.block_size
            if need >= per:
                masks.append(None)
                continue
            masks.append([i >= shift and (i - shift) % per >= per - need for i in range(token_len // s.block_size)])
        return masks

    # managers: return the list of blocks (True = hit block, False = null block)
    def full_manager(self, view, max_length, gids, exists, bs, alignment, drop):
        blocks = []
        for h in view[: max_length // bs]:
            if all((g, bytes(h)) in exists for g in gids):
                blocks.append(True)
            else:
                break
        if drop and blocks:
            blocks.pop()
        while bs != alignment and len(blocks) * bs % alignment != 0:
            blocks.pop()
        return blocks

    def swa_manager(self, view, max_length, gids, exists, bs, alignment, drop, spec):
        need = self.need(spec, drop)
        n = max_length // bs
        blocks = [False] * n
        run = 0
        found = False
        for i in range(n - 1, -1, -1):
            h = view[i] if i < len(view) else None
            if h is not None and all((g, bytes(h)) in exists for g in gids):
                if run == 0 and bs != alignment:
                    post = i if drop else i + 1
                    if post * bs % alignment != 0:
                        continue
                blocks[i] = True
                run += 1
                if run >= need:
                    del blocks[i + run:]
                    found = True
                    break
            else:
                run = 0
        if not found:
            del blocks[run:]
            while bs != alignment and len(blocks) * bs % alignment != 0:
                blocks.pop()
        if drop and blocks:
            blocks.pop()
            while bs != alignment and len(blocks) * bs % alignment != 0:
                blocks.pop()
        return blocks

    def mamba_manager(self, view, max_length, gids, exists, bs, alignment, drop):
        # The last present state whose end is aligned; the EAGLE drop does not apply to a state.
        for i in range(max_length // bs - 1, -1, -1):
            h = view[i] if i < len(view) else None
            if h is not None and all((g, bytes(h)) in exists for g in gids):
                if bs != alignment and (i + 1) * bs % alignment != 0:
                    continue
                return [False] * i + [True]
        return []

    def chunked_manager(self, view, max_length, gids, exists, bs, alignment, drop, spec):
        assert not drop and bs == alignment
        n = max_length // bs
        start = (max_length // spec.attention_chunk_size * spec.attention_chunk_size) // bs if max_length > 0 else 0
        blocks = [False] * start  # before the window: not read, counted computed
        for i in range(start, n):
            h = view[i] if i < len(view) else None
            if h is None or not all((g, bytes(h)) in exists for g in gids):
                break
            blocks.append(True)
        return blocks

    def manager(self, spec, *args):
        k = kind(spec)
        if k == FULL:
            return self.full_manager(*args)
        if k == MAMBA:
            return self.mamba_manager(*args)
        if k == CHUNKED:
            return self.chunked_manager(*args, spec)
        return self.swa_manager(*args, spec)

    def find_longest_cache_hit(self, hashes, max_length, exists):
        if len(self.attn) == 1:
            spec, gids = self.attn[0]
            v = self.view(hashes, spec)
            blocks = self.manager(spec, v, max_length, gids, exists, spec.block_size, spec.block_size,
                                  0 in self.eagle_attn)
            return len(blocks) * spec.block_size
        hit = max_length
        simple = len(self.attn) == 2 and kind(self.attn[0][0]) == FULL
        done_full = set()
        verified = set()
        while True:
            cur = hit
            for idx, (spec, gids) in enumerate(self.attn):
                bs = spec.block_size
                if kind(spec) == FULL and idx in done_full:
                    cur = cur // bs * bs
                    continue
                drop = idx in self.eagle_attn and idx not in verified
                maxlen = min(cur + bs, max_length) if drop else cur
                blocks = self.manager(spec, self.view(hashes, spec), maxlen, gids, exists, bs, self.lcm, drop)
                new = len(blocks) * bs
                if kind(spec) == FULL:
                    done_full.add(idx)
                if drop:
                    verified.add(idx)
                elif new < cur:
                    verified.clear()
                cur = new
            if cur >= hit:
                break
            hit = cur
            if simple:
                break
        return hit


class RefEngine:
    """vLLM state B/C lookup. specs: list of spec objects; eagle_flags: list of bools."""

    def __init__(self, model, specs, eagle_flags, tp=1, pp=1, pcp=1, dcp=1, heads=1, mla=False,
                 hash_bs=16, sched_bs=None, use_eagle=False, cache_prefix=""):
        self.specs = specs
        self.sched = sched_bs or lcm(*(s.block_size for s in specs))
        self.coord = RefCoordinator(specs, eagle_flags, self.sched, hash_bs, use_eagle)
        ns = ref_namespaces(tp, pp, pcp, dcp, heads, mla)
        self.prefixes = [[ref_prefix(model, t, c, d, p, g, cache_prefix) for (t, c, d, p) in ns]
                         for g in range(len(specs))]

    def candidates(self, token_len, hashes):
        keys, meta = [], []
        masks = self.coord.lookup_mask(token_len)
        for g, s in enumerate(self.specs):
            gh = self.coord.view(hashes, s)
            bs = s.block_size
            j = 0
            while j * bs < token_len and j < len(gh):
                m = masks[g]
                if m is None or (j < len(m) and m[j]):
                    hx = bytes(gh[j]).hex()
                    for pre in self.prefixes[g]:
                        keys.append(pre + "@" + hx)
                    meta.append((g, bytes(gh[j])))
                j += 1
        return keys, meta

    def lookup(self, token_len, hashes, store):
        if not hashes or token_len <= 0:
            return 0
        keys, meta = self.candidates(token_len, hashes)
        if not keys:
            return 0
        res = store.batch_is_exist(keys)
        r = len(self.prefixes[0])
        exists = set()
        for i, m in enumerate(meta):
            if all(x == 1 for x in res[i * r:(i + 1) * r]):
                exists.add(m)
        return self.coord.find_longest_cache_hit(list(hashes), token_len, exists)
