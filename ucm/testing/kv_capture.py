"""Real KV for codec tests and benchmarks: a real model's K and V on real English text, as canonical blocks.

The model runs in transformers (bf16, eager attention) on a prompt of real text (:mod:`ucm.testing.texts`); its
``past_key_values`` hold K after RoPE and V, exactly what vLLM writes into its paged cache for the same prompt (up
to bf16 rounding differences between kernels). They are cut into canonical blocks
(:mod:`ucm.kernels.layouts`: per layer ``K[block_size, num_kv_heads, head_dim]`` then V).

Run as a script to capture once and save (a few MB, not committed)::

    python -m ucm.testing.kv_capture --model models/SmolLM2-135M-Instruct --tokens 2048 --out kv.pt
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ucm.testing.texts import prompt_of_tokens


def capture_kv(model_dir: str | Path, n_tokens: int = 2048, block_size: int = 128) -> torch.Tensor:
    """Run the model at ``model_dir`` on ``n_tokens`` tokens of real text and return its KV as canonical blocks.

    Returns:
        bf16 tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` with
        ``num_blocks = n_tokens // block_size`` (a partial last block is dropped); ``[:, l, 0]`` is layer ``l``'s
        K (after RoPE), ``[:, l, 1]`` its V.

    Raises:
        ValueError: ``n_tokens`` < ``block_size`` or ``block_size`` < 1.
    """
    if block_size < 1 or n_tokens < block_size:
        raise ValueError(f"need n_tokens >= block_size >= 1, got n_tokens={n_tokens}, block_size={block_size}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, attn_implementation="eager")
    model.eval()
    ids = tokenizer.encode(prompt_of_tokens(tokenizer, n_tokens), add_special_tokens=False)[:n_tokens]
    num_blocks = len(ids) // block_size
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    layers = []
    for layer in cache.layers:
        # [1, num_kv_heads, seq, head_dim] -> [num_blocks, block_size, num_kv_heads, head_dim]
        kv = []
        for t in (layer.keys, layer.values):
            t = t[0, :, : num_blocks * block_size].transpose(0, 1)
            kv.append(t.reshape(num_blocks, block_size, t.shape[1], t.shape[2]))
        layers.append(torch.stack(kv, dim=1))  # [num_blocks, 2, block_size, heads, head_dim]
    return torch.stack(layers, dim=1).to(torch.bfloat16).contiguous()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory (e.g. models/SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--out", required=True, help="where to torch.save the [blocks, layers, 2, ...] tensor")
    args = parser.parse_args(argv)
    kv = capture_kv(args.model, args.tokens, args.block_size)
    torch.save(kv, args.out)
    print(f"saved {tuple(kv.shape)} {kv.dtype} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
