"""``mooncake_keys explain --token-ids``: a prompt's block hashes by the installed vLLM's own hasher,
on every release: those of vLLM's hash chain, and refused where vLLM would seed them at random."""

from __future__ import annotations

import argparse
import os

import pytest

from mooncake_keys.cli import explain as cli_explain
from mooncake_keys.cli.explain import vllm_block_hashes

TOKENS = list(range(1000, 1000 + 16 * 9 + 5))  # 9 full blocks of 16 and a partial one


@pytest.fixture
def kv_cache_utils(monkeypatch):
    """vLLM's module, its NONE_HASH put back after the test (hashing sets it process-wide)."""
    from vllm.v1.core import kv_cache_utils as kcu

    for name in ("NONE_HASH", "_NONE_HASH_SEED"):
        if hasattr(kcu, name):
            monkeypatch.setattr(kcu, name, getattr(kcu, name))
    return kcu


def vllm_chain(kcu, token_ids, block, algo):
    """vLLM's chain of block hashes, block by block (``hash_block_tokens`` from ``NONE_HASH``)."""
    from vllm.utils.hashing import get_hash_fn_by_name

    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    out, parent = [], None
    for i in range(0, len(token_ids) - block + 1, block):
        parent = kcu.hash_block_tokens(fn, parent, token_ids[i:i + block], None)
        out.append(bytes(parent))
    return out


def test_the_hashes_are_vllms_chain(kv_cache_utils, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    hashes = vllm_block_hashes(TOKENS, 16)
    assert len(hashes) == 9 and hashes == vllm_chain(kv_cache_utils, TOKENS, 16, "sha256")
    assert vllm_block_hashes(TOKENS, 16, "sha256_cbor") == vllm_chain(kv_cache_utils, TOKENS, 16, "sha256_cbor")
    monkeypatch.setenv("PYTHONHASHSEED", "4321")
    assert vllm_block_hashes(TOKENS, 16) != hashes  # the seed is the server's: it changes every hash


def test_without_pythonhashseed_only_a_fixed_seed_is_used(kv_cache_utils, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    if hasattr(kv_cache_utils, "resolve_none_hash_seed"):  # vLLM 0.29+: sha256 has a fixed default seed
        assert vllm_block_hashes(TOKENS, 16) == vllm_chain(kv_cache_utils, TOKENS, 16, "sha256")
    else:
        with pytest.raises(ValueError, match="set PYTHONHASHSEED to the server's value"):
            vllm_block_hashes(TOKENS, 16)
    with pytest.raises(ValueError, match="seeds xxhash block hashes at random"):
        vllm_block_hashes(TOKENS, 16, "xxhash")


def test_the_command_line_reads_token_ids(kv_cache_utils, monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    path = tmp_path / "ids.json"
    path.write_text(str(TOKENS))  # a JSON list reads as token ids
    args = argparse.Namespace(hashes=None, token_ids=str(path), hash_algo="sha256", num_tokens=None)
    hashes, num_tokens = cli_explain.prompt_from(args, 16)
    assert num_tokens == len(TOKENS) and hashes == vllm_chain(kv_cache_utils, TOKENS, 16, "sha256")
    assert os.environ["PYTHONHASHSEED"] == "0"
