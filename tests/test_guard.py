"""The dispatcher: which core is active, and a guard against a silently missing build."""

import os
import subprocess
import sys
import tempfile

import pytest

import mooncake_keys as mk
from mooncake_keys.lookup import _core, _core_py


def _compiler_works() -> bool:
    """Can this environment compile a C extension (honouring CC, as the build does)?"""
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler

    cc = new_compiler()
    customize_compiler(cc)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "probe.c")
        with open(src, "w") as f:
            f.write("#include <Python.h>\nint probe(void) { return 0; }\n")
        try:
            from sysconfig import get_paths

            cc.compile([src], output_dir=d, include_dirs=[get_paths()["include"]])
        except Exception:
            return False
    # Cython is not asked for here: it is a build requirement (pyproject.toml), so pip's isolated
    # build has it even when the installed environment does not (a clean CI venv has no Cython).
    return True


def test_compiled_core_loaded_when_a_compiler_is_present():
    """A silent fallback would hide a broken build: fail when the build could have succeeded."""
    if _core.NO_EXTENSIONS:  # read at import: the suite's fixtures clear the variable for children
        pytest.skip("pure Python forced by MOONCAKE_KEYS_NO_EXTENSIONS (or not CPython)")
    if not _compiler_works():
        assert mk.ACCELERATED is False
        pytest.skip("no working C compiler: the pure-Python core is expected")
    assert mk.ACCELERATED, "a C compiler is present but mooncake_keys._core_c did not load"


def test_public_flag_follows_the_dispatcher():
    assert mk.ACCELERATED is _core.ACCELERATED
    if not mk.ACCELERATED:
        assert _core.fill_keys is _core_py.fill_keys


def test_no_extensions_switch_forces_pure_python():
    code = "import mooncake_keys as mk, mooncake_keys.lookup._core as c; print(mk.ACCELERATED, c.fill_keys.__module__)"
    env = dict(os.environ, MOONCAKE_KEYS_NO_EXTENSIONS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "mooncake_keys.lookup._core_py"]


def test_both_cores_have_the_same_functions():
    from support.cores import CORE_C

    if CORE_C is None:
        pytest.skip("the compiled core is not built")
    assert CORE_C.__all__ == _core_py.__all__  # behaviour: tests/test_core_parity.py
    for name in ("fill_keys", "reduce_presence"):
        assert callable(getattr(CORE_C, name))


def test_require_real_turns_a_missing_component_into_an_error():
    """The test command sets MK_REQUIRE_REAL=1: a missing etcd must fail the run, not skip tests."""
    env = dict(os.environ, MK_REQUIRE_REAL="1", PATH=tempfile.gettempdir() + "/no-such-dir")
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                          os.path.join(here, "test_guard.py")], env=env, capture_output=True, text=True, cwd=here)
    assert out.returncode == 4, (out.returncode, out.stdout[-500:], out.stderr[-500:])  # a usage error
    assert "MK_REQUIRE_REAL=1 but these are missing: etcd" in out.stdout + out.stderr
