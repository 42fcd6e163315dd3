"""Block-selection policies for sparse decode, against an oracle: how close can one block set per layer get to dense,
and one block set per KV head?

Run::

    PYTHONPATH=. .venv/bin/python benchmarks/sparse_policies.py [--model models/SmolLM2-135M-Instruct]
        [--seeds 0 1 2] [--lengths 2048 4096] [--fractions 0.3] [--policies gsa oracle snap16 snap1]
        [--block-size 128] [--out F]

Why: the quality harness (``python -m ucm.quality``) measures the shipped GSA through the engine. This script asks
what *any* selection of the same shape could reach: one set of KV blocks per request and layer, shared by all heads
(what one paged-attention block table per request allows), ``--block-size`` tokens per block (default 128, vLLM's CPU
default; the CPU backend also runs 32, 64, ... with ``block_size`` in the engine args), the same windows (in blocks)
and budget. It runs the model in HF transformers (float32) on the harness's passkey and multi-document items
(``ucm.quality``, same seeds and lengths), prefills densely, then decodes greedily with an attention function that,
for one-token steps, attends only to the tokens of the kept blocks. The first answer token comes from the dense
prefill, as in vLLM.

Policies (every one keeps blocks with GSA's rule, :func:`ucm.sparse.gsa.keep_mask`: ``init_window_sz`` first and
``local_window_sz`` last blocks forced, the best others up to ``ceil(fraction * n)``):

- ``dense``: all blocks (the reference every other policy is compared with);
- ``gsa``: the shipped score: Quest key bounds per block (Tang et al. 2024), per-head softmax, summed over the
  layer's heads (:func:`ucm.sparse.gsa.aggregate_scores` over :func:`ucm.kernels.key_bounds.block_scores_reference`);
- ``oracle``: the exact attention mass each block gets from the current query, summed over heads. It needs every
  key at every step (a dense attention's work), so it is not a method: it bounds what a scoring of this shape can
  reach;
- ``snapW`` (``snap1``, ``snap16``, ...): the attention mass each block got from the last ``W`` prompt queries,
  computed once at prefill and kept for the whole decode (the observation window of SnapKV, Li et al. 2024, "SnapKV:
  LLM Knows What You are Looking for Before Generation"). ``snap1`` uses only the last prompt token, the one a
  storage hit still computes.
- ``sparqR`` (``sparq8``, ``sparq16``, ...): what ``block_scoring: sparq`` does: every step, the attention mass
  approximated from ``R`` of the ``head_dim`` key components per KV head (:func:`ucm.sparse.gsa.sparq_mass`, after
  SparQ Attention, Ribar et al. 2024);
- ``oracleK`` (``oracle4``, ``oracle16``, ...): the oracle's ranking recomputed only every ``K`` decode steps (and
  when the request starts a new block), reused in between: what an amortised exact re-ranking would reach at 1/K of
  the oracle's scoring cost;
- ``oracle_head``, ``snapW_head``: the same scores kept per KV head (summed over the query heads that share it), each
  KV head keeping its own blocks under the same rule and budget. One block table per request cannot express this
  (vLLM's paged attention kernels take one per sequence); these ask whether a kernel taking per-head tables would be
  worth building.

Reported per policy and fraction: correct answers per task, their share of dense's, and answers token-identical to
dense. The last line printed is a JSON object with every number.
"""

from __future__ import annotations

import argparse
import datetime
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.common import emit_summary  # noqa: E402
from ucm.config import GSAConfig  # noqa: E402
from ucm.kernels.key_bounds import block_scores_reference  # noqa: E402
from ucm.sparse.gsa import aggregate_scores, keep_mask, sparq_mass  # noqa: E402

BLOCK_SIZE = 128  # vLLM's default CPU attention block size: the granularity the engine selects at
ALLOWED = "gsa, oracle, oracle<K>, snap<W>, sparq<R>, oracle_head, snap<W>_head"
TASKS = ("passkey", "multidoc")
ATTENTION_NAME = "ucm_sparse_policy"
_SNAP = re.compile(r"snap(\d+)(_head)?")
_EVERY = re.compile(r"oracle(\d+)")
_SPARQ = re.compile(r"sparq(\d+)")


class SparseDecode:
    """An HF attention function: dense for prefill (recording the last prompt queries), block-sparse for one-token
    steps under the current :attr:`policy` and :attr:`cfg`.

    Attributes:
        policy: ``dense``, ``gsa``, ``oracle``, ``oracle<K>``, ``snap<W>``, ``sparq<R>``, ``oracle_head`` or
            ``snap<W>_head``.
        cfg: GSA's windows and budget (``sparse_ratio`` = the kept fraction).
        kept: kept blocks / blocks over the sparse steps so far (for the report).
        block_size: tokens per block, the selection granularity.
    """

    def __init__(self, max_window: int, block_size: int = BLOCK_SIZE) -> None:
        self.policy = "dense"
        self.block_size = block_size
        self.cfg = GSAConfig()
        self.max_window = max_window
        self.prompt_queries: dict[int, torch.Tensor] = {}  # layer -> float32 [H, W, D], the last prompt queries
        self.prompt_len = 0
        self.kept = [0, 0]
        self.reused: dict[int, tuple[int, torch.Tensor]] = {}  # oracle<K>: layer -> (key length, scores [n])

    def __call__(
        self,
        module: Any,
        query: torch.Tensor,  # [1, H, q_len, D]
        key: torch.Tensor,  # [1, KVH, L, D], cache included, post-RoPE
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if query.shape[2] > 1:
            self.prompt_queries[module.layer_idx] = query[0, :, -self.max_window :].float().clone()
            self.prompt_len = key.shape[2]
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout)
        assert query.shape[0] == 1, "one sequence at a time"
        scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
        q, k, v = query[0, :, 0].float(), key[0].float(), value[0].float()
        group = q.shape[0] // k.shape[0]
        length = k.shape[1]
        bs = self.block_size
        n = math.ceil(length / bs)
        keep = torch.ones(1, n, dtype=torch.bool)  # [1 or KVH, n]: one block set per layer, or per KV head
        if self.policy != "dense":
            scores = self.scores(module.layer_idx, q, k, group, scale)  # [n] or [KVH, n]
            scores = scores.view(-1, n)
            keep = keep_mask(scores, torch.full((scores.shape[0],), n), self.cfg)
            self.kept[0] += int(keep.sum())
            self.kept[1] += keep.numel()
        tokens = keep.repeat_interleave(bs, 1)[:, :length]
        if tokens.shape[0] > 1:
            tokens = tokens.repeat_interleave(group, 0)  # per query head: its KV head's blocks
        kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, L, D]
        logits = torch.einsum("hd,hld->hl", q, kk) * scale
        p = torch.softmax(logits.masked_fill(~tokens, float("-inf")), dim=-1)
        out = torch.einsum("hl,hld->hd", p, vv)
        return out[None, None].to(query.dtype), None

    def scores(self, layer: int, q: torch.Tensor, k: torch.Tensor, group: int, scale: float) -> torch.Tensor:
        """Block scores float32 ``[n]`` of one decode step (higher = keep first); ``[KVH, n]`` for the per-head
        policies."""
        bs = self.block_size
        n = math.ceil(k.shape[1] / bs)
        if self.policy == "gsa":
            blocks = torch.nn.functional.pad(k, (0, 0, 0, n * bs - k.shape[1]), value=float("nan"))
            blocks = blocks.view(k.shape[0], n, bs, -1)  # [KVH, n, B, D]; padding NaN, ignored below
            kmin = torch.nan_to_num(blocks, nan=float("inf")).amin(2).transpose(0, 1)  # [n, KVH, D]
            kmax = torch.nan_to_num(blocks, nan=float("-inf")).amax(2).transpose(0, 1)
            ub = block_scores_reference(q[None], kmin, kmax, torch.arange(n)[None], torch.tensor([n]))
            return aggregate_scores(ub, scale)[0]
        per_head = self.policy.endswith("_head")
        if self.policy in ("oracle", "oracle_head"):
            mass = block_mass(q[:, None], k, group, scale, k.shape[1] - 1, n, bs)
        elif match := _EVERY.fullmatch(self.policy):
            length = k.shape[1]
            if layer in self.reused:
                at, scores = self.reused[layer]
                if length - at < int(match.group(1)) and scores.shape[0] == n:
                    return scores
            scores = block_mass(q[:, None], k, group, scale, length - 1, n, bs).sum(0)
            self.reused[layer] = (length, scores)
            return scores
        elif match := _SPARQ.fullmatch(self.policy):
            paged = torch.nn.functional.pad(k, (0, 0, 0, n * bs - k.shape[1])).view(k.shape[0], n, bs, -1)
            return sparq_mass(q, paged.transpose(0, 1), torch.arange(n), k.shape[1], scale, int(match.group(1)))
        elif match := _SNAP.fullmatch(self.policy):
            queries = self.prompt_queries[layer][:, -int(match.group(1)) :]
            mass = block_mass(queries, k[:, : self.prompt_len], group, scale, self.prompt_len - 1, n, bs)
        else:
            raise ValueError(f"policy {self.policy!r} is not one of {ALLOWED}")
        return mass.view(-1, group, n).sum(1) if per_head else mass.sum(0)  # [KVH, n] or [n]


def block_mass(
    queries: torch.Tensor,
    k: torch.Tensor,
    group: int,
    scale: float,
    last_pos: int,
    n: int,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Attention mass per head and block, float32 ``[H, n]``: causal softmax of ``queries`` ``[H, W, D]`` (the
    last of them at position ``last_pos``) over keys ``k`` ``[KVH, L, D]``, summed over the W queries and over the
    tokens of each ``block_size``-token block."""
    w = queries.shape[1]
    kk = k.repeat_interleave(group, 0)
    logits = torch.einsum("hwd,hld->hwl", queries, kk) * scale
    pos_q = torch.arange(last_pos - w + 1, last_pos + 1)[:, None]
    logits = logits.masked_fill(torch.arange(k.shape[1])[None] > pos_q, float("-inf"))
    mass = torch.softmax(logits, dim=-1).sum(1)  # [H, L]
    mass = torch.nn.functional.pad(mass, (0, n * block_size - k.shape[1]))
    return mass.view(mass.shape[0], n, block_size).sum(-1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from ucm.quality.harness import build_items
    from ucm.quality.tasks import is_correct

    windows = [int(m.group(1)) for p in args.policies if (m := _SNAP.fullmatch(p))]
    attention = SparseDecode(max(windows, default=1), args.block_size)
    AttentionInterface.register(ATTENTION_NAME, attention)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    model = AutoModelForCausalLM.from_pretrained(
        str(args.model), dtype=torch.float32, attn_implementation=ATTENTION_NAME
    )
    model.eval()
    runs = [("dense", 1.0)] + [(p, f) for f in args.fractions for p in args.policies]
    answers: dict[str, list[dict[str, Any]]] = {f"{p}@{f}": [] for p, f in runs}
    kept: dict[str, list[int]] = {f"{p}@{f}": [0, 0] for p, f in runs}
    for seed in args.seeds:
        items = [it for it in build_items(args.model, "real", list(args.lengths), False, seed) if it.task in TASKS]
        for item in items:
            t0 = time.perf_counter()
            ids = tokenizer(item.prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                attention.policy = "dense"
                cache = model(ids[:, :-1], use_cache=True).past_key_values  # the prompt but its last token
                prefix = ids.shape[1] - 1
                line = []
                for policy, fraction in runs:
                    name = f"{policy}@{fraction}"
                    attention.cfg = GSAConfig(sparse_ratio=fraction)
                    attention.kept = kept[name]
                    attention.reused = {}
                    extra = cache.get_seq_length() - prefix
                    if extra:
                        cache.crop(-extra)
                    token, generated = ids[:, -1:], []
                    attention.policy = "dense"  # the last prompt token: part of vLLM's (dense) prefill
                    for _ in range(item.max_tokens):
                        logits = model(token, past_key_values=cache, use_cache=True).logits
                        generated.append(int(logits[0, -1].argmax()))
                        token = torch.tensor([[generated[-1]]])
                        attention.policy = policy
                    text = tokenizer.decode(generated)
                    ok = is_correct(item, text)
                    answers[name].append(
                        {"id": f"s{seed}-{item.id}", "task": item.task, "correct": ok, "tokens": generated}
                    )
                    line.append(f"{name}={'ok' if ok else 'no'}")
            print(f"seed {seed} {item.id}: {' '.join(line)} ({time.perf_counter() - t0:.1f} s)", flush=True)
    dense = answers["dense@1.0"]
    summary: dict[str, Any] = {}
    for name, rows in answers.items():
        per_task = {}
        for task in TASKS:
            got = sum(r["correct"] for r, d in zip(rows, dense, strict=True) if r["task"] == task)
            want = sum(d["correct"] for d in dense if d["task"] == task)
            total = sum(1 for r in rows if r["task"] == task)
            per_task[task] = {"correct": got, "of": total, "share_of_dense": round(got / want, 3) if want else None}
        same = sum(r["tokens"] == d["tokens"] for r, d in zip(rows, dense, strict=True))
        summary[name] = {
            **per_task,
            "same_tokens_as_dense": f"{same}/{len(rows)}",
            "kept_block_fraction": round(kept[name][0] / kept[name][1], 3) if kept[name][1] else 1.0,
        }
    return {
        "benchmark": "sparse_policies",
        "date": datetime.date.today().isoformat(),
        "model": str(args.model),
        "seeds": list(args.seeds),
        "lengths": list(args.lengths),
        "block_size": args.block_size,
        "windows": {"init_window_sz": GSAConfig().init_window_sz, "local_window_sz": GSAConfig().local_window_sz},
        "results": summary,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.3])
    parser.add_argument("--policies", nargs="+", default=["gsa", "oracle", "snap16", "snap1"])
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens per block (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")
    args = parser.parse_args(argv)
    known = ("gsa", "oracle", "oracle_head")
    bad = [p for p in args.policies if p not in known and not any(r.fullmatch(p) for r in (_SNAP, _EVERY, _SPARQ))]
    if bad:
        parser.error(f"--policies {bad}: allowed are {ALLOWED} (e.g. oracle4, snap16, snap16_head)")
    if any(not 0 < f <= 1 for f in args.fractions):
        parser.error(f"--fractions {args.fractions}: each must be in (0, 1]")
    if args.block_size < 1:
        parser.error(
            f"--block-size {args.block_size}: must be a positive number of tokens (vLLM's CPU backend: 32, 64, ...)"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    return emit_summary(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
