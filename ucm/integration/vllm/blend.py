"""CacheBlend in vLLM: the stored KV of a prompt's chunks reused wherever they appear, with selective recompute.

CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion",
EuroSys 2025, arXiv 2405.16444). Users end each chunk of the prompt (e.g. each retrieved document) with
``chunk_end_token_id`` and switch it on with ``ucm_sparse_config: {Blend: {...}}`` (``ucm.config.BlendConfig``).

What vLLM is told. vLLM 0.32 computes every prompt token it schedules, through every layer, and offers no hook to
drop tokens from its pass. So CacheBlend runs *before* vLLM's pass, as a KV load: the scheduler side
(:meth:`UCMScheduler.get_num_new_matched_tokens <ucm.integration.vllm.scheduler.UCMScheduler>`) offers, past the
stored prefix, every token up to the end of the prompt's last chunk as external tokens; vLLM allocates their blocks
and schedules only the rest (the suffix, e.g. the question), and the worker fills the offered tokens' KV in
``start_load_kv`` (:class:`Blender`), after the step's ordinary prefix loads. vLLM then computes the suffix over
that KV and samples as usual.

The blend of a run ``[start, end)`` of one request (:meth:`Blender.blend`):

1. Each chunk ``[s, e)`` of the run is looked up under the keys of its own tokens from the request's seed (the
   keys a prompt that begins with the chunk stores its prefix under, so a chunk computed once as a prefix, or as a
   chunk, anywhere, is found again). Found blocks are loaded; a chunk the store lacks is computed on its own
   (positions from 0, through the model's layers) and stored under those keys (``store_chunks``). Its keys,
   rotated for positions ``0..``, are re-rotated by ``s`` to their positions in this prompt (the RoPE delta,
   ``ucm.kernels.blend.rope_delta_``).
2. The run's tokens go through the model's own decoder layers (vLLM's modules: norms, QKV projection, rotary
   embedding, MLP), with attention computed here over the prompt's prefix KV (read from the paged cache) and the
   run's KV: at layers up to the one named in ``compute_meta`` every token is recomputed; at that layer the tokens
   whose recomputed K and V deviate most from the stored ones (``ratio`` of them, ``ucm.kernels.blend``), plus the
   tokens without stored KV, are chosen, and only they go through the later layers; the other tokens keep their
   stored KV there.
3. The run's KV, layer by layer, is written into the request's slots of vLLM's paged cache with vLLM's own cache
   writer (so every CPU kernel variant's layout, ``vec``, ``vec16`` and ``amx``, is written as vLLM writes it).

The model's layers are called with a forward context whose attention metadata is this module's
:class:`BlendPass`; UCM's attention wrapper (``ucm.integration.vllm.sparse_backend``) hands such calls to it, and
vLLM's cache writer sees no slot mapping, so nothing else is written. ``ratio: 1`` recomputes every token: the
full prefill's KV (to float rounding: the attention here runs in float32 torch, not vLLM's kernel).

A blend that fails (a load error, an exception) reports the run's blocks as failed loads: vLLM recomputes them,
exactly. Blended KV is approximate, so the request dumps no block under its prefix keys (the scheduler skips its
dumps); vLLM's own prefix cache may still reuse the blended blocks for a later prompt with the same tokens.

Limits of this version: vLLM's CPU backend (the wrapper's platform); models whose decoder layers are called as
``layer(positions, hidden_states, residual)`` (Llama, Qwen2, Mistral...) with plain RoPE; tensor parallel size 1;
blockwise transfer (not ``use_layerwise``).
"""

from __future__ import annotations

import functools
import inspect
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ucm.config import BlendConfig, UcmConfigError
from ucm.hashing import block_keys, rank_keys
from ucm.integration.vllm.engine_info import KVSpec
from ucm.integration.vllm.metadata import BlendTransfer
from ucm.kernels.blend import kv_deviation, rope_delta_, select_recompute
from ucm.kernels.layouts import CPU_LAYOUTS, KVLayout, cpu_attn_kv_views
from ucm.logger import init_logger
from ucm.sparse.blend import attention_by_position
from ucm.store.base import UcmKVStoreBase

logger = init_logger(__name__)

_loaded_models: list[weakref.ref[torch.nn.Module]] = []


def install_model_capture() -> None:
    """Make this process remember the models vLLM loads (wraps ``BaseModelLoader.load_model``; idempotent): the
    blend runs the model's decoder layers, which vLLM hands no KV connector. Called by UCM's ``vllm.general_plugins``
    entry point."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model
    if getattr(original, "_ucm_capture", False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        model = original(self, *args, **kwargs)
        _loaded_models.append(weakref.ref(model))
        return model

    load_model.__dict__["_ucm_capture"] = True  # marks the wrapper: installing twice wraps once
    BaseModelLoader.load_model = load_model  # type: ignore[method-assign]


def loaded_model() -> torch.nn.Module | None:
    """The last model this process loaded (:func:`install_model_capture`) that is still alive, or ``None``."""
    for ref in reversed(_loaded_models):
        model = ref()
        if model is not None:
            return model
    return None


@dataclass
class BlendPass:
    """The attention metadata of a blend's pass through the model's layers (every attention layer gets this object;
    UCM's attention wrapper calls :meth:`attend` instead of vLLM's kernel).

    Attributes:
        layer_of: attention layer name -> decoder layer index.
        prefix_kv: per layer ``(K, V)`` of the tokens before the run, ``[start, num_kv_heads, head_dim]`` each.
        prefix_pos: int64 ``[start]`` their positions.
        kv: ``[num_layers, 2, T, num_kv_heads, head_dim]`` the run's KV: the stored KV (keys at their positions in
            this prompt) where ``stored`` says so, overwritten by each layer's recomputed rows; its final value is
            the run's KV.
        stored: bool ``[T]``: which run tokens have stored KV (the others are always recomputed).
        positions: int64 ``[T]`` the run's positions.
        check_layer / ratio: where and how many tokens are chosen (``compute_meta``).
        rows: int64 the run rows the layers compute now (all, then the chosen ones after ``check_layer``).
        chosen: set by :meth:`attend` at ``check_layer``: the rows recomputed from then on, sorted: the ``ratio`` of
            the stored rows whose K and V deviate most from the stored ones, and every row without stored KV.
    """

    layer_of: dict[str, int]
    prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]
    prefix_pos: torch.Tensor
    kv: torch.Tensor
    stored: torch.Tensor
    positions: torch.Tensor
    check_layer: int
    ratio: float
    rows: torch.Tensor = field(init=False)
    chosen: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.rows = torch.arange(self.positions.shape[0])

    def attend(
        self,
        layer_name: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        scale: float,
    ) -> None:
        """One attention layer of the pass: record the computed rows' K and V, choose the rows to recompute at the
        check layer, and write the rows' attention over the prefix and the run into ``output``.

        Args:
            query: ``[n, num_heads, head_dim]``, key / value ``[n, num_kv_heads, head_dim]``: the rows ``rows`` of the
                run (post-RoPE); output: ``[n, num_heads, head_dim]``, written.
        """
        i = self.layer_of[layer_name]
        n = self.rows.shape[0]
        k_new, v_new = key.view(n, *self.kv.shape[3:]), value.view(n, *self.kv.shape[3:])
        if i == self.check_layer:  # every row is computed here: rank the stored ones, keep the others
            have = self.stored.nonzero().flatten()
            deviation = kv_deviation(k_new[have], v_new[have], self.kv[i, 0, have], self.kv[i, 1, have])
            picked = have[select_recompute(deviation, self.ratio)]
            self.chosen = torch.cat((picked, (~self.stored).nonzero().flatten())).sort().values
        self.kv[i, 0, self.rows] = k_new
        self.kv[i, 1, self.rows] = v_new
        prefix_k, prefix_v = self.prefix_kv[i]
        keys = torch.cat((prefix_k, self.kv[i, 0]))
        values = torch.cat((prefix_v, self.kv[i, 1]))
        k_pos = torch.cat((self.prefix_pos, self.positions))
        out = attention_by_position(query, self.positions[self.rows], keys, values, k_pos, scale)
        output.copy_(out.view_as(output))


@dataclass(frozen=True)
class _Rope:
    rotary_dim: int
    base: float
    neox: bool


class Blender:
    """Fills CacheBlend's runs (:class:`~ucm.integration.vllm.metadata.BlendTransfer`) of a step into vLLM's paged
    KV, in one worker (see the module docstring).

    Args:
        config: ``ucm_sparse_config.Blend``.
        vllm_config: the engine's config (the forward context of the blend's pass).
        spec: the engine's KV spec.
        store: the store pipeline (chunk lookups, loads and dumps).
        load_timeout_s: most seconds a chunk's load or dump is waited for (``load_timeout_ms``).
    """

    def __init__(
        self, config: BlendConfig, vllm_config: Any, spec: KVSpec, store: UcmKVStoreBase, load_timeout_s: float
    ) -> None:
        self._cfg = config
        self._vllm_config = vllm_config
        self._spec = spec
        self._store = store
        self._timeout_s = load_timeout_s
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layout: KVLayout | None = None
        self._layers: list[torch.nn.Module] = []
        self._attn: list[Any] = []  # each decoder layer's vLLM Attention module (its layer_name, impl)
        self._embed: Any = None
        self._rope: _Rope | None = None

    def bind(self, kv_caches: dict[str, torch.Tensor], layout: KVLayout) -> None:
        """Take vLLM's paged KV and find the model's layers (at ``register_kv_caches``, after the model loaded).

        Raises:
            UcmConfigError: no model was captured, the model's layers do not fit the blend (see the module
                docstring), the layout is not a CPU layout, or ``compute_meta`` names no attention layer of it.
        """
        if layout not in CPU_LAYOUTS:
            raise UcmConfigError(
                f"ucm_sparse_config.Blend runs on vLLM's CPU backend only in this version; the KV layout here is "
                f"{layout.value!r}, allowed: {[lay.value for lay in CPU_LAYOUTS]}"
            )
        model = loaded_model()
        if model is None:
            raise UcmConfigError(
                "ucm_sparse_config.Blend: UCM did not see the model load (its vllm.general_plugins entry point "
                "'ucm_sparse' wraps vLLM's model loader): keep 'ucm_sparse' in VLLM_PLUGINS if set"
            )
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None:
            raise UcmConfigError(
                f"ucm_sparse_config.Blend: model {type(model).__name__} has no .model.layers; supported: decoder-only "
                "models built like vLLM's Llama (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, ...)"
            )
        start, end = getattr(inner, "start_layer", 0), getattr(inner, "end_layer", len(layers))
        self._layers = list(layers[start:end])
        names = set(self._spec.layer_names)
        self._attn = []
        for i, layer in enumerate(self._layers):
            attn: Any = next((m for m in layer.modules() if getattr(m, "layer_name", None) in names), None)
            params = list(inspect.signature(layer.forward).parameters)
            if attn is None or params[:3] != ["positions", "hidden_states", "residual"]:
                raise UcmConfigError(
                    f"ucm_sparse_config.Blend: decoder layer {i} of {type(model).__name__} is not called as "
                    "layer(positions, hidden_states, residual) with one attention layer; supported: models built "
                    "like vLLM's Llama"
                )
            self._attn.append(attn)
        check = next(iter(self._cfg.compute_meta))
        attn_names = [a.layer_name for a in self._attn]
        if check not in attn_names:
            raise UcmConfigError(
                f"ucm_sparse_config.Blend.compute_meta names {check!r}, not an attention layer of this model; allowed: "
                f"{attn_names[0]!r} .. {attn_names[-1]!r}"
            )
        rotary = getattr(getattr(self._layers[0], "self_attn", None), "rotary_emb", None)
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        if type(rotary) is not RotaryEmbedding:
            raise UcmConfigError(
                f"ucm_sparse_config.Blend: the model's rotary embedding is {type(rotary).__name__}; allowed: "
                "RotaryEmbedding (plain RoPE: a chunk's keys are moved by rotating them)"
            )
        self._rope = _Rope(int(rotary.rotary_dim), float(rotary.base), bool(rotary.is_neox_style))
        self._embed = getattr(inner, "embed_input_ids", None) or inner.get_input_embeddings
        self._kv_caches = {a.layer_name: kv_caches[a.layer_name] for a in self._attn}
        self._layout = layout

    def blend(self, t: BlendTransfer) -> None:
        """Fill tokens ``[t.start, t.end)`` of request ``t.req_id`` into its blocks of the paged KV (see the module
        docstring); logs one info line.

        Raises:
            Exception: whatever fails (the caller reports the run's blocks as failed loads).
        """
        t0 = time.perf_counter()
        spec, bs = self._spec, self._spec.block_size
        start, end = t.start, t.end
        n = end - start
        num_layers = len(self._layers)
        kv = torch.zeros((num_layers, 2, n, spec.num_kv_heads, spec.head_dim), dtype=spec.dtype)
        stored = torch.zeros(n, dtype=torch.bool)
        reused = computed = 0
        for s, e in t.spans:
            if e <= start:
                continue
            chunk, was_computed = self._chunk_kv(t.seed, t.token_ids[s:e])
            computed += was_computed
            lo, hi = max(start, s), min(e, s + chunk.shape[2])
            if hi <= lo:
                continue
            part = chunk[:, :, lo - s : hi - s].contiguous()
            if s:  # keys cached at chunk positions 0.. move to s..: rotate them by s
                keys = part[:, 0].reshape(-1, spec.num_kv_heads, spec.head_dim)  # a copy: part[:, 0] is strided
                assert self._rope is not None
                rope_delta_(
                    keys,
                    torch.full((keys.shape[0],), s, dtype=torch.int64),
                    rotary_dim=self._rope.rotary_dim,
                    base=self._rope.base,
                    neox=self._rope.neox,
                )
                part[:, 0] = keys.view(part[:, 0].shape)
            kv[:, :, lo - start : hi - start] = part
            stored[lo - start : hi - start] = True
            reused += hi - lo
        t1 = time.perf_counter()
        prefix_kv = self._prefix_kv(t.block_ids, start)
        chosen = self._run_layers(t.token_ids[start:end], torch.arange(start, end), prefix_kv, kv, stored)
        positions = torch.arange(start, end)
        ids = torch.tensor(t.block_ids, dtype=torch.int64)
        slots = ids[positions // bs] * bs + positions % bs
        for i, attn in enumerate(self._attn):
            attn.impl.do_kv_cache_update(attn, kv[i, 0], kv[i, 1], self._kv_caches[attn.layer_name], slots)
        logger.info(
            "request_id: %s, blend of tokens %d-%d: %d chunks, %d tokens from stored chunks (%d chunks computed and "
            "stored), %d recomputed after %s (ratio %.2f); chunks %.0f ms, pass %.0f ms",
            t.req_id,
            start,
            end,
            sum(1 for _, e in t.spans if e > start),
            reused,
            computed,
            chosen,
            next(iter(self._cfg.compute_meta)),
            self._cfg.ratio,
            (t1 - t0) * 1e3,
            (time.perf_counter() - t1) * 1e3,
        )

    def _chunk_kv(self, seed: bytes, tokens: list[int]) -> tuple[torch.Tensor, bool]:
        """A chunk's stored KV, keys at chunk positions ``0..``: ``[num_layers, 2, m, num_kv_heads, head_dim]`` for
        its first ``m`` tokens, and whether it was computed here (and stored) rather than loaded. ``m``: the tokens of
        its leading stored blocks, or all its tokens when computed."""
        spec, bs = self._spec, self._spec.block_size
        keys = rank_keys(block_keys(seed, tokens, bs), 0, 1)
        found = self._store.lookup(keys) if keys else 0
        if found < len(keys) and self._cfg.store_chunks:
            kv = torch.zeros((len(self._layers), 2, len(tokens), spec.num_kv_heads, spec.head_dim), dtype=spec.dtype)
            self._run_layers(tokens, torch.arange(len(tokens)), None, kv, torch.zeros(len(tokens), dtype=torch.bool))
            missing = keys[found:]
            blocks = kv[:, :, found * bs : len(keys) * bs].unflatten(2, (len(missing), bs)).permute(2, 0, 1, 3, 4, 5)
            rows = blocks.contiguous().view(torch.uint8).view(len(missing), -1)
            result = self._store.dump(missing, rows).result(self._timeout_s)
            if result.failed:
                logger.warning("blend: %d of %d chunk blocks failed to store", len(result.failed), len(missing))
            return kv, True
        if not found:
            return torch.empty((len(self._layers), 2, 0, spec.num_kv_heads, spec.head_dim), dtype=spec.dtype), False
        staging = torch.empty((found, len(self._layers), 2, bs, spec.num_kv_heads, spec.head_dim), dtype=spec.dtype)
        result = self._store.load(keys[:found], staging.view(torch.uint8).view(found, -1)).result(self._timeout_s)
        if result.failed:  # a damaged or vanished block: the chunk's stored KV ends before it
            found = min(result.failed)
        return staging[:found].permute(1, 2, 0, 3, 4, 5).reshape(
            len(self._layers), 2, found * bs, spec.num_kv_heads, spec.head_dim
        ), False

    def _prefix_kv(self, block_ids: list[int], start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, ``(K, V)`` of the request's first ``start`` tokens, read from the paged KV: ``[start,
        num_kv_heads, head_dim]`` each."""
        assert self._layout is not None
        bs = self._spec.block_size
        nb = -(-start // bs)
        ids = torch.tensor(block_ids[:nb], dtype=torch.int64)
        out = []
        for attn in self._attn:
            k, v = cpu_attn_kv_views(self._kv_caches[attn.layer_name], self._layout)
            shape = (nb * bs, self._spec.num_kv_heads, self._spec.head_dim)
            out.append((k[ids].reshape(shape)[:start], v[ids].reshape(shape)[:start]))
        return out

    def _run_layers(
        self,
        tokens: list[int],
        positions: torch.Tensor,
        prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] | None,
        kv: torch.Tensor,
        stored: torch.Tensor,
    ) -> int:
        """Run ``tokens`` at ``positions`` through the model's decoder layers over ``prefix_kv`` (None: no prefix),
        recomputing every token up to the check layer and the chosen ones after it (all when none is ``stored``);
        ``kv`` (``[num_layers, 2, T, num_kv_heads, head_dim]``) holds the stored KV on entry and the run's KV on
        return. Returns the tokens recomputed after the check layer."""
        from vllm.forward_context import set_forward_context

        spec = self._spec
        empty = torch.empty((0, spec.num_kv_heads, spec.head_dim), dtype=spec.dtype)
        first = positions[0].item() if positions.numel() else 0
        state = BlendPass(
            layer_of={a.layer_name: i for i, a in enumerate(self._attn)},
            prefix_kv=prefix_kv if prefix_kv is not None else [(empty, empty)] * len(self._layers),
            prefix_pos=torch.arange(first if prefix_kv is not None else 0),
            kv=kv,
            stored=stored,
            positions=positions,
            check_layer=self._cfg.check_layer,
            ratio=self._cfg.ratio,
        )
        metadata = {a.layer_name: state for a in self._attn}
        ids = torch.tensor(tokens, dtype=torch.int64)
        # No slot mapping: vLLM's cache writer skips every layer (the run's KV is written once, at the end).
        with torch.inference_mode(), set_forward_context(metadata, self._vllm_config, slot_mapping={}):
            hidden = self._embed(ids)
            residual = None
            for i, layer in enumerate(self._layers):
                hidden, residual = layer(positions[state.rows], hidden, residual)
                if i == self._cfg.check_layer and state.chosen is not None:
                    keep = state.chosen
                    hidden, residual, state.rows = hidden[keep], residual[keep], state.rows[keep]
                    if not keep.numel():
                        break
        return int(state.rows.numel())
