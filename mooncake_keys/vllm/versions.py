"""Which vLLM releases the drop-in supports, and which lookup contract each follows.

| vLLM   | lookup accelerated | contract |
|--------|--------------------|----------|
| 0.33.x | yes                | "0.33"   |
| 0.25.x | yes                | "0.25"   |
| other  | no: vLLM's own lookup is kept, and a log line says so | - |
"""

from __future__ import annotations

from importlib import metadata
from typing import Optional

__all__ = ["SUPPORTED", "contract_for", "contract_for_installed", "installed_version"]

#: vLLM minor release -> the mooncake_keys contract (``vllm_compat``) reproducing its lookup.
SUPPORTED = {(0, 33): "0.33", (0, 25): "0.25"}


def installed_version() -> str:
    """The installed vLLM's version string ('' if none)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return ""


def contract_for(version: str) -> Optional[str]:
    """The contract of vLLM ``version`` ('0.33.0' -> '0.33'), or None when unsupported."""
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return None
    return SUPPORTED.get((major, minor))


def contract_for_installed() -> Optional[str]:
    return contract_for(installed_version())
