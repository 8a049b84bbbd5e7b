"""Names that would let two deployments' keys coincide are refused unless the caller opts in
(``allow_ambiguous_names``): an ``@`` in a model name or cache prefix, a store namespace that is
not vLLM's ``@store_<name>:<value>`` tags, a model name that reads as such a tag."""

from __future__ import annotations

import pytest

import mooncake_keys as mk

F = mk.FullAttentionSpec
HS = [bytes([i]) * 16 for i in range(8)]


def test_an_at_sign_in_a_name_is_refused_unless_allowed():
    store = mk.MemoryStore()
    for kw in (dict(model_name="tenantA@llama"), dict(model_name="llama", cache_prefix="ten@antA")):
        args = dict(model_name="llama", cache_prefix="")
        args.update(kw)
        with pytest.raises(ValueError, match="contains '@'.*cache_prefix would not isolate"):
            mk.LookupEngine(args["model_name"], [F(16)], mk.ParallelLayout(), hash_block_size=16,
                            cache_prefix=args["cache_prefix"], store=store)
    pytest.importorskip("torch")
    import torch

    with pytest.raises(ValueError, match="model_name 'tenantA@llama' contains '@'"):
        mk.KVPool("tenantA@llama", [F(16)], mk.ParallelLayout(), rank=(0, 0, 0, 0), kv_caches=torch.zeros(2, 8),
                  hash_block_size=16, store=store)
    # The collision itself, for an existing deployment that opts in: the very same keys.
    a = mk.LookupEngine("tenantA@llama", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store,
                        allow_ambiguous_names=True)
    b = mk.LookupEngine("llama", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store,
                        cache_prefix="tenantA")
    assert a.candidate_keys(32, HS) == b.candidate_keys(32, HS)


def test_a_free_form_store_namespace_cannot_reach_another_deployments_keys():
    store = mk.MemoryStore()
    tenant = mk.LookupEngine("x", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store, cache_prefix="c")
    with pytest.raises(ValueError, match="store_namespace '@x' is not vLLM's store namespace"):
        mk.LookupEngine("c", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store, store_namespace="@x")
    # opted in, the collision is real: the very keys of the other tenant
    other = mk.LookupEngine("c", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store,
                            store_namespace="@x", allow_ambiguous_names=True)
    assert tenant.candidate_keys(64, HS) == other.candidate_keys(64, HS)


def test_a_model_name_that_reads_as_a_namespace_tag_is_refused():
    store = mk.MemoryStore()
    tagged = mk.LookupEngine("c", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store,
                             store_namespace="@store_tp:4")
    with pytest.raises(ValueError, match="model_name 'store_tp:4' reads as a store namespace tag"):
        mk.LookupEngine("store_tp:4", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store,
                        cache_prefix="c")
    other = mk.LookupEngine("store_tp:4", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store,
                            cache_prefix="c", allow_ambiguous_names=True)
    assert tagged.candidate_keys(64, HS) == other.candidate_keys(64, HS)


def test_vllms_own_store_namespaces_are_accepted():
    for ns in ("@store_tp:4@store_pp:1@store_format:tp_shared_lbhnc", "@store_pp:2@store_format:tp_shared_mqa",
               "@store_pp:1@store_format:rank_local_tp4_layout_HND"):
        e = mk.LookupEngine("m", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=mk.MemoryStore(),
                            store_namespace=ns)
        assert e.candidate_keys(16, HS)[0].startswith(f"m{ns}@tp_rank:0@")
