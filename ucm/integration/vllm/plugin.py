"""UCM's ``vllm.general_plugins`` entry point: ``ucm_sparse = ucm.integration.vllm.plugin:register`` (pyproject).

vLLM calls :func:`register` in every process (API/main, engine core, workers) before the model loads. It

- registers ``UCMConnector`` in vLLM's connector registry (``KVConnectorFactory``), so that code that resolves a
  connector by its name alone finds it: vLLM's ``MultiConnector`` rebuilds each sub-connector's metrics from their
  serialized form that way in the API server, where UCM's module is otherwise never imported (a
  ``kv_connector_module_path`` still takes priority, and becomes optional);
- on CPU, overrides the ``CPU_ATTN`` attention backend with UCM's wrapper (``ucm.integration.vllm.sparse_backend``),
  a pure pass-through unless ``ucm_sparse_config`` switches a method on, and makes the process remember the model
  vLLM loads (CacheBlend runs its layers, ``ucm.integration.vllm.blend``), and registers vLLM's fused CPU RMSNorm
  kernels as provider ``ucm_cpu`` of vLLM's IR ops (``ucm.integration.vllm.cpu_norms``; used only inside
  CacheBlend's pass). Other platforms: no wrapper in this version.

Idempotent. ``VLLM_PLUGINS`` (a comma-separated allow-list) can exclude it by leaving out ``ucm_sparse``.
"""

from __future__ import annotations

import contextlib
import logging

logger = logging.getLogger(__name__)

PLUGIN_NAME = "ucm_sparse"
ENTRY_POINT = "ucm.integration.vllm.plugin:register"
CONNECTOR_NAME = "UCMConnector"
CONNECTOR_MODULE = "ucm.integration.vllm.ucm_connector"


def register_connector() -> None:
    """Register ``UCMConnector`` (lazily: its module is imported on first use) unless a connector of that name is
    registered already."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # "already registered": this process registered it before
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)


def register() -> None:
    """Register UCM's connector; install UCM's attention-backend wrapper for this platform (CPU: override
    ``CPU_ATTN``)."""
    register_connector()
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        logger.debug("UCM sparse attention: no backend wrapper for platform %s in this version", current_platform)
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ucm.integration.vllm.blend import install_model_capture
    from ucm.integration.vllm.cpu_norms import register_cpu_norms
    from ucm.integration.vllm.sparse_backend import BACKEND_PATH

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    install_model_capture()
    register_cpu_norms()
