"""The two core modules, loaded directly (not through the dispatcher), for the tests."""

import importlib

try:
    CORE_C = importlib.import_module("mooncake_keys.lookup._core_c")
except ImportError:  # not built here
    CORE_C = None
CORE_PY = importlib.import_module("mooncake_keys.lookup._core_py")
#: Why engines cannot be pinned to the compiled core here (None when they can): not built, or
#: MOONCAKE_KEYS_NO_EXTENSIONS set (then only the direct parity tests use CORE_C).
NO_C_ENGINES = ("the compiled core is not built" if CORE_C is None else
                "MOONCAKE_KEYS_NO_EXTENSIONS is set" if importlib.import_module("mooncake_keys.lookup._core").NO_EXTENSIONS
                else None)
