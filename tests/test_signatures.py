"""The public constructors show every parameter with its type and default, and the arguments of a
:class:`Deployment` are the same on the engine's and the pool's keyword constructors: the
signatures are compared, so they cannot drift apart, and each argument reaches the deployment."""

from __future__ import annotations

import inspect

import pytest

import mooncake_keys as mk
from mooncake_keys import kvpool
from mooncake_keys.lookup import engine as engine_module
from mooncake_keys.vllm.contracts import get_contract


def _params(func, *drop):
    return [p for p in inspect.signature(func).parameters.values() if p.name not in ("self", *drop)]


DEPLOYMENT = _params(mk.Deployment.__init__)
POSITIONAL = [p for p in DEPLOYMENT if p.kind is p.POSITIONAL_OR_KEYWORD]
KEYWORDS = [p for p in DEPLOYMENT if p.kind is p.KEYWORD_ONLY]

#: A valid value, not the default, for every keyword of Deployment (a new keyword must be added).
NON_DEFAULT = dict(hash_block_size=16, scheduler_block_size=32, use_eagle=True, cache_prefix="p",
                   store_namespace="@store_tp:1", partial_hash_hits=True, vllm_compat="0.32",
                   allow_ambiguous_names=True, core="py")
#: ``contract`` is the other way to name the rules (with vllm_compat left None).
CONTRACT = dict(NON_DEFAULT, vllm_compat=None, contract=get_contract("0.32"))


def test_no_constructor_takes_arbitrary_keywords():
    for func in (mk.Deployment.__init__, mk.LookupEngine.__init__, mk.LookupEngine.for_deployment,
                 mk.KVPool.__init__, mk.KVPool.for_deployment):
        kinds = {p.kind for p in inspect.signature(func).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds, func
        for p in _params(func):
            assert p.annotation is not inspect.Parameter.empty, (func, p.name)


def test_the_engine_signature_is_the_deployments_and_its_own():
    own = _params(mk.LookupEngine.for_deployment, "deployment")  # store, then the engine's own
    assert [p.name for p in own] == ["store", "strategy", "rounds_min_keys", "key_cache_bytes", "spare_key_bytes",
                                    "key_events"]
    assert _params(mk.LookupEngine.__init__) == POSITIONAL + own[:1] + KEYWORDS + own[1:]
    shown = inspect.signature(mk.LookupEngine)  # what help() and an IDE show
    assert str(shown.parameters["vllm_compat"]) == "vllm_compat: 'Optional[str]' = None"  # None: vLLM 0.33
    assert shown.parameters["hash_block_size"].default is inspect.Parameter.empty  # required


def test_the_pool_signature_is_the_deployments_and_its_own():
    own = _params(mk.KVPool.for_deployment, "deployment")
    assert [p.name for p in own] == ["rank", "kv_caches", "store"]
    assert _params(mk.KVPool.__init__) == POSITIONAL + own + KEYWORDS


def test_every_deployment_argument_reaches_the_deployment(monkeypatch):
    """Each keyword constructor hands every argument on, unchanged (a non-default value each)."""
    assert sorted(CONTRACT) == sorted(p.name for p in KEYWORDS)
    seen = []

    class Spy(mk.Deployment):
        def __init__(self, *args, **kwargs):
            seen.append((args, kwargs))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_module, "Deployment", Spy)
    monkeypatch.setattr(kvpool, "Deployment", Spy)
    groups, layout = [mk.FullAttentionSpec(32)], mk.ParallelLayout()
    for given in (NON_DEFAULT, CONTRACT):
        engine = mk.LookupEngine("m", groups, layout, store=mk.MemoryStore(), **given)
        assert engine.vllm_compat == "0.32" and engine.scheduler_block_size == 32 and engine.cache_prefix == "p"
        with pytest.raises(ValueError, match="partial_hash_hits"):  # a pool refuses them, after the deployment
            mk.KVPool("m", groups, layout, rank=(0, 0, 0, 0), kv_caches=[], store=mk.MemoryStore(), **given)
        every = {"contract": None, **given}  # each keyword is handed on, given or not
        assert seen == [(("m", groups, layout), every)] * 2
        seen.clear()


@pytest.mark.parametrize("build", ["deployment", "engine", "engine_for", "pool", "pool_for"])
def test_a_misspelt_keyword_names_itself(build):
    groups, layout = [mk.FullAttentionSpec(16)], mk.ParallelLayout()
    dep = mk.Deployment("m", groups, layout, hash_block_size=16)
    calls = {
        "deployment": lambda: mk.Deployment("m", groups, layout, hash_block_size=16, vllm_compta="0.33"),
        "engine": lambda: mk.LookupEngine("m", groups, layout, store=mk.MemoryStore(), hash_block_size=16,
                                          vllm_compta="0.33"),
        "engine_for": lambda: mk.LookupEngine.for_deployment(dep, store=mk.MemoryStore(), vllm_compta="0.33"),
        "pool": lambda: mk.KVPool("m", groups, layout, rank=(0, 0, 0, 0), kv_caches=[], store=mk.MemoryStore(),
                                  hash_block_size=16, vllm_compta="0.33"),
        "pool_for": lambda: mk.KVPool.for_deployment(dep, rank=(0, 0, 0, 0), kv_caches=[], store=mk.MemoryStore(),
                                                     vllm_compta="0.33"),
    }
    with pytest.raises(TypeError, match="unexpected keyword argument 'vllm_compta'"):
        calls[build]()
