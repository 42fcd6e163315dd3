"""What UCM needs to know about a vLLM engine: the KV spec, the block-key namespace and the paged KV layout."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ucm.hashing import KVNamespace
from ucm.kernels.layouts import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# vLLM's CPU attention kernel variants (``_get_attn_isa``) whose in-block KV layout UCM has verified against vLLM
# 0.32's cpu_attn_reshape_and_cache, and the layout each writes. Others (neon, vsx, vxe, rvv) are refused, not guessed.
CPU_ISA_LAYOUTS = {"vec": KVLayout.CPU_ATTN, "vec16": KVLayout.CPU_ATTN, "amx": KVLayout.CPU_ATTN_AMX}


class UnsupportedEngineError(RuntimeError):
    """The engine's KV cache is of a kind UCM does not handle (hybrid groups, unknown layout, ...)."""


@dataclass(frozen=True)
class KVSpec:
    """The engine's KV cache, as UCM sees it (one full-attention group).

    Attributes:
        layer_names: attention layers in canonical-block order.
        block_size: tokens per block.
        num_kv_heads: KV heads on this rank.
        head_dim: elements per head.
        dtype: KV dtype.
    """

    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_nbytes(self) -> int:
        """Bytes of one canonical block (all layers, K and V)."""
        return (
            len(self.layer_names)
            * 2
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * (torch.empty((), dtype=self.dtype).element_size())
        )


def kv_spec(kv_cache_config: KVCacheConfig) -> KVSpec:
    """Read the KV spec from vLLM's ``KVCacheConfig``.

    Raises:
        UnsupportedEngineError: several KV cache groups (hybrid models), non-attention specs, or K/V head sizes
            that differ.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedEngineError(
            f"UCM handles models with one KV cache group; this engine has {len(groups)} "
            f"({[type(g.kv_cache_spec).__name__ for g in groups]})"
        )
    spec: Any = groups[0].kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "dtype", "block_size"):
        if not hasattr(spec, attr):
            raise UnsupportedEngineError(f"UCM needs an attention KV spec, got {type(spec).__name__}")
    head_size_v = getattr(spec, "head_size_v", None) or spec.head_size
    if head_size_v != spec.head_size:
        raise UnsupportedEngineError(f"K head size {spec.head_size} != V head size {head_size_v}: not supported")
    return KVSpec(
        layer_names=tuple(groups[0].layer_names),
        block_size=int(spec.block_size),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        dtype=spec.dtype,
    )


def model_identity(vllm_config: VllmConfig) -> str:
    """Model name/path and revision, plus a digest of its HF config (architecture, sizes, RoPE, ...)."""
    mc = vllm_config.model_config
    try:
        hf = json.dumps(mc.hf_config.to_dict(), sort_keys=True, default=str)
    except Exception:  # pragma: no cover - exotic configs
        hf = repr(mc.hf_config)
    digest = hashlib.blake2b(hf.encode(), digest_size=8).hexdigest()
    return f"{mc.model}@{mc.revision or ''}#{digest}"


def namespace(vllm_config: VllmConfig, spec: KVSpec, tp_rank: int, attention: str = "dense") -> KVNamespace:
    """The block-key namespace of this engine and rank; ``attention``: how its KV is computed when not densely (see
    :class:`~ucm.hashing.KVNamespace`)."""
    return KVNamespace(
        attention=attention,
        model=model_identity(vllm_config),
        kv_dtype=str(spec.dtype).removeprefix("torch."),
        block_size=spec.block_size,
        num_layers=len(spec.layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        tp_rank=tp_rank,
    )


def data_parallel_rank(vllm_config: VllmConfig) -> int | None:
    """This engine's data-parallel rank when it is one of several DP engines, else None.

    vLLM runs each DP rank of a dense model as an independent engine whose parallel config says
    ``data_parallel_size`` 1 and rank 0; the rank survives only in ``data_parallel_index`` and in the ``_dp<rank>``
    suffix vLLM appends to the KV connector's ``engine_id`` in DP engines. MoE ranks keep ``data_parallel_size`` > 1.
    """
    pc = vllm_config.parallel_config
    index = int(getattr(pc, "data_parallel_index", pc.data_parallel_rank))
    if pc.data_parallel_size > 1:
        return index
    transfer = vllm_config.kv_transfer_config
    engine_id = (transfer.engine_id if transfer is not None else None) or ""
    return index if engine_id.endswith(f"_dp{index}") else None


def detect_layout(vllm_config: VllmConfig, spec: KVSpec, cache: torch.Tensor) -> KVLayout:
    """The paged KV layout of this engine, from its platform and attention kernel variant.

    Args:
        vllm_config: the engine's config (model, cache dtype).
        spec: the engine's KV spec.
        cache: one layer's paged KV tensor as vLLM allocated it, in the KV dtype: on CPU ``[num_blocks,
            num_kv_heads, block_size, 2 * head_dim]``, on GPU (FlashAttention) ``[2, num_blocks, block_size,
            num_kv_heads, head_dim]``, contiguous.

    Raises:
        UnsupportedEngineError: the platform or kernel variant stores KV in a layout UCM has not verified, or the
            tensor's shape does not match the detected layout.
    """
    from vllm.platforms import current_platform

    if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
        backend = "AMX_MLA or CPU_MLA" if current_platform.is_cpu() else "an MLA backend"
        raise UnsupportedEngineError(
            f"model {vllm_config.model_config.model!r} uses multi-head latent attention (vLLM's {backend}); UCM's "
            "connector handles models with per-head K and V only (its MLA kernels are not wired to the connector)"
        )
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        cache_dtype = vllm_config.cache_config.cache_dtype
        isa = _get_attn_isa(spec.dtype, spec.block_size, spec.head_dim, cache_dtype)
        if isa not in CPU_ISA_LAYOUTS:
            raise UnsupportedEngineError(
                f"vLLM's CPU attention uses kernel variant {isa!r} on this machine; UCM knows the KV layout of "
                f"{list(CPU_ISA_LAYOUTS)} only and refuses to guess"
            )
        layout = CPU_ISA_LAYOUTS[isa]
        if layout == KVLayout.CPU_ATTN_AMX and cache_dtype != "auto":
            raise UnsupportedEngineError(
                f"vLLM's CPU attention uses kernel variant 'amx' with kv_cache_dtype {cache_dtype!r}; UCM knows the "
                "amx layout of bf16 KV only (kv_cache_dtype 'auto'); allowed: 'auto'"
            )
        want = (spec.num_kv_heads, spec.block_size, 2 * spec.head_dim)
        ok = cache.dim() == 4 and tuple(cache.shape[1:]) == want
    else:
        want = (spec.block_size, spec.num_kv_heads, spec.head_dim)
        layout = KVLayout.FLASH_NHD
        ok = cache.dim() == 5 and cache.shape[0] == 2 and tuple(cache.shape[2:]) == want and cache.is_contiguous()
    if not ok:
        raise UnsupportedEngineError(
            f"paged KV tensor {tuple(cache.shape)} does not match layout {layout.value} for "
            f"block_size={spec.block_size}, num_kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}"
        )
    if cache.dtype != spec.dtype:
        raise UnsupportedEngineError(f"paged KV dtype {cache.dtype} != KV spec dtype {spec.dtype} (quantized KV?)")
    return layout
