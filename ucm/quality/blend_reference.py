"""A pure-torch reference of CacheBlend's blend (``ucm.integration.vllm.blend``) on a Hugging Face Llama checkpoint,
to compare rules for choosing the tokens to recompute without an engine.

The blend follows the engine's steps on one prompt whose chunks end with ``chunk_end_id``: the prompt's stored
prefix (whole blocks of its first chunk, or with ``chunk_context="first_chunk"`` of its head and first document) is
exact; every later chunk's KV comes from a chunk store (computed on its own, or after the head, from position 0,
kept whole: the engine stores a chunk's trailing partial block too) with its keys rotated to the chunk's positions
(``ucm.kernels.blend.rope_delta_``); the run's tokens go through the decoder layers, and at each stage of the rule
the computed rows are narrowed to the chosen ones (plus the rows without stored KV, always recomputed), the other
rows keeping their stored KV from the next layer on. KV here is one contiguous tensor per prompt and attention is
torch's ``scaled_dot_product_attention`` in float32, not vLLM's paged cache and kernels, so it is not bit-exact with
the engine (``benchmarks/RESULTS.md`` compares their answers).

Rules (:class:`Rule`):

- ``deviation``: the engine's (CacheBlend's, Yao et al., EuroSys 2025, arXiv 2405.16444): every token is
  computed up to ``layer``; there the ``ratio`` of the stored tokens whose K and V deviate most from the stored ones
  (``ucm.kernels.blend.kv_deviation``) go on.
- ``progressive``: CacheBlend's gradual filtering (same paper): ``stages`` of (layer, ratio) with growing
  layers and shrinking ratios; at each stage the rows still computed are ranked by their deviation at that layer.
- ``oracle``: at ``layer``, the ``ratio`` of the stored tokens whose stored KV deviates most from the full
  prefill's, summed over the later layers. It needs the full prefill, so no engine can use it: it bounds what any
  rule choosing that many tokens at that layer can reach.
- ``question``: before the pass, the prompt's tokens after the context (the question) go through every layer over
  the naive KV (the exact prefix, the stored KV, zeros where none is stored); the ``ratio`` of the stored tokens
  that receive the most attention from them, summed over the heads, the question's tokens and the layers
  ``score_layers`` (default: every layer after the first quarter, ``ucm.config.default_question_layers``), are
  recomputed from ``layer`` on (``ucm.kernels.blend.question_attention``). It follows the observation that the
  attention of a prompt's last tokens predicts which earlier tokens matter (SnapKV, Li et al., NeurIPS 2024, arXiv
  2404.14469), here used to choose what to recompute.

Ratios count the stored tokens of the run, rounded up as the engine does (``ucm.kernels.blend.recompute_count``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ucm.config import ChunkContext, default_question_layers
from ucm.kernels.blend import kv_deviation, question_attention, recompute_count, rope_delta_

RuleKind = Literal["deviation", "progressive", "oracle", "question"]
RULE_KINDS: tuple[RuleKind, ...] = ("deviation", "progressive", "oracle", "question")


@dataclass(frozen=True)
class Rule:
    """How the blend chooses the tokens to recompute.

    Attributes:
        kind: ``deviation``, ``progressive``, ``oracle`` or ``question`` (module docstring).
        stages: (decoder layer index, ratio) pairs, layers increasing, ratios in [0, 1] not increasing; one pair
            except for ``progressive``.
        score_layers: ``question`` only: the layers ``[lo, hi)`` whose attention is summed (None:
            ``ucm.config.default_question_layers``).
    """

    kind: RuleKind
    stages: tuple[tuple[int, float], ...] = field(default=((1, 0.15),))
    score_layers: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ValueError(f"rule kind {self.kind!r} is not one of {list(RULE_KINDS)}")
        if not self.stages:
            raise ValueError(f"rule {self.kind!r} has no stage; give (layer, ratio) pairs")
        if self.kind != "progressive" and len(self.stages) != 1:
            raise ValueError(f"rule {self.kind!r} takes one (layer, ratio) stage, got {list(self.stages)}")
        layers = [layer for layer, _ in self.stages]
        ratios = [ratio for _, ratio in self.stages]
        if any(layer < 0 for layer in layers) or layers != sorted(set(layers)):
            raise ValueError(f"rule {self.kind!r}: stage layers {layers} must be >= 0 and increasing")
        if any(not 0.0 <= r <= 1.0 for r in ratios) or ratios != sorted(ratios, reverse=True):
            raise ValueError(f"rule {self.kind!r}: stage ratios {ratios} must be in [0, 1] and not increasing")
        if self.score_layers is not None:
            lo, hi = self.score_layers
            if self.kind != "question":
                raise ValueError(f"rule {self.kind!r}: score layers {list(self.score_layers)} are for 'question' only")
            if not 0 <= lo < hi:
                raise ValueError(
                    f"rule {self.kind!r}: score layers {list(self.score_layers)} must be [lo:hi) with 0 <= lo < hi"
                )

    @property
    def name(self) -> str:
        """``deviation@1:0.15``, ``progressive@1:0.4,2:0.3``, ``oracle@1:0.15``, ``question[15:30]@1:0.15``."""
        kind = self.kind if self.score_layers is None else f"{self.kind}[{self.score_layers[0]}:{self.score_layers[1]}]"
        return f"{kind}@" + ",".join(f"{layer}:{ratio:g}" for layer, ratio in self.stages)

    def question_layers(self, num_layers: int) -> range:
        """The layers whose attention the ``question`` rule sums, in a model of ``num_layers`` layers."""
        lo, hi = self.score_layers or default_question_layers(num_layers)
        return range(lo, min(hi, num_layers))


def parse_rule(text: str) -> Rule:
    """A :class:`Rule` from its :attr:`Rule.name` form, ``kind[lo:hi]@layer:ratio[,layer:ratio...]`` (``[lo:hi]``:
    ``question``'s score layers, optional).

    Raises:
        ValueError: not of that form, or the rule is invalid (:class:`Rule`).
    """
    kind, sep, stages_text = text.partition("@")
    score_layers = None
    try:
        if not sep:
            raise ValueError
        if kind.endswith("]") and "[" in kind:
            kind, _, bounds = kind[:-1].partition("[")
            lo, hi = bounds.split(":")
            score_layers = (int(lo), int(hi))
        stages = tuple((int(a), float(b)) for a, b in (s.split(":") for s in stages_text.split(",")))
    except ValueError:
        raise ValueError(
            f"rule {text!r} is not kind[lo:hi]@layer:ratio[,layer:ratio...] (e.g. deviation@1:0.15, "
            f"question[15:30]@1:0.15), kinds: {list(RULE_KINDS)}"
        ) from None
    return Rule(kind, stages, score_layers)  # type: ignore[arg-type]  # Rule checks the kind


class ReferenceModel:
    """A Hugging Face Llama-like checkpoint (plain RoPE) run layer by layer in float32 over a contiguous KV.

    KV tensors are ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` float32 (keys rotated for positions
    ``0..num_tokens-1``).

    Raises:
        ValueError: the checkpoint's RoPE is not the default (plain) one.
    """

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_grad_enabled(False)
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        config = model.config
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"{model_dir}: rope_type {rope.get('rope_type')!r}; allowed: 'default' (plain RoPE)")
        self.model = model
        self.layers = list(model.model.layers)
        self.num_layers = len(self.layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.rope_base = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))

    def rotate_(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (``[n, heads, head_dim]``) by RoPE at positions ``delta`` (int64 ``[n]``), in place."""
        return rope_delta_(x, delta, rotary_dim=self.head_dim, base=self.rope_base, neox=True)

    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.model.model.embed_tokens(torch.tensor(ids, dtype=torch.int64))

    def qkv(self, i: int, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer ``i``'s rotated query ``[n, num_heads, head_dim]``, key and value ``[n, num_kv_heads, head_dim]``."""
        attn, x = self.layers[i].self_attn, self.layers[i].input_layernorm(hidden)
        q = attn.q_proj(x).view(-1, self.num_heads, self.head_dim).contiguous()
        k = attn.k_proj(x).view(-1, self.num_kv_heads, self.head_dim).contiguous()
        v = attn.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        return self.rotate_(q, positions), self.rotate_(k, positions), v

    def finish(
        self, i: int, hidden: torch.Tensor, q: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``i``'s attention of ``q`` (at ``positions``) over the keys ``kv`` (``[2, S, num_kv_heads,
        head_dim]``, token ``j`` at position ``j``, causal), then its MLP; returns the new hidden ``[n, hidden]``."""
        group = self.num_heads // self.num_kv_heads
        keys = kv[0].repeat_interleave(group, 1).transpose(0, 1)
        values = kv[1].repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.arange(kv.shape[1])[None, :] <= positions[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask[None])
        return self._after_attention(i, hidden, out.transpose(0, 1))

    def _after_attention(self, i: int, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s output projection of the attention ``out`` (``[n, num_heads, head_dim]``), residual, MLP."""
        layer = self.layers[i]
        hidden = hidden + layer.self_attn.o_proj(out.reshape(hidden.shape[0], -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def question_scores(self, kv: torch.Tensor, ids: list[int], layers: range) -> torch.Tensor:
        """The attention each token of ``kv`` (``[num_layers, 2, S, ...]``, not modified) receives from ``ids``
        computed after it (positions ``S..``), summed over heads, ``ids`` and ``layers``: float32 ``[S]``
        (``ucm.kernels.blend.question_attention``)."""
        start = kv.shape[2]
        positions = torch.arange(start, start + len(ids))
        hidden = self.embed(ids)
        received = torch.zeros(start)
        for i in range(max(layers, default=-1) + 1):
            q, k, v = self.qkv(i, hidden, positions)
            keys, values = torch.cat((kv[i, 0], k)), torch.cat((kv[i, 1], v))
            out, got = question_attention(q, keys, values, scale=self.head_dim**-0.5)
            if i in layers:
                received += got[:start]
            hidden = self._after_attention(i, hidden, out)
        return received

    def empty_kv(self, n: int = 0) -> torch.Tensor:
        return torch.zeros((self.num_layers, 2, n, self.num_kv_heads, self.head_dim))

    def prefill(self, ids: list[int], kv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute ``ids`` after the tokens of ``kv`` (None: from position 0); returns the KV of all tokens and the
        final-norm hidden state of the last one."""
        kv = self.empty_kv() if kv is None else kv
        start = kv.shape[2]
        positions = torch.arange(start, start + len(ids))
        out = torch.cat((kv, self.empty_kv(len(ids))), dim=2)
        hidden = self.embed(ids)
        for i in range(self.num_layers):
            q, k, v = self.qkv(i, hidden, positions)
            out[i, 0, start:], out[i, 1, start:] = k, v
            hidden = self.finish(i, hidden, q, positions, out[i])
        return out, self.model.model.norm(hidden[-1])

    def greedy(self, kv: torch.Tensor, suffix: list[int], max_tokens: int) -> list[int]:
        """Greedy decoding of ``max_tokens`` tokens after ``suffix``, over ``kv`` (not modified)."""
        kv, hidden = self.prefill(suffix, kv)
        out: list[int] = []
        for _ in range(max_tokens):
            out.append(int(self.model.lm_head(hidden).argmax()))
            kv, hidden = self.prefill(out[-1:], kv)
        return out


def chunk_spans(ids: list[int], chunk_end_id: int) -> list[tuple[int, int]]:
    """The chunks ``[s, e)`` of ``ids``, each ending with ``chunk_end_id`` (tokens after the last one: none)."""
    ends = [i + 1 for i, t in enumerate(ids) if t == chunk_end_id]
    return list(zip([0, *ends[:-1]], ends, strict=True))


@dataclass
class BlendResult:
    """One blend: ``kv`` over the context (``[num_layers, 2, T, num_kv_heads, head_dim]``), the first run token
    ``start``, the run's ``stored`` and ``recomputed`` token counts (recomputed: after the rule's last stage) and
    the positions recomputed then (``chosen``, int64, sorted)."""

    kv: torch.Tensor
    start: int
    stored: int
    recomputed: int
    chosen: torch.Tensor


def blend(
    model: ReferenceModel,
    ids: list[int],
    store: dict[tuple[int, ...], torch.Tensor],
    *,
    chunk_end_id: int,
    rule: Rule,
    block_size: int = 32,
    chunk_context: ChunkContext = "first_chunk",
    full_kv: torch.Tensor | None = None,
    query_ids: list[int] | None = None,
) -> BlendResult:
    """Blend the context ``ids`` (ending with the last chunk's ``chunk_end_id``), as the engine does (module
    docstring). ``store`` maps a chunk's token tuple (after the head, with ``first_chunk``) to its KV from position
    0; a chunk not in it is computed and added. ``full_kv``: the full prefill's KV of ``ids``, needed by ``oracle``;
    ``query_ids``: the prompt's tokens after ``ids`` (the question), needed by ``question``.

    Raises:
        ValueError: ``ids`` has fewer than two chunks or does not end with ``chunk_end_id``, a stage layer is not a
            layer of the model, ``oracle`` without ``full_kv``, or ``question`` without ``query_ids``.
    """
    spans = chunk_spans(ids, chunk_end_id)
    if len(spans) < 2 or spans[-1][1] != len(ids):
        raise ValueError(f"the context must end with chunk_end_id {chunk_end_id} and hold >= 2 chunks")
    if rule.stages[-1][0] >= model.num_layers:
        raise ValueError(f"rule {rule.name}: layer {rule.stages[-1][0]} >= the model's {model.num_layers} layers")
    if rule.kind == "oracle" and full_kv is None:
        raise ValueError("the oracle rule needs the full prefill's KV (full_kv)")
    if rule.kind == "question" and not query_ids:
        raise ValueError("the question rule needs the prompt's tokens after the context (query_ids)")
    head = spans[0][1] if chunk_context == "first_chunk" else 0
    exact_end = spans[1][1] if chunk_context == "first_chunk" else spans[0][1]
    start = exact_end // block_size * block_size  # the stored prefix: whole blocks of what a prefix hit covers
    prefix, _ = model.prefill(ids[:start])
    n = len(ids) - start
    stored_kv = model.empty_kv(n)
    stored = torch.zeros(n, dtype=torch.bool)
    for s, e in spans:
        if e <= start:
            continue
        ctx = ids[:head] if s >= head else []
        tokens = tuple(ctx + ids[s:e])
        if tokens not in store:
            store[tokens] = model.prefill(list(tokens))[0]
        lo, hi = max(s, start), e  # the whole chunk is stored, its trailing partial block too
        part = store[tokens][:, :, lo - s + len(ctx) : hi - s + len(ctx)].clone()
        keys = part[:, 0].reshape(-1, model.num_kv_heads, model.head_dim)
        model.rotate_(keys, torch.full((keys.shape[0],), s - len(ctx), dtype=torch.int64))
        part[:, 0] = keys.view(part[:, 0].shape)
        stored_kv[:, :, lo - start : hi - start] = part
        stored[lo - start : hi - start] = True
    num_stored = int(stored.sum())
    kv = torch.cat((prefix, stored_kv), dim=2)
    if rule.kind == "question":  # the question over the naive KV (before any recompute)
        assert query_ids is not None
        question = model.question_scores(kv, query_ids, rule.question_layers(model.num_layers))[start:]
    positions = torch.arange(start, len(ids))
    rows = torch.arange(n)  # run rows computed at this layer
    hidden = model.embed(ids[start:])
    stages = dict(rule.stages)
    for i in range(model.num_layers):
        if not rows.numel():  # nothing left to recompute: every later layer keeps the stored KV
            break
        q, k, v = model.qkv(i, hidden, positions[rows])
        kv[i, 0, start + rows], kv[i, 1, start + rows] = k, v
        hidden = model.finish(i, hidden, q, positions[rows], kv[i])
        if i not in stages:
            continue
        if rule.kind == "oracle":  # how far each row's stored KV is from full prefill's, over the later layers
            assert full_kv is not None
            score = torch.zeros(rows.shape[0])
            for j in range(i + 1, model.num_layers):
                full = full_kv[j, :, start + rows]
                score += kv_deviation(stored_kv[j, 0, rows], stored_kv[j, 1, rows], full[0], full[1]).float()
        elif rule.kind == "question":
            score = question[rows]
        else:
            score = kv_deviation(k, v, stored_kv[i, 0, rows], stored_kv[i, 1, rows]).float()
        have = stored[rows]
        score = score.masked_fill(~have, float("inf"))  # rows without stored KV always go on
        keep = recompute_count(num_stored, stages[i]) + int((~have).sum())
        picked = torch.argsort(score, descending=True, stable=True)[:keep].sort().values
        rows, hidden = rows[picked], hidden[picked]
    return BlendResult(kv, start, num_stored, int(rows.shape[0]), rows + start)
