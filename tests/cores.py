"""The two core modules, loaded directly (not through the dispatcher), for the tests."""

import importlib

try:
    CORE_C = importlib.import_module("mooncake_keys.lookup._core_c")
except ImportError:  # not built here
    CORE_C = None
CORE_PY = importlib.import_module("mooncake_keys.lookup._core_py")
