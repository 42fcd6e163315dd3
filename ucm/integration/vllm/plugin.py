"""UCM's ``vllm.general_plugins`` entry point: ``ucm_sparse = ucm.integration.vllm.plugin:register`` (pyproject).

vLLM calls :func:`register` in every process (API/main, engine core, workers) before the model loads. It overrides
the ``CPU_ATTN`` attention backend with UCM's wrapper (``ucm.integration.vllm.sparse_backend``), which is a pure
pass-through unless ``ucm_sparse_config`` switches a method on. Idempotent. Other platforms: nothing registered in
this version. ``VLLM_PLUGINS`` (a comma-separated allow-list) can exclude it by leaving out ``ucm_sparse``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

PLUGIN_NAME = "ucm_sparse"
ENTRY_POINT = "ucm.integration.vllm.plugin:register"


def register() -> None:
    """Install UCM's attention-backend wrapper for this platform (CPU: override ``CPU_ATTN``)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        logger.debug("UCM sparse attention: no backend wrapper for platform %s in this version", current_platform)
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ucm.integration.vllm.sparse_backend import BACKEND_PATH

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
