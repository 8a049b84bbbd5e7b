"""A stand-in for torchvision, for SGLang's oracle tests only (never installed, never packaged).

Why it exists: ``sglang.srt.mem_cache.memory_pool`` imports every model config, whose multimodal
helpers import ``torchvision`` at module level. The only torchvision builds on this machine's
package index are CUDA builds, which fail against the CPU torch ("operator torchvision::nms does
not exist"), and an unpinned torchvision pulls another torch with gigabytes of CUDA libraries.
Nothing on the lookup path SGLang's tests run ever uses torchvision.

So every ``torchvision`` module imports, every name in it can be looked up and passed around
(module-level ``T.InterpolationMode.BICUBIC`` in a helper works), and any *use* of one (a call,
iteration, arithmetic, truth) raises ``RuntimeError`` naming it: a test that reached torchvision
would fail loudly, not run on a fake. Its version is ``0.0+stub`` (transformers reads one when it finds the package: a real one's
version gates code paths, the lowest turns the newer ones off).
"""

import importlib.abc
import importlib.machinery
import sys
import types


class Unusable:
    """A torchvision name: it can be named, and raises when used."""

    def __init__(self, path):
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Unusable(f"{self._path}.{name}")

    def _used(self, *args, **kwargs):
        raise RuntimeError(f"{self._path} was used, but torchvision is a stand-in in SGLang's oracle tests")

    __call__ = __iter__ = __bool__ = __len__ = __getitem__ = __add__ = __mul__ = __index__ = _used
    __int__ = __float__ = __enter__ = _used

    def __repr__(self):
        return f"<unusable {self._path}>"


class StubModule(types.ModuleType):
    """A torchvision module: its names are :class:`Unusable`; its submodules import too."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Unusable(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__version__ = "0.0+stub"
__path__ = []
sys.modules[__name__].__class__ = StubModule
