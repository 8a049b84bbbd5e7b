"""The drop-in for vLLM: its Mooncake store lookup answered by mooncake_keys.

* :class:`FastMooncakeStoreConnector`: vLLM's ``MooncakeStoreConnector`` whose lookups run here,
  loaded by vLLM's own factory from ``"kv_connector_module_path": "mooncake_keys.vllm"``.
* :func:`accelerate_worker`: the same for a ``MooncakeStoreWorker`` you hold.

Supported: vLLM 0.33.x (and 0.25.x); any other release keeps vLLM's own lookup (see
:mod:`.versions`). ``import mooncake_keys`` never imports this package or vLLM.
"""

from importlib import metadata as _metadata

try:
    _metadata.version("vllm")
    import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector  # noqa: F401
except (ImportError, _metadata.PackageNotFoundError) as _exc:
    raise ImportError(
        "mooncake_keys.vllm needs vLLM with its Mooncake store connector: pip install 'vllm==0.33.*' "
        f"(supported: 0.33.x, 0.25.x) ({type(_exc).__name__}: {_exc})"
    ) from _exc

from .connector import FastMooncakeStoreConnector
from .mapping import Unsupported
from .versions import SUPPORTED, contract_for_installed
from .worker import accelerate_worker

__all__ = ["FastMooncakeStoreConnector", "SUPPORTED", "Unsupported", "accelerate_worker", "contract_for_installed"]
