"""``mooncake_keys explain``: why a prompt hits what it hits on a Mooncake master.

The deployment is given as vLLM serves it: the model, the parallel sizes and the KV-cache
groups as flags, and vLLM's ``--kv-transfer-config`` JSON, of which ``kv_connector_extra_config``
is read: ``cache_prefix`` (the keys' prefix), and ``store_tp_size`` / ``enable_store_tp_lcm`` (a
store layout, whose namespace vLLM resolves on its workers from the attention backend: give it
with ``--store-namespace``). The prompt is the request's block hashes, or its token ids hashed by
the installed vLLM's own hasher. The master is an address or vLLM's Mooncake JSON config.

Every argument is checked (the lookup itself is run against a store double) before the master
is asked; then it is asked once, with every key of the one-shot lookup
(:mod:`mooncake_keys.lookup.explain`). Prints the report; ``--plot`` also draws it (both
:mod:`mooncake_keys.report`). Exit status 0 with a report (a store fault is in it), 1 when the
master cannot be reached, 2 for bad arguments, 3 when the lookup asks more keys than an
explanation keeps (``lookup.explain.MAX_KEYS``; a shorter ``--num-tokens`` can be explained),
before anything is built.

:func:`vllm_block_hashes` turns ``--token-ids`` into the block hashes vLLM gives a plain text
prompt (no LoRA, multimodal input, cache salt or prompt embeddings), by the installed vLLM's own
``get_request_block_hasher``. vLLM chains every hash from ``NONE_HASH``, which it seeds from
``PYTHONHASHSEED`` when that is set; without it, vLLM 0.29 and later seed sha256 hashes with a
fixed string and xxhash ones at random, earlier releases every one at random. A random seed
cannot be reproduced outside the server, so that case is refused.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._checks import MAX_TOKENS

#: vLLM's ``--prefix-caching-hash-algo`` choices.
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: The exit status when the lookup asks more keys than an explanation keeps.
TOO_LARGE = 3

HELP = "why a prompt hits what it hits: every key's answer per group and namespace, and the coordinator's steps"

#: The most hashes (or token ids) read from a prompt file: far past any context length.
MAX_PROMPT = 1 << 22
_KINDS = {"full": 1, "swa": 2, "mamba": 1, "chunked": 2}  # kind -> numbers after it (block size[, size])
_FLAGS = ("eagle", "dropped")
#: What vLLM's kv_connector_extra_config may hold that moves the keys to a store layout.
_STORE_LAYOUT = ("store_tp_size", "enable_store_tp_lcm")

EPILOG = """\
groups, in vLLM's order (--group, repeated):
  full:BLOCK                 full attention (MLA included)
  swa:BLOCK:WINDOW           sliding window; WINDOW in tokens (from vLLM 0.33: sliding_window + extra_retained_tokens)
  mamba:BLOCK                Mamba / recurrent state (vLLM's 'align' cache mode)
  chunked:BLOCK:CHUNK        chunked local attention with CHUNK-token attention chunks
  ...:eagle                  a draft-model (EAGLE) group; ...:dropped  a group not prefix-cacheable (vLLM 0.29+)
  BLOCK is the group's block size as the store sees it (a single group under DCP: block size x dcp).

the prompt's hashes:
  --hashes FILE|-            the request's block hashes, one hex string per line (as vLLM's keys end)
  --token-ids FILE|-         token ids (whitespace- or comma-separated), hashed as vLLM hashes a plain prompt
                             (no LoRA, multimodal input, cache salt or prompt embeddings) by the installed vLLM.
                             vLLM seeds every hash chain from NONE_HASH, which PYTHONHASHSEED sets: run this with
                             the server's PYTHONHASHSEED. Without it, vLLM 0.29+ seeds sha256 with a fixed string
                             (reproducible here) and xxhash at random, older releases every algorithm at random
                             (refused: pass --hashes).

example:
  mooncake_keys explain --model Qwen/Qwen3-32B --tp 4 --pp 2 --num-kv-heads 8 \\
      --group full:64 --group swa:64:4096 --hashes prompt.hashes --master 10.0.0.5:50051 --plot miss.png
"""


# ------------------------------------------------------------------------------- argument types
def _group(text: str) -> Tuple[str, Tuple[int, ...], Tuple[str, ...]]:
    """``KIND:BLOCK[:SIZE][:eagle][:dropped]`` -> (kind, numbers, flags)."""
    parts = text.strip().lower().split(":")
    kind = parts[0]
    if kind not in _KINDS:
        raise argparse.ArgumentTypeError(f"{text!r}: the kind must be one of {', '.join(_KINDS)}")
    want = _KINDS[kind]
    numbers, flags = parts[1:1 + want], parts[1 + want:]
    if len(numbers) != want or not all(n.isascii() and n.isdigit() and len(n) <= 10 and int(n) > 0 for n in numbers):
        shape = {1: "KIND:BLOCK", 2: "KIND:BLOCK:SIZE"}[want]
        raise argparse.ArgumentTypeError(f"{text!r}: expected {shape.replace('KIND', kind)} with whole numbers > 0")
    bad = [f for f in flags if f not in _FLAGS]
    if bad or len(set(flags)) != len(flags):
        raise argparse.ArgumentTypeError(f"{text!r}: after the sizes only {' and '.join(_FLAGS)} may follow, once each")
    return kind, tuple(int(n) for n in numbers), tuple(flags)


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    extra = value.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise argparse.ArgumentTypeError("kv_connector_extra_config must be a JSON object")
    return value


def _master(text: str) -> str:
    from ..store.probe import parse_master_address

    try:
        parse_master_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from ..vllm.contracts import CONTRACTS, DEFAULT_VLLM_COMPAT
    from ..lookup.layout import MAX_RANKS
    from .args import png_path, whole_number

    sizes, tokens = whole_number(1, MAX_RANKS), whole_number(1, MAX_TOKENS)

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG + ("\n" + parser.epilog if parser.epilog else "")
    dep = parser.add_argument_group("the deployment, as vLLM serves it")
    dep.add_argument("--model", required=True, metavar="NAME_OR_PATH",
                     help="vLLM's --model; the keys use its last path component")
    dep.add_argument("--group", dest="groups", action="append", type=_group, required=True,
                     metavar="KIND:BLOCK[:SIZE][:eagle]", help="a KV-cache group, in vLLM's order (repeat; see below)")
    for flag, what in (("--tp", "tensor"), ("--pp", "pipeline"), ("--pcp", "prefill context"),
                       ("--dcp", "decode context")):
        dep.add_argument(flag, type=sizes, default=1, metavar="N",
                         help=f"{what} parallel size (default 1)")
    dep.add_argument("--num-kv-heads", type=sizes, default=1, metavar="N",
                     help="the model's KV heads (default 1)")
    dep.add_argument("--mla", action="store_true", help="an MLA model (one TP namespace)")
    dep.add_argument("--hash-block-size", type=tokens, metavar="TOKENS",
                     help="tokens per request hash (default: the gcd of the groups' block sizes)")
    dep.add_argument("--scheduler-block-size", type=tokens, metavar="TOKENS",
                     help="every hit's multiple (default: the lcm of the groups' block sizes, as vLLM)")
    dep.add_argument("--eagle", action="store_true", help="speculative decoding with EAGLE (vLLM's use_eagle)")
    dep.add_argument("--partial-hash-hits", action="store_true",
                     help="vLLM 0.27+'s hits inside a block (on when a Mamba group's block is larger than the "
                          "hash unit)")
    dep.add_argument("--vllm-compat", choices=sorted(CONTRACTS), default=DEFAULT_VLLM_COMPAT,
                     help=f"the vLLM release the server runs (default {DEFAULT_VLLM_COMPAT})")
    dep.add_argument("--kv-transfer-config", type=_json_object, metavar="JSON",
                     help="vLLM's --kv-transfer-config; kv_connector_extra_config's cache_prefix is read, and a store "
                          "layout (store_tp_size, enable_store_tp_lcm) needs --store-namespace")
    dep.add_argument("--cache-prefix", help="the keys' cache prefix (default: the --kv-transfer-config's, else none)")
    dep.add_argument("--store-namespace", metavar="TAGS",
                     help="vLLM's store namespace (@store_tp:4@store_pp:1@...); with a TP-sharded store layout, "
                          "give the store's TP size as --tp")
    prompt = parser.add_argument_group("the prompt")
    source = prompt.add_mutually_exclusive_group(required=True)
    source.add_argument("--hashes", metavar="FILE|-", help="its block hashes, one hex string per line")
    source.add_argument("--token-ids", metavar="FILE|-", help="its token ids, hashed by the installed vLLM (see below)")
    prompt.add_argument("--hash-algo", choices=HASH_ALGOS, default="sha256",
                        help="vLLM's --prefix-caching-hash-algo, for --token-ids (default sha256)")
    prompt.add_argument("--num-tokens", type=whole_number(0, MAX_TOKENS), metavar="N",
                        help="the request's length (default: the token ids, or hashes x hash block size)")
    prompt.add_argument("--skip-tokens", type=whole_number(0, MAX_TOKENS), default=0, metavar="N",
                        help="tokens held locally: chunks below are not asked and count present (default 0)")
    master = parser.add_argument_group("the master (default: MOONCAKE_KEYS_MASTER, else the config in MOONCAKE_CONFIG_PATH)")
    where = master.add_mutually_exclusive_group()
    where.add_argument("--master", type=_master, metavar="HOST:PORT|etcd://HOST:PORT[;...]",
                       help="the Mooncake master, or the etcd endpoints of an HA cluster")
    where.add_argument("--config", metavar="PATH", help="vLLM's Mooncake JSON config (its master_server_address)")
    parser.add_argument("--plot", type=png_path, metavar="PATH.png",
                        help="also draw the answers as a heat map (needs matplotlib: the bench extra)")


# ------------------------------------------------------------------------------- inputs
class BadArgument(ValueError):
    """An argument that cannot be used; the message names it."""


def deployment_from(args: argparse.Namespace) -> Any:
    """The :class:`~mooncake_keys.Deployment` the flags describe (BadArgument naming the flag)."""
    from ..lookup.deployment import Deployment
    from ..lookup.keys import model_name_from_path
    from ..lookup.layout import ParallelLayout
    from ..lookup.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheGroup, MambaSpec, SlidingWindowSpec

    extra = (args.kv_transfer_config or {}).get("kv_connector_extra_config", {})
    layout_keys = [k for k in _STORE_LAYOUT if extra.get(k) not in (None, False)]
    if layout_keys and args.store_namespace is None:
        raise BadArgument(f"argument --kv-transfer-config: {' and '.join(layout_keys)} put the keys in a store layout "
                          "whose namespace vLLM resolves on its workers: give it with --store-namespace (from a "
                          "key in the store, after the model name)")
    cache_prefix = args.cache_prefix if args.cache_prefix is not None else extra.get("cache_prefix", "")
    if not isinstance(cache_prefix, str):
        raise BadArgument(f"argument --kv-transfer-config: cache_prefix must be a string, got {cache_prefix!r}")
    groups = []
    for kind, numbers, flags in args.groups:
        spec = {"full": FullAttentionSpec, "swa": SlidingWindowSpec, "mamba": MambaSpec,
                "chunked": ChunkedLocalAttentionSpec}[kind](*numbers)
        groups.append(KVCacheGroup(spec, is_eagle_group="eagle" in flags, prefix_cacheable="dropped" not in flags))
    hash_block_size = args.hash_block_size or math.gcd(*(g.spec.block_size for g in groups))
    options: Dict[str, Any] = dict(hash_block_size=hash_block_size, scheduler_block_size=args.scheduler_block_size,
                                   use_eagle=args.eagle, cache_prefix=cache_prefix, vllm_compat=args.vllm_compat)
    if args.store_namespace:
        options["store_namespace"] = args.store_namespace
    if args.partial_hash_hits:
        options["partial_hash_hits"] = True
    try:
        layout = ParallelLayout(tp_size=args.tp, pp_size=args.pp, pcp_size=args.pcp, dcp_size=args.dcp,
                                num_kv_heads=args.num_kv_heads, use_mla=args.mla)
        # vLLM writes the keys whatever its names hold: reproduce them.
        return Deployment(model_name_from_path(args.model), groups, layout, allow_ambiguous_names=True, **options)
    except (TypeError, ValueError) as exc:
        raise BadArgument(f"the deployment (--model, --group, --tp ... flags): {exc}") from None


def _read_text(path: str, flag: str, stdin_used: List[bool]) -> str:
    if path == "-":
        if stdin_used[0]:
            raise BadArgument(f"argument {flag}: standard input is already read")
        stdin_used[0] = True
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadArgument(f"argument {flag}: cannot read {path!r}: {getattr(exc, 'strerror', None) or exc}") from None


def read_hashes(text: str) -> List[bytes]:
    """One hex hash per line (blank lines and ``#`` comments skipped), all the same length."""
    hashes: List[bytes] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            h = bytes.fromhex(line)
        except ValueError:
            raise BadArgument(f"argument --hashes: line {number} is not a hex hash: {line[:80]!r}") from None
        if not h or (hashes and len(h) != len(hashes[0])):
            raise BadArgument(f"argument --hashes: line {number}: every hash must have the same length "
                              f"({len(hashes[0]) if hashes else 'more than 0'} bytes), got {len(h)}")
        hashes.append(h)
        if len(hashes) > MAX_PROMPT:
            raise BadArgument(f"argument --hashes: more than {MAX_PROMPT} hashes")
    if not hashes:
        raise BadArgument("argument --hashes: no hash in it")
    return hashes


def read_token_ids(text: str) -> List[int]:
    """Whole numbers separated by whitespace or commas (a JSON list reads too)."""
    words = re.split(r"[\s,\[\]]+", text.strip().strip("[]"))
    words = [w for w in words if w]
    if not words:
        raise BadArgument("argument --token-ids: no token id in it")
    if len(words) > MAX_PROMPT:
        raise BadArgument(f"argument --token-ids: more than {MAX_PROMPT} token ids")
    bad = next((w for w in words if not (w.isascii() and w.isdigit() and len(w) <= 10)), None)
    if bad is not None:
        raise BadArgument(f"argument --token-ids: {bad[:40]!r} is not a token id (a whole number >= 0)")
    return [int(w) for w in words]


def vllm_block_hashes(token_ids: Sequence[int], hash_block_size: int, hash_algo: str = "sha256") -> List[bytes]:
    """The block hashes (``hash_block_size`` tokens each) vLLM gives a plain prompt of
    ``token_ids``, by the installed vLLM's own hasher (see the module docstring).

    ImportError without vLLM; ValueError when vLLM would seed them at random in this process."""
    if hash_algo not in HASH_ALGOS:
        raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {hash_algo!r}")
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.request import Request
    except ImportError as exc:
        raise ImportError(
            "hashing token ids needs vLLM (the release the server runs: its hasher is used): install it, "
            f"or give the request's block hashes instead (--hashes) ({type(exc).__name__}: {exc})"
        ) from exc
    fixed_seed = hasattr(kv_cache_utils, "resolve_none_hash_seed") and not hash_algo.startswith("xxhash")
    if os.environ.get("PYTHONHASHSEED") is None and not fixed_seed:
        raise ValueError(
            f"without PYTHONHASHSEED this vLLM seeds {hash_algo} block hashes at random in every process, so "
            "the server's cannot be reproduced here: set PYTHONHASHSEED to the server's value, or give the "
            "request's block hashes (--hashes)"
        )
    hash_fn = get_hash_fn_by_name(hash_algo)
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(hash_block_size, hash_fn)
    request = Request(request_id="mooncake_keys-explain", prompt_token_ids=list(token_ids),
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None, block_hasher=hasher)
    return [bytes(h) for h in request.block_hashes]


def prompt_from(args: argparse.Namespace, hash_block_size: int) -> Tuple[List[bytes], int]:
    """(the block hashes, num_tokens)."""
    stdin_used = [False]
    if args.hashes is not None:
        hashes = read_hashes(_read_text(args.hashes, "--hashes", stdin_used))
        return hashes, args.num_tokens if args.num_tokens is not None else len(hashes) * hash_block_size
    token_ids = read_token_ids(_read_text(args.token_ids, "--token-ids", stdin_used))
    try:
        hashes = vllm_block_hashes(token_ids, hash_block_size, args.hash_algo)
    except (ImportError, ValueError) as exc:
        raise BadArgument(f"argument --token-ids: {exc}") from None
    if not hashes:
        raise BadArgument(f"argument --token-ids: {len(token_ids)} tokens make no full block of {hash_block_size}")
    return hashes, args.num_tokens if args.num_tokens is not None else len(token_ids)


def _master_from(args: argparse.Namespace) -> Any:
    """The master to ask (a :class:`~mooncake_keys.store.default.ConfiguredMaster`): ``--master``,
    ``--config``, else the environment's (``MOONCAKE_KEYS_MASTER``, ``MOONCAKE_CONFIG_PATH``)."""
    from ..store.config import CONFIG_PATH_ENV
    from ..store.default import MASTER_ENV, BadMasterSetting, ConfiguredMaster, configured_master

    if args.master is not None:  # checked by its argument type
        return ConfiguredMaster("--master", args.master)
    try:
        named = configured_master(config_path=args.config)
    except BadMasterSetting as exc:
        raise BadArgument(str(exc).replace("config_path:", "argument --config:", 1)) from None
    if named is None:
        raise BadArgument(f"no master: give --master or --config (or set {MASTER_ENV} or {CONFIG_PATH_ENV})")
    if named.setting == "config_path":
        named = ConfiguredMaster("--config", named.address, named.config)
    return named


# ------------------------------------------------------------------------------- main
def _error(message: str, status: int = 2) -> int:
    from .args import error

    return error("explain", message, status)


def main(args: argparse.Namespace) -> int:
    from ..lookup.engine import LookupEngine
    from ..lookup.explain import ExplanationTooLarge
    from ..report import heat_map, matplotlib_missing, text
    from ..store.recording import RecordingStore

    try:
        if args.plot:
            missing = matplotlib_missing()
            if missing:
                raise BadArgument(f"argument --plot: {missing}")
        dep = deployment_from(args)
        hashes, num_tokens = prompt_from(args, dep.hash_block_size)
        master = _master_from(args)
        try:  # the lookup's own checks, against a store double: nothing is asked of the master yet
            LookupEngine.for_deployment(dep, store=RecordingStore()).explain(num_tokens, hashes,
                                                                             skip_tokens=args.skip_tokens)
        except ExplanationTooLarge as exc:  # checked before a key is built
            return _error(f"too large to explain (--num-tokens, the prompt, the --tp/--pp/--pcp/--dcp sizes): {exc}",
                          TOO_LARGE)
        except (TypeError, ValueError) as exc:
            raise BadArgument(f"the lookup (--num-tokens, --skip-tokens, the prompt): {exc}") from None
    except BadArgument as exc:
        return _error(str(exc))
    from ..store.default import connect_configured
    from ..store.mooncake import MooncakeStoreError

    try:
        store = connect_configured(master, lookup_only=True)
    except ImportError as exc:
        return _error(f"{master.setting}: cannot reach the master: {exc}", 1)
    except MooncakeStoreError as exc:  # it names the setting
        return _error(exc, 1)
    with store:
        report = LookupEngine.for_deployment(dep, store=store).explain(num_tokens, hashes, skip_tokens=args.skip_tokens)
    print(text(report))
    if args.plot:
        print(f"plot: {heat_map(report, args.plot)}")
    return 0
