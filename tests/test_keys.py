"""The key grammar (lookup/keys.py) and the core's key building."""

import dataclasses
from array import array

import pytest

import mooncake_keys as mk
from mooncake_keys.lookup.keys import key_head


def test_pool_key_to_string_without_prefix_is_unchanged():
    key = mk.PoolKey(mk.KeyMetadata("test-model", 0, 0, 0, 0), "deadbeef")
    assert key.to_string() == "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef"


def test_pool_key_cache_prefix_namespaces_and_disambiguates():
    a = mk.PoolKey(mk.KeyMetadata("test-model", 0, 0, 0, 0, cache_prefix="depA"), "deadbeef")
    b = mk.PoolKey(mk.KeyMetadata("test-model", 0, 0, 0, 0, cache_prefix="depB"), "deadbeef")
    assert a.to_string() == "depA@test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef"
    assert a.to_string() != b.to_string()
    assert hash(a) != hash(b)


def test_build_prefix_overrides_and_fallbacks():
    md = mk.KeyMetadata("m", 3, 1, 2, 1, group_id=5, cache_prefix="x")
    assert mk.PoolKey.build_prefix(md) == "x@m@tp_rank:3@pcp1@dcp2@pp_rank:1@group:5"
    assert mk.PoolKey.build_prefix(md, tp_rank=0, pp_rank=0) == "x@m@tp_rank:0@pcp1@dcp2@pp_rank:0@group:5"
    assert mk.PoolKey.build_prefix(md, pcp_rank=0, dcp_rank=3) == "x@m@tp_rank:3@pcp0@dcp3@pp_rank:1@group:5"
    assert mk.PoolKey.build_key_string("p", "ab") == "p@ab"


def test_cache_prefix_from_vllm_config_none_is_the_string_none():
    # vLLM does str(extra_config.get("cache_prefix", "")): a JSON null becomes "None".
    md = mk.KeyMetadata("m", 0, 0, 0, 0, cache_prefix=str(None))
    assert mk.PoolKey(md, "00").to_string().startswith("None@m@")


def test_model_name_from_path():
    assert mk.model_name_from_path("deepseek-ai/DeepSeek-V4") == "DeepSeek-V4"
    assert mk.model_name_from_path("/models/llama/") == "llama"


@pytest.mark.parametrize("bad", [None, 1.5, "0"])
def test_key_metadata_rejects_bad_ranks(bad):
    with pytest.raises(TypeError, match="tp_rank"):
        mk.KeyMetadata("m", bad, 0, 0, 0)


def test_key_metadata_rejects_negative_and_non_str():
    with pytest.raises(ValueError, match="pp_rank"):
        mk.KeyMetadata("m", 0, 0, 0, -1)
    with pytest.raises(TypeError, match="model_name"):
        mk.KeyMetadata(b"m", 0, 0, 0, 0)
    with pytest.raises(TypeError, match="cache_prefix"):
        mk.KeyMetadata("m", 0, 0, 0, 0, cache_prefix=None)


def test_key_metadata_is_a_dataclass_with_vllm_field_order():
    assert [f.name for f in dataclasses.fields(mk.KeyMetadata)] == [
        "model_name", "tp_rank", "pcp_rank", "dcp_rank", "pp_rank", "group_id", "cache_prefix", "store_namespace"]


@pytest.mark.parametrize("model", ["m", "модель/日本語-🚀", "caf\u00e9", "x\udcff"])
@pytest.mark.parametrize("hash_len", [1, 8, 16, 32])
def test_fill_keys_matches_grammar(impl, model, hash_len):
    if model.isascii() or "\udcff" not in model:
        md = mk.KeyMetadata(model, 0, 0, 0, 0, cache_prefix="ñ" if "m" == model else "")
        prefixes = [mk.PoolKey.build_prefix(md, tp_rank=t) for t in range(3)]
    else:  # KeyMetadata refuses it; the cores take any str head, and must agree on it
        prefixes = [f"{model}@tp_rank:{t}@pcp0@dcp0@pp_rank:0@group:0" for t in range(3)]
    heads = tuple(key_head(p) for p in prefixes)
    hashes = [bytes((i * 37 + k) % 256 for k in range(hash_len)) for i in range(5)]
    blob = b"".join(hashes)
    index = array("q", [4, 0, 2])
    out = ["x"] * 11
    assert impl.fill_keys(out, 1, heads, memoryview(blob), hash_len, index) == 10
    expected = [mk.PoolKey.build_key_string(p, hashes[i].hex()) for i in (4, 0, 2) for p in prefixes]
    assert out[1:10] == expected
    assert out[0] == "x" and out[10] == "x"


def test_fill_keys_rejects_out_of_range(impl):
    out = [None] * 4
    with pytest.raises((IndexError, ValueError)):
        impl.fill_keys(out, 0, ("a@",), b"\x00" * 4, 2, array("q", [2]))


@pytest.mark.parametrize("r", [1, 2, 3, 8])
def test_reduce_presence(impl, r):
    import random

    rnd = random.Random(r)
    n = 50
    res = [rnd.choice([1, 1, 1, 0, -1, -900, 2]) for _ in range(n * r)]
    flags, present = impl.reduce_presence(res, r)
    assert list(flags) == [int(all(x == 1 for x in res[i * r:(i + 1) * r])) for i in range(n)]
    assert present == res.count(1)
    # The core takes lists only (the engine hands it a list of whatever the store answered).
    with pytest.raises(TypeError, match="results must be a list"):
        impl.reduce_presence(tuple(res), r)


def test_reduce_presence_only_exact_one_counts(impl):
    flags, present = impl.reduce_presence([1, True, 2, 1 << 70, -1, 0], 1)
    assert list(flags) == [1, 1, 0, 0, 0, 0] and present == 2


# --------------------------------------------------------------------- the key types' checks
def test_pool_key_names_its_bad_fields():
    md = mk.KeyMetadata("m", 0, 0, 0, 0)
    for bad in (None, "x"):
        with pytest.raises(TypeError, match="key_metadata must be a KeyMetadata"):
            mk.PoolKey(bad, "ab")
    with pytest.raises(TypeError, match="key_metadata must be a KeyMetadata"):
        mk.PoolKey.build_prefix(None)
    with pytest.raises(TypeError, match="chunk_hash must be a str"):
        mk.PoolKey(md, None)
    assert mk.PoolKey(md, "ab").to_string() == "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab"


def test_key_metadata_refuses_text_utf8_cannot_encode():
    for kw in (dict(model_name="\ud800"), dict(model_name="m", cache_prefix="\udcff"),
               dict(model_name="m", store_namespace="@store_tp:\ud800")):
        name = next(k for k, v in kw.items() if not v.isascii() or "\ud800" in v or "\udcff" in v)
        with pytest.raises(ValueError, match=f"{name} must be valid text"):
            mk.KeyMetadata(kw.pop("model_name"), 0, 0, 0, 0, **kw)
