"""Build the optional compiled core; fall back to pure Python when it cannot be built.

``MOONCAKE_KEYS_NO_EXTENSIONS=1`` skips the compiled core; ``MOONCAKE_KEYS_FORCE_EXTENSIONS=1``
makes a build failure fatal (the PyYAML ``PYYAML_FORCE_LIBYAML`` pattern).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NO_EXTENSIONS = bool(os.environ.get("MOONCAKE_KEYS_NO_EXTENSIONS"))
FORCE_EXTENSIONS = bool(os.environ.get("MOONCAKE_KEYS_FORCE_EXTENSIONS"))


def _warn(msg: str) -> None:
    bar = "*" * 75
    print(f"\n{bar}\nWARNING: {msg}\nmooncake_keys falls back to pure Python.\n{bar}\n", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """A build_ext whose failure leaves a working pure-Python install behind."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # compiler missing, Cython missing, ...
            if FORCE_EXTENSIONS:
                raise
            _warn(f"the compiled core could not be built ({exc!r}).")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            if FORCE_EXTENSIONS:
                raise
            _warn(f"building {ext.name} failed ({exc!r}).")


def _extensions():
    if NO_EXTENSIONS:
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        if FORCE_EXTENSIONS:
            raise
        _warn("Cython is not installed.")
        return []
    return cythonize(
        [Extension("mooncake_keys.lookup._core_c", ["mooncake_keys/lookup/_core_c.pyx"], extra_compile_args=["-O3"])],
        compiler_directives={"language_level": "3"},
    )


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
