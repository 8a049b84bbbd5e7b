"""A stand-in for the GPU driver's ``libcuda.so.1`` that answers "no device", for tests only.

Mooncake 0.3.14's Python client ships only as a CUDA 13 build: its libraries link ``libcuda.so.1``
(the driver) and will not load on a machine without one. This builds, from C source written
here, a library of that name that exports every driver function those libraries import and
answers each call ``CUDA_ERROR_NO_DEVICE`` (100), as the driver's own stub library does on a
machine without a GPU. The Mooncake client code stays real; with ``protocol="tcp"`` it makes
no CUDA call a test depends on. It is never part of the package and never committed as a
binary: ``bash scripts/dev.sh`` builds it into the cache beside the unpacked wheel::

    python tests/support/no_device_driver.py <the unpacked 0.3.14 wheel>   # prints its folder

``client_env(root)`` is the environment a child process needs to import that client.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

#: CUDA_ERROR_NO_DEVICE: "no CUDA-capable device is detected".
CUDA_ERROR_NO_DEVICE = 100
#: Where, under the unpacked wheel, the stand-in is built (named for what it is).
FOLDER = "no-device-driver"
_DRIVER_SYMBOL = re.compile(r"^cu[A-Z]\w*$")


def driver_symbols(package: Path) -> List[str]:
    """The driver functions (``cu*``) that the package's libraries linking libcuda.so.1 import."""
    wanted = set()
    for lib in sorted(package.rglob("*.so*")):
        needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
        if "libcuda.so.1" not in needed:
            continue
        undefined = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True,
                                   text=True, check=True).stdout
        for line in undefined.splitlines():
            name = line.split()[-1].split("@")[0]
            if _DRIVER_SYMBOL.match(name):
                wanted.add(name)
    return sorted(wanted)


def source(symbols: List[str]) -> str:
    """C source: each symbol a function returning CUDA_ERROR_NO_DEVICE (a CUresult is an int
    returned in a register, whatever the arguments were)."""
    lines = [f"/* libcuda.so.1 stand-in: no device (CUDA_ERROR_NO_DEVICE = {CUDA_ERROR_NO_DEVICE}). */"]
    lines += [f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}" for name in symbols]
    return "\n".join(lines) + "\n"


def build(root: Path) -> Path:
    """Build (unless it is there and current) the stand-in for the wheel unpacked at ``root``;
    its folder."""
    out = root / FOLDER
    lib = out / "libcuda.so.1"
    symbols = driver_symbols(root / "mooncake")
    if not symbols:
        raise SystemExit(f"no library under {root / 'mooncake'} imports a driver function: is it the CUDA build?")
    text = source(symbols)
    src = out / "no_device_libcuda.c"
    if lib.exists() and src.exists() and src.read_text() == text:
        return out
    out.mkdir(parents=True, exist_ok=True)
    src.write_text(text)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)],
                   check=True)
    return out


def client_env(root: Path, base: Dict[str, str] | None = None) -> Dict[str, str]:
    """The environment of a child process that imports the 0.3.14 client unpacked at ``root``
    (its package first on the path, CUDA's runtime and the stand-in driver found by the loader)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    libs = [str(root / FOLDER), str(root / "cuda")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    return env


if __name__ == "__main__":
    print(build(Path(sys.argv[1]).resolve()))
