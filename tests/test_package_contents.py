"""The installed package holds the product and its commands; the test and benchmark harness (vLLM's
real workers built on a CPU machine) lives in tests/support/, and a plain install says what it
cannot measure without it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import mooncake_keys

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_the_worker_harness_is_in_tests_not_in_the_package():
    package = Path(mooncake_keys.__file__).parent
    modules = {p.stem for p in package.rglob("*.py")}
    assert {"engine", "connector", "suite"} <= modules  # the walk saw the package
    assert "vllm_workers" not in modules
    spec = importlib.util.find_spec("support.vllm_workers")  # tests/conftest.py put tests/ on sys.path
    assert spec is not None and spec.origin == os.path.join(TESTS, "support", "vllm_workers.py")


def test_a_plain_install_says_the_vllm_column_needs_a_checkout():
    """Without tests/ on the path (an installed package), the vLLM baseline is left out with a
    reason naming the harness and the command that measures it; nothing imports vLLM for it."""
    code = ("import sys\n"
            "from mooncake_keys.bench import vllm_baseline\n"
            "print(vllm_baseline.unavailable())\n"
            "try:\n    vllm_baseline.workers()\nexcept ImportError as exc:\n    print('IMPORTERROR', exc.name, exc)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'support'}))\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and os.path.abspath(p) != TESTS)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd="/")
    reason, error, imported = out.stdout.strip().splitlines()
    assert "tests/support/vllm_workers.py" in reason and "bash scripts/dev.sh bench" in reason
    assert error.startswith("IMPORTERROR support.vllm_workers ") and "tests/support/vllm_workers.py" in error
    assert imported == "[]"


def _imports(path: Path, package: str):
    """The modules ``path`` (a module of ``package``) imports, anywhere in it, resolved."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
    return out


def test_the_lookup_core_names_no_engine():
    """lookup/ imports no engine's package (vLLM's, or our drop-in for it) and builds no release's
    contract: the rows are the engine's (mooncake_keys/vllm/contracts.py), registered by the package."""
    import ast

    lookup = Path(mooncake_keys.__file__).parent / "lookup"
    for path in lookup.glob("*.py"):
        named = _imports(path, "mooncake_keys.lookup")
        assert not [m for m in named if m.split(".")[0] == "vllm" or m.startswith("mooncake_keys.vllm")], path
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", None) == "Contract"]
        assert not calls, f"{path.name} builds a Contract"
    from mooncake_keys.lookup import contract
    from mooncake_keys.vllm import contracts

    assert contract.named("vllm_compat", None) is contracts.CONTRACTS["0.33"]
    assert contracts.DEFAULT_VLLM_COMPAT == "0.33" and sorted(contracts.CONTRACTS)[0] == "0.25"


def test_a_second_engine_brings_its_own_contract():
    """A sibling of vllm/ hands its releases' rules to the core as a Contract (``contract=``); the
    core's messages name that engine and its argument."""
    import dataclasses

    import pytest

    import mooncake_keys as mk
    from mooncake_keys.vllm.contracts import get_contract

    other = dataclasses.replace(get_contract("0.29"), engine="OtherEngine", argument="other_compat", name="1.4")
    args = ("m", [mk.FullAttentionSpec(16)], mk.ParallelLayout())
    dep = mk.Deployment(*args, hash_block_size=16, contract=other)
    assert dep.contract is other and dep.contract.release == "OtherEngine 1.4"
    with pytest.raises(ValueError, match=r"OtherEngine 1.4 has no store_namespace \(other_compat='1.4'\)"):
        mk.Deployment(*args, hash_block_size=16, contract=dataclasses.replace(other, store_namespaces=False),
                      store_namespace="@store_tp:1")
    with pytest.raises(TypeError, match="either vllm_compat or contract"):
        mk.Deployment(*args, hash_block_size=16, contract=other, vllm_compat="0.33")
    with pytest.raises(TypeError, match="contract must be a Contract, got str"):
        mk.Deployment(*args, hash_block_size=16, contract="0.33")


def test_the_vllm_package_imports_no_vllm_for_its_contracts():
    """``import mooncake_keys`` reads vLLM's contract rows from mooncake_keys.vllm without
    importing vLLM; the drop-in's names are imported on first use."""
    code = ("import sys, mooncake_keys, mooncake_keys.vllm as mv\n"
            "print(sorted(m for m in sys.modules if m.startswith('mooncake_keys.vllm') or m.split('.')[0] == 'vllm'))\n"
            "print(sorted(mv.__all__) == sorted(set(dir(mv)) & set(mv.__all__)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["['mooncake_keys.vllm', 'mooncake_keys.vllm.contracts']", "True"]


def test_the_commands_import_no_circle():
    """cli/__init__.py imports each subcommand; a subcommand imports what the commands share from
    cli/args.py, never the package that imports it (nor another subcommand)."""
    cli = Path(mooncake_keys.__file__).parent / "cli"
    subcommands = {"mooncake_keys.cli.bench", "mooncake_keys.cli.demo", "mooncake_keys.cli.explain"}
    for name in ("bench", "demo", "explain", "args"):
        named = _imports(cli / f"{name}.py", "mooncake_keys.cli")
        ours = {m for m in named if m == "mooncake_keys.cli" or m.startswith("mooncake_keys.cli.")}
        assert "mooncake_keys.cli" not in ours, name
        assert not ours & subcommands, name
        if name == "args":
            assert not ours, ours
