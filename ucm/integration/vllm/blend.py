"""CacheBlend in vLLM: the stored KV of a prompt's chunks reused wherever they appear, with selective recompute.

CacheBlend (Yao et al., "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion",
EuroSys 2025, arXiv 2405.16444). Users end each chunk of the prompt (e.g. each retrieved document) with
``chunk_end_token_id`` and switch it on with ``ucm_sparse_config: {Blend: {...}}`` (``ucm.config.BlendConfig``).

What vLLM is told. vLLM 0.32 computes every prompt token it schedules, through every layer, and offers no hook to
drop tokens from its pass. So CacheBlend runs *before* vLLM's pass, as a KV load: the scheduler side
(:meth:`UCMScheduler.get_num_new_matched_tokens <ucm.integration.vllm.scheduler.UCMScheduler>`) offers, past the
stored prefix, every prompt token but the last as external tokens; vLLM allocates their blocks and schedules only
the last token, and the worker fills the offered tokens' KV in ``start_load_kv`` (:class:`Blender`), after the
step's ordinary prefix loads. vLLM then computes the last token over that KV and samples as usual.

The blend of a run ``[start, end)`` of one request (:meth:`Blender.blend`):

1. Each chunk ``[s, e)`` of the run is looked up under the keys of its own tokens from the request's seed (the
   keys a prompt that begins with the chunk stores its prefix under, so a chunk computed once as a prefix, or as a
   chunk, anywhere, is found again), and its trailing partial block, which prefix caching never stores, under a key
   of its own (``ucm.hashing.partial_block_key``). Found blocks are loaded; a chunk the store lacks is computed on
   its own (positions from 0, through the model's layers) and stored under those keys, its partial block too
   (``store_chunks``). Its keys,
   rotated for positions ``0..``, are re-rotated by ``s`` to their positions in this prompt (the RoPE delta,
   ``ucm.kernels.blend.rope_delta_``). With ``chunk_context: first_chunk`` every later chunk is taken as the
   prompt's first chunk ``[0, h)`` (its head) followed by the chunk: looked up under the keys of those tokens,
   computed after the head (the chunk at positions ``h..``), and re-rotated by ``s - h``; only the blocks from the
   one holding token ``h`` on are loaded.
2. The run's stored KV of the layers after the ``compute_meta`` one (up to it every run token is recomputed) is
   written into the request's slots of vLLM's paged cache with vLLM's own cache writer (so
   every CPU kernel variant's layout, ``vec``, ``vec16`` and ``amx``, is written as vLLM writes it); tokens without
   stored KV (the question's, or a chunk's tail when the chunk was stored as an ordinary prompt's prefix) get zeros
   there, and are always recomputed.
3. The run's tokens go through the model's own decoder layers (vLLM's modules: norms, QKV projection, rotary
   embedding, MLP; called eagerly, the norms through vLLM's fused CPU kernels, ``ucm.integration.vllm.cpu_norms``);
   each layer writes the K and V of the rows it computes into the paged cache and runs vLLM's own
   CPU attention kernel for them (:class:`BlendPass`). Up to the layer named in ``compute_meta`` every run token is
   computed, as one prefill over the prefix; at that layer the tokens whose recomputed K and V deviate most from
   the stored ones (``ratio`` of the tokens with stored KV, ``ucm.kernels.blend``), plus the tokens without stored
   KV, are chosen, and only they go through the later layers, as queries at their positions (each run of
   consecutive chosen tokens one request of vLLM's kernel, :func:`row_requests`); the other
   tokens keep their stored KV there. The run's tokens after the last chunk (the question but its last token) have
   no stored KV, so they are computed through every layer too. The paged cache then holds the run's KV. With
   ``selection: question`` the ``ratio`` is taken by another score, computed before the pass
   (:class:`QuestionProbe`): the prompt's tokens after its last chunk (the question) go through the layers over the
   prompt's naive KV (prefix, stored KV, zeros), and each chunk token scores the attention it receives from them
   over ``question_layers``.

The model's layers are called with a forward context whose attention metadata is this module's
:class:`BlendPass` (or :class:`QuestionProbe`, both :class:`BlendAttention`); UCM's attention wrapper
(``ucm.integration.vllm.sparse_backend``) hands such calls to it, and vLLM's cache writer sees no slot mapping, so
nothing else is written. A chunk computed on its own runs the same
pass over a scratch paged KV of its blocks. ``ratio: 1`` recomputes every token with vLLM's kernel: the full
prefill's KV.

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
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata

from ucm.config import BlendConfig, UcmConfigError, default_question_layers
from ucm.hashing import block_keys, partial_block_key, rank_keys
from ucm.integration.vllm.cpu_norms import cpu_norms
from ucm.integration.vllm.engine_info import KVSpec
from ucm.integration.vllm.metadata import BlendTransfer
from ucm.kernels.blend import kv_deviation, question_attention, rope_delta_, select_recompute
from ucm.kernels.layouts import CPU_LAYOUTS, KVLayout, cpu_attn_kv_views
from ucm.logger import init_logger
from ucm.store.base import UcmKVStoreBase

logger = init_logger(__name__)

_loaded_models: list[weakref.ref[torch.nn.Module]] = []

# The largest buffer a Blender keeps from blend to blend (the run's KV, a chunk's blocks), bytes.
BLEND_BUFFER_BYTES = 256 << 20


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


def cpu_attention_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    isa: str,
) -> CPUAttentionMetadata:
    """vLLM's CPU attention metadata for causal rows of queries over the paged KV, built as vLLM's
    ``CPUAttentionMetadataBuilder.build`` does (no sliding window, no dynamic causal mask).

    Args:
        query_start_loc: int32 ``[R + 1]``; request ``r``'s queries are rows ``query_start_loc[r] ..
            query_start_loc[r + 1]``, the last tokens of its ``seq_lens[r]`` (int32 ``[R]``).
        block_table: int32 ``[R, W]`` vLLM block ids per request.
        num_heads / num_kv_heads / head_dim / dtype: the layer's; isa: the layer's CPU kernel variant (``layer.isa``).
    """
    from ucm.integration.vllm.sparse_backend import cpu_scheduler_metadata  # the wrapper imports this module

    scheduler_metadata = cpu_scheduler_metadata(
        query_start_loc, seq_lens, num_heads, num_kv_heads, head_dim, dtype, isa
    )
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    return CPUAttentionMetadata(
        num_actual_tokens=int(query_start_loc[-1]),
        max_query_len=int(query_lens.max()),
        query_start_loc=query_start_loc,
        max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=torch.empty(0, dtype=torch.int64),  # unused: the pass writes the KV itself
        scheduler_metadata=scheduler_metadata,
        causal=True,
    )


def row_requests(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows at ``positions`` of one sequence, each attending causally to the tokens up to its own position, as
    vLLM attention requests (whose queries are the last tokens of their sequence): one request per run of
    consecutive positions, its queries the run, its sequence ending at the run's last position. A run of ``q`` rows
    is one request instead of ``q`` one-token ones (vLLM's CPU kernel reads a request's KV once per tile of its
    queries, not once per query).

    Args:
        positions: int64 ``[n]``, strictly increasing.

    Returns:
        ``query_start_loc`` int32 ``[R + 1]`` and ``seq_lens`` int32 ``[R]`` (:func:`cpu_attention_metadata`'s),
        ``R`` the number of runs.
    """
    n = positions.shape[0]
    last = torch.ones(n, dtype=torch.bool)  # the last row of each run
    last[:-1] = positions[1:] != positions[:-1] + 1
    ends = last.nonzero().flatten() + 1
    query_start_loc = torch.cat((torch.zeros(1, dtype=torch.int64), ends)).to(torch.int32)
    return query_start_loc, (positions[ends - 1] + 1).to(torch.int32)


class BlendAttention:
    """The attention metadata of CacheBlend's own calls of the model's decoder layers (:class:`BlendPass`,
    :class:`QuestionProbe`): UCM's attention wrapper (``ucm.integration.vllm.sparse_backend``) hands each attention
    layer's call to :meth:`attend` instead of running vLLM's forward."""

    def attend(
        self,
        impl: CPUAttentionBackendImpl,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """One attention layer: ``impl`` the layer's vLLM CPU attention impl, ``layer`` the ``Attention`` module
        (``layer_name``, ``isa``); ``query`` ``[n, num_heads, head_dim]``, ``key`` / ``value`` ``[n, num_kv_heads,
        head_dim]`` (post-RoPE) of the rows the caller computes; ``output`` ``[n, num_heads, head_dim]``, written."""
        raise NotImplementedError


@dataclass
class BlendPass(BlendAttention):
    """The attention metadata of a blend's pass through the model's layers (every attention layer gets this object;
    UCM's attention wrapper calls :meth:`attend` instead of its own forward).

    The run's tokens have slots in a paged KV (vLLM's, or a scratch one for a chunk computed on its own) that holds,
    before the pass, the prefix's KV and, for the layers after the check layer, the run's stored KV. Each layer
    writes its computed rows' K and V there and runs vLLM's own CPU attention kernel over it: all rows as one prefill
    of the run (up to the check layer), then the chosen rows at their positions, each run of consecutive rows one
    request (:func:`row_requests`).

    Attributes:
        layer_of: attention layer name -> decoder layer index.
        caches: attention layer name -> the paged KV the pass reads and writes.
        block_table: int32 ``[1, W]`` the run's request's blocks in ``caches``.
        slots: int64 ``[T]`` the run tokens' slots; positions: int64 ``[T]`` their positions (contiguous).
        kv: ``[num_layers, 2, T, num_kv_heads, head_dim]``: the stored KV (keys at their positions in this prompt)
            where ``stored`` says so on entry; each layer's computed rows are recorded into it.
        stored: bool ``[T]``: which run tokens have stored KV (the others are always recomputed).
        check_layer / ratio: where and how many tokens are chosen (``compute_meta``).
        scores: float32 ``[T]`` or None: the rows' scores for ``selection: question`` (:class:`QuestionProbe`);
            None: the deviation at ``check_layer`` ranks them.
        rows: int64 the run rows the layers compute now (all, then the chosen ones after ``check_layer``).
        chosen: set by :meth:`attend` at ``check_layer``: the rows recomputed from then on, sorted: the ``ratio`` of
            the stored rows of highest score (by default, whose K and V deviate most from the stored ones), and
            every row without stored KV.
    """

    layer_of: dict[str, int]
    caches: dict[str, torch.Tensor]
    block_table: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    kv: torch.Tensor
    stored: torch.Tensor
    check_layer: int
    ratio: float
    scores: torch.Tensor | None = None
    rows: torch.Tensor = field(init=False)
    chosen: torch.Tensor | None = None
    _metadata: CPUAttentionMetadata | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.rows = torch.arange(self.positions.shape[0])

    def select(self, rows: torch.Tensor) -> None:
        """Compute only ``rows`` (run row indices) from the next layer on."""
        self.rows = rows
        self._metadata = None

    def attend(
        self,
        impl: CPUAttentionBackendImpl,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """One attention layer of the pass: choose the rows to recompute at the check layer, write the computed rows'
        K and V into the paged KV (and record them), and run vLLM's kernel for the rows into ``output``.

        Args:
            impl: the layer's vLLM CPU attention impl; layer: the ``Attention`` module (``layer_name``, ``isa``).
            query: ``[n, num_heads, head_dim]``, key / value ``[n, num_kv_heads, head_dim]``: the rows ``rows`` of
                the run (post-RoPE); output: ``[n, num_heads, head_dim]``, written.
        """
        i = self.layer_of[layer.layer_name]
        n = self.rows.shape[0]
        k_new, v_new = key.view(n, *self.kv.shape[3:]), value.view(n, *self.kv.shape[3:])
        if i == self.check_layer:  # every row is computed here: rank the stored ones, keep the others
            have = self.stored.nonzero().flatten()
            if self.scores is None:
                score = kv_deviation(k_new[have], v_new[have], self.kv[i, 0, have], self.kv[i, 1, have])
            else:
                score = self.scores[have]
            picked = have[select_recompute(score, self.ratio)]
            self.chosen = torch.cat((picked, (~self.stored).nonzero().flatten())).sort().values
        self.kv[i, 0, self.rows] = k_new
        self.kv[i, 1, self.rows] = v_new
        cache = self.caches[layer.layer_name]
        impl.do_kv_cache_update(layer, k_new, v_new, cache, self.slots[self.rows])
        if self._metadata is None:
            self._metadata = self._rows_metadata(impl, query.dtype, layer.isa)
        CPUAttentionBackendImpl.forward(impl, layer, query, k_new, v_new, cache, self._metadata, output)

    def _rows_metadata(self, impl: CPUAttentionBackendImpl, dtype: torch.dtype, isa: str) -> CPUAttentionMetadata:
        """The rows computed now as vLLM requests over the run's blocks (:func:`row_requests`): all run rows are one
        request whose last ``T`` tokens are the queries."""
        query_start_loc, seq_lens = row_requests(self.positions[self.rows])
        table = self.block_table.expand(seq_lens.shape[0], -1).contiguous()
        return cpu_attention_metadata(
            query_start_loc,
            seq_lens,
            table,
            num_heads=impl.num_heads,
            num_kv_heads=impl.num_kv_heads,
            head_dim=impl.head_size,
            dtype=dtype,
            isa=isa,
        )


@dataclass
class QuestionProbe(BlendAttention):
    """The attention metadata of ``selection: question``'s probe: the prompt's tokens after its last chunk (the
    question) go through the model's layers over the naive KV of the prompt (the prefix from the paged KV, the
    chunks' stored KV, zeros where none is stored), each layer attending with
    :func:`ucm.kernels.blend.question_attention` (torch, float32 softmax), and the attention each chunk token
    receives is summed over the heads, the question's tokens and the layers ``layers``. Nothing is written to the
    paged KV.

    Attributes:
        layer_of: attention layer name -> decoder layer index.
        caches: attention layer name -> vLLM's paged KV (read: the prefix); layout: its CPU layout.
        prefix_blocks: int64 vLLM block ids holding tokens ``[0, start)``; start: the run's first token.
        kv: ``[num_layers, 2, T, num_kv_heads, head_dim]`` the stored KV of the run's tokens up to the last chunk's
            end (zeros where none), keys at their positions in this prompt; the question follows them.
        layers: the decoder layers whose attention is summed.
        received: float32 ``[start + T]``: per prompt token up to the run's end, the attention summed so far.
    """

    layer_of: dict[str, int]
    caches: dict[str, torch.Tensor]
    layout: KVLayout
    prefix_blocks: torch.Tensor
    start: int
    kv: torch.Tensor
    layers: range
    received: torch.Tensor = field(init=False)
    _heads: torch.Tensor | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.received = torch.zeros(self.start + self.kv.shape[2], dtype=torch.float32)

    def attend(
        self,
        impl: CPUAttentionBackendImpl,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """One layer of the probe: the question's rows (``query`` ``[m, num_heads, head_dim]``, ``key`` / ``value``
        ``[m, num_kv_heads, head_dim]``, post-RoPE) attend to the prompt's naive KV and to each other (causal);
        the result goes into ``output`` (``[m, num_heads, head_dim]``)."""
        i = self.layer_of[layer.layer_name]
        shape = self.kv.shape[3:]
        end = self.start + self.kv.shape[2]
        # The prompt's naive K and V, float32 head-major [2, num_kv_heads, S, head_dim]: the attention reads them
        # as they are (one copy of each source, converted on the way); one buffer for every layer.
        size = (2, shape[0], end + key.shape[0], shape[1])
        if self._heads is None or self._heads.shape != size:
            self._heads = torch.empty(size, dtype=torch.float32)
        heads = self._heads
        pages = cpu_attn_kv_views(self.caches[layer.layer_name], self.layout)
        for j, new in enumerate((key, value)):
            heads[j, :, : self.start] = pages[j][self.prefix_blocks].reshape(-1, *shape)[: self.start].transpose(0, 1)
            heads[j, :, self.start : end] = self.kv[i, j].transpose(0, 1)
            heads[j, :, end:] = new.view(-1, *shape).transpose(0, 1)
        keys, values = heads.transpose(1, 2)  # [S, num_kv_heads, head_dim] views
        out, received = question_attention(query.float(), keys, values, scale=float(impl.scale))
        output.copy_(out)  # rounded to the model's dtype
        if i in self.layers:
            self.received += received[: self.received.shape[0]]


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
        self._question_layers = range(0)
        self._layer_of: dict[str, int] = {}  # attention layer name -> decoder layer index
        self._buffers: dict[str, torch.Tensor] = {}  # kept from blend to blend (see _kept)

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
        self._layer_of = {a.layer_name: i for i, a in enumerate(self._attn)}
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
        num_layers = len(self._layers)
        lo, hi = self._cfg.question_layers or default_question_layers(num_layers)
        if hi > num_layers:
            raise UcmConfigError(
                f"ucm_sparse_config.Blend.question_layers {self._cfg.question_layers} ends past the model's "
                f"{num_layers} layers; allowed: [first, end) with 0 <= first < end <= {num_layers}"
            )
        self._question_layers = range(lo, hi)
        self._embed = getattr(inner, "embed_input_ids", None) or inner.get_input_embeddings
        self._kv_caches = {a.layer_name: kv_caches[a.layer_name] for a in self._attn}
        self._layout = layout
        logger.info(
            "CacheBlend on: chunks end with token id %d; tokens chosen at %s, ratio %.2f, %s; chunks the store lacks "
            "are %s",
            self._cfg.chunk_end_token_id,
            check,
            self._cfg.ratio,
            self._selection_text(),
            "computed on their own and stored" if self._cfg.store_chunks else "recomputed in place, not stored",
        )
        if self._cfg.chunk_context == "first_chunk":
            logger.info("CacheBlend: each chunk's KV is computed and looked up after the prompt's first chunk")

    def _selection_text(self) -> str:
        if self._cfg.selection == "deviation":
            return "by KV deviation"
        layers = self._question_layers
        return f"by the question's attention over layers {layers.start}-{layers.stop - 1}"

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
        kv = self._kept("kv", (num_layers, 2, n, spec.num_kv_heads, spec.head_dim))
        stored = torch.zeros(n, dtype=torch.bool)
        reused = computed = 0
        # With chunk_context 'first_chunk', each later chunk's KV is that of the head (the first chunk) followed by
        # the chunk: its tokens were at positions head.. there.
        head = t.spans[0][1] if self._cfg.chunk_context == "first_chunk" and t.spans else 0
        for s, e in t.spans:
            if e <= start:
                continue
            ctx = head if s >= head else 0
            chunk, was_computed = self._chunk_kv(t.seed, t.token_ids[:ctx] + t.token_ids[s:e], ctx, s - ctx)
            computed += was_computed
            lo, hi = max(start, s), min(e, s + chunk.shape[2])
            if hi <= lo:
                continue
            kv[:, :, lo - start : hi - start] = chunk[:, :, lo - s : hi - s].transpose(0, 1)
            stored[lo - start : hi - start] = True
            reused += hi - lo
        kv[:, :, ~stored] = 0  # no stored KV: zeros (the probe reads them; the pass recomputes those tokens)
        t1 = time.perf_counter()
        positions = torch.arange(start, end)
        ids = torch.tensor(t.block_ids, dtype=torch.int64)
        slots = ids[positions // bs] * bs + positions % bs
        # The stored KV in place for the layers after the check layer (up to it, the pass computes and writes every
        # run token); the pass then overwrites the rows it computes.
        first = self._cfg.check_layer + 1
        for i, attn in enumerate(self._attn[first:], start=first):
            attn.impl.do_kv_cache_update(attn, kv[i, 0], kv[i, 1], self._kv_caches[attn.layer_name], slots)
        table = ids.to(torch.int32)[None, :]
        scores = None
        if self._cfg.selection == "question" and t.query_ids and stored.any():
            chunks_end = min(t.spans[-1][1], end)  # the question's tokens follow; the probe computes them itself
            scores = torch.zeros(n, dtype=torch.float32)  # past the chunks: no stored KV, always recomputed
            scores[: chunks_end - start] = self._question_scores(
                t.query_ids, ids[: -(-start // bs)], start, kv[:, :, : chunks_end - start]
            )
        rows = self._run_layers(t.token_ids[start:end], positions, self._kv_caches, table, slots, kv, stored, scores)
        logger.info(
            "request_id: %s, blend of tokens %d-%d: %d chunks, %d tokens with their chunk's own KV (%d chunks were "
            "not stored: computed on their own and stored now), %d recomputed after %s (ratio %.2f, %s); chunks "
            "%.0f ms, pass %.0f ms",
            t.req_id,
            start,
            end,
            sum(1 for _, e in t.spans if e > start),
            reused,
            computed,
            rows.numel(),
            next(iter(self._cfg.compute_meta)),
            self._cfg.ratio,
            "by KV deviation" if scores is None else "by the question's attention",
            (t1 - t0) * 1e3,
            (time.perf_counter() - t1) * 1e3,
        )
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request_id: %s, blend recomputed positions: %s", t.req_id, (rows + start).tolist())

    def _kept(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """An uninitialized tensor of ``shape`` in the KV dtype: a view of buffer ``name``, kept from blend to blend
        (grown as needed), when it takes at most :data:`BLEND_BUFFER_BYTES`; else a fresh tensor, not kept. Memory
        freed and allocated again is slow to touch the first time (glibc returns large blocks to the kernel, and a
        virtual machine's kernel may hand free pages back to its host), so the blend keeps the buffers it fills on
        every request: the run's KV (``"kv"``), a chunk's loaded blocks (``"staging"``) and its K/V planes
        (``"chunk"``). Blends run one at a time, and each view is used up before its name is asked for again."""
        numel = math.prod(shape)
        dtype = self._spec.dtype
        if numel * dtype.itemsize > BLEND_BUFFER_BYTES:
            return torch.empty(shape, dtype=dtype)
        kept = self._buffers.get(name)
        if kept is None or kept.numel() < numel:
            kept = self._buffers[name] = torch.empty(numel, dtype=dtype)
        return kept[:numel].view(shape)

    def _question_scores(
        self, query_ids: list[int], prefix_blocks: torch.Tensor, start: int, kv: torch.Tensor
    ) -> torch.Tensor:
        """``selection: question``: the attention each token ``start .. start + T`` receives from ``query_ids`` (the
        prompt's tokens after its last chunk, at the positions after token ``start + T``, the last chunk's end) over
        the prompt's naive KV, summed over the heads, the question's tokens and ``question_layers``
        (:class:`QuestionProbe`): float32 ``[T]``. ``prefix_blocks``: int64 the vLLM blocks of tokens ``[0,
        start)``; ``kv``: the stored KV of those ``T`` tokens (``[num_layers, 2, T, num_kv_heads, head_dim]``, zeros
        where none)."""
        assert self._layout is not None
        probe = QuestionProbe(
            layer_of=self._layer_of,
            caches=self._kv_caches,
            layout=self._layout,
            prefix_blocks=prefix_blocks,
            start=start,
            kv=kv,
            layers=self._question_layers,
        )
        end = start + kv.shape[2]
        positions = torch.arange(end, end + len(query_ids))
        ids = torch.tensor(query_ids, dtype=torch.int64)
        with (
            torch.inference_mode(),
            cpu_norms(),
            set_forward_context({a.layer_name: probe for a in self._attn}, self._vllm_config, slot_mapping={}),
        ):
            hidden = self._embed(ids)
            residual = None
            for layer in self._layers[: self._question_layers.stop]:
                hidden, residual = layer(positions, hidden, residual)
        return probe.received[start:]

    def _chunk_kv(self, seed: bytes, tokens: list[int], skip: int, shift: int) -> tuple[torch.Tensor, bool]:
        """The stored KV of ``tokens`` (a chunk, after ``skip`` tokens of context: the prompt's head, or none) from
        token ``skip`` on, keys moved ``shift`` positions on (RoPE delta, ``ucm.kernels.blend.rope_delta_``): ``[2,
        num_layers, m, num_kv_heads, head_dim]`` (K, then V; a view) for tokens ``skip .. skip + m``, and whether it
        was computed here (and stored) rather than loaded.

        The chunk's blocks are keyed as a prompt of ``tokens`` keys its prefix (``ucm.hashing.block_keys``), and
        its trailing partial block, which prefix caching never stores, under ``ucm.hashing.partial_block_key``.
        ``m`` runs to the end of the leading stored blocks (0 if they end before ``skip``; the whole chunk when its
        partial block is stored too, or when computed). A chunk with a full block missing, or with no full block
        and no stored partial one, is computed on its own and stored (``store_chunks``); one whose full blocks are
        all stored but not its tail (stored as an ordinary prompt's prefix) is loaded as it is, and its tail is
        recomputed in place. Only the blocks from the one holding token ``skip`` on are loaded."""
        spec, bs = self._spec, self._spec.block_size
        layers = len(self._layers)
        full = block_keys(seed, tokens, bs)
        tail = len(tokens) - len(full) * bs
        keys = rank_keys(full + ([partial_block_key(full[-1] if full else seed, tokens[-tail:])] if tail else []), 0, 1)
        found = self._store.lookup(keys) if keys else 0
        if found < len(keys) and (found < len(full) or not full) and self._cfg.store_chunks:
            n, nb = len(tokens), len(keys)
            kv = torch.zeros((layers, 2, nb * bs, spec.num_kv_heads, spec.head_dim), dtype=spec.dtype)
            scratch = {  # a scratch paged KV of the chunk's blocks, in the layers' layout
                name: torch.zeros((nb, spec.num_kv_heads, bs, 2 * spec.head_dim), dtype=spec.dtype)
                for name in self._kv_caches
            }
            table = torch.arange(nb, dtype=torch.int32)[None, :]
            slots = torch.arange(n)
            computed = kv[:, :, :n]  # the tail block's padding stays zeros
            self._run_layers(tokens, torch.arange(n), scratch, table, slots, computed, torch.zeros(n, dtype=torch.bool))
            missing = keys[found:]
            blocks = kv[:, :, found * bs :].unflatten(2, (len(missing), bs)).permute(2, 0, 1, 3, 4, 5)
            rows = blocks.contiguous().view(torch.uint8).view(len(missing), -1)
            result = self._store.dump(missing, rows).result(self._timeout_s)
            if result.failed:
                logger.warning("blend: %d of %d chunk blocks failed to store", len(result.failed), len(missing))
            chunk, first, was_computed = kv.transpose(0, 1).contiguous(), 0, True
            valid = n
        else:
            first = skip // bs  # the block holding token `skip`: the head's earlier blocks are not needed
            n = max(found - first, 0)
            staging = self._kept("staging", (n, layers, 2, bs, spec.num_kv_heads, spec.head_dim))
            if n:
                load = self._store.load(keys[first:found], staging.view(torch.uint8).view(n, -1))
                try:
                    result = load.result(self._timeout_s)
                except BaseException:  # a load still under way may write into the buffer later: never reuse it
                    self._buffers.pop("staging", None)
                    raise
                if result.failed:  # a damaged or vanished block: the chunk's stored KV ends before it
                    n = min(result.failed)
            # blocks [n, L, 2, bs, ...] -> [2, L, n * bs, ...]: one copy
            chunk = self._kept("chunk", (2, layers, n * bs, spec.num_kv_heads, spec.head_dim))
            chunk.view(2, layers, n, bs, spec.num_kv_heads, spec.head_dim).copy_(staging[:n].permute(2, 1, 0, 3, 4, 5))
            was_computed = False
            valid = min(n * bs, len(tokens) - first * bs)  # a loaded partial block: its tokens, not its padding
        if shift and chunk.shape[2]:  # every layer's keys at once: one [layers * tokens, heads, head_dim] view
            assert self._rope is not None
            keys_view = chunk[0].view(-1, spec.num_kv_heads, spec.head_dim)
            rope_delta_(
                keys_view,
                torch.full((keys_view.shape[0],), shift, dtype=torch.int64),
                rotary_dim=self._rope.rotary_dim,
                base=self._rope.base,
                neox=self._rope.neox,
            )
        return chunk[:, :, skip - first * bs : valid], was_computed

    def _run_layers(
        self,
        tokens: list[int],
        positions: torch.Tensor,
        caches: dict[str, torch.Tensor],
        block_table: torch.Tensor,
        slots: torch.Tensor,
        kv: torch.Tensor,
        stored: torch.Tensor,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``tokens`` at ``positions`` (contiguous) through the model's decoder layers over the paged KV
        ``caches`` (see :class:`BlendPass`: the tokens' ``slots`` of the request whose blocks are ``block_table``;
        the KV before them and, after the check layer, the run's stored KV already there), recomputing every token up
        to the check layer and the chosen ones after it (all when none is ``stored``; chosen by ``scores``, float32
        ``[T]``, when given, else by KV deviation); ``kv`` (``[num_layers, 2, T, num_kv_heads, head_dim]``) holds the
        stored KV on entry and the run's KV on return, as ``caches`` do. Returns the rows (int64, sorted) recomputed
        after the check layer."""
        state = BlendPass(
            layer_of=self._layer_of,
            caches=caches,
            block_table=block_table,
            slots=slots,
            positions=positions,
            kv=kv,
            stored=stored,
            check_layer=self._cfg.check_layer,
            ratio=self._cfg.ratio,
            scores=scores,
        )
        metadata = {a.layer_name: state for a in self._attn}
        ids = torch.tensor(tokens, dtype=torch.int64)
        # No slot mapping: vLLM's cache writer skips every layer (the pass writes the KV itself).
        with torch.inference_mode(), cpu_norms(), set_forward_context(metadata, self._vllm_config, slot_mapping={}):
            hidden = self._embed(ids)
            residual = None
            for i, layer in enumerate(self._layers):
                hidden, residual = layer(positions[state.rows], hidden, residual)
                if i == self._cfg.check_layer and state.chosen is not None:
                    keep = state.chosen
                    hidden, residual = hidden[keep], residual[keep]
                    state.select(state.rows[keep])
                    if not keep.numel():
                        break
        return state.rows
