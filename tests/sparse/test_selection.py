"""GSA's keep rule (``ucm.sparse.selection.keep_blocks``): every implementation against the row-by-row reference
(``impl="reference"``: ``keep_mask_reference`` then ``compact_block_table``) and the CPU path against the torch pieces
it replaces, whole tables compared."""

from __future__ import annotations

import pytest
import torch

from ucm.config import GSAConfig
from ucm.sparse import compact_block_table
from ucm.sparse.selection import aggregate_scores, keep_blocks, keep_mask, keep_mask_reference

CONFIGS = [
    GSAConfig(sparse_ratio=0.3, block_scoring="key_bounds"),
    GSAConfig(sparse_ratio=0.5, init_window_sz=2, local_window_sz=3, min_blocks=8, block_scoring="key_bounds"),
    GSAConfig(sparse_ratio=0.1, init_window_sz=0, local_window_sz=1, min_blocks=2, block_scoring="key_bounds"),
]
CONFIG_IDS = ["r0.3", "r0.5-w2-3-min8", "r0.1-w0-1-min2"]
BLOCK_SIZE, WIDTH, NUM_HEADS = 16, 24, 6


def scores_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(head, rows, table, lens, n)``: 6 rows over a width-24 table: rows that select, a row below most configs'
    ``min_blocks``, an empty row, a row not selecting (4: not in ``rows``), and tied scores (equal heads over several
    blocks of row 0: the earlier block wins, as in the stable torch sort)."""
    g = torch.Generator().manual_seed(3)
    bs = BLOCK_SIZE
    lens = torch.tensor([24 * bs, 20 * bs + 3, 3 * bs, 0, 17 * bs - 2, 22 * bs], dtype=torch.int32)
    table = torch.randperm(200, generator=g)[: 6 * WIDTH].view(6, WIDTH).to(torch.int32)
    rows = torch.tensor([0, 1, 2, 3, 5])  # row 4 keeps everything however long it is
    n = torch.div(lens.long() + bs - 1, bs, rounding_mode="floor")
    head = torch.randn((rows.numel(), NUM_HEADS, WIDTH), generator=g)
    head[0, :, 5:12] = 3.0  # ties across seven blocks of row 0
    head[1] = torch.randn((1, WIDTH), generator=g).expand(NUM_HEADS, WIDTH)
    head = head.masked_fill(torch.arange(WIDTH)[None, None, :] >= n[rows][:, None, None], float("-inf"))
    return head, rows, table, lens, n


def assert_same_selection(got, want, lens: torch.Tensor) -> None:  # two Selections
    assert torch.equal(got.block_table, want.block_table)
    assert torch.equal(got.seq_lens, want.seq_lens) and got.seq_lens.dtype == lens.dtype
    assert torch.equal(got.kept, want.kept) and torch.equal(got.num_blocks, want.num_blocks)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_cpu_keep_blocks_is_the_torch_selection(cfg: GSAConfig) -> None:
    """``keep_blocks`` on CPU (one numba call) against ``compact_block_table(keep_mask(aggregate_scores(...)))``."""
    head, rows, table, lens, n = scores_batch()
    for temperature in (1.0, 0.125):
        got = keep_blocks(head, temperature, rows, table, lens, BLOCK_SIZE, cfg, impl="cpu")
        keep = torch.ones(table.shape, dtype=torch.bool)
        keep[rows] = keep_mask(aggregate_scores(head, temperature), n[rows], cfg)
        keep[rows[n[rows] < cfg.min_blocks]] = True
        assert_same_selection(got, compact_block_table(table, lens, keep, BLOCK_SIZE), lens)
    assert int(got.kept[4]) == int(n[4]) and int(got.kept[3]) == 0


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("impl", ["auto", "cpu", "torch"])
def test_keep_blocks_matches_reference(impl: str, cfg: GSAConfig) -> None:
    head, rows, table, lens, n = scores_batch()
    for temperature in (1.0, 0.125):
        got = keep_blocks(head, temperature, rows, table, lens, BLOCK_SIZE, cfg, impl=impl)  # type: ignore[arg-type]
        want = keep_blocks(head, temperature, rows, table, lens, BLOCK_SIZE, cfg, impl="reference")
        assert_same_selection(got, want, lens)
    assert int(got.kept[4]) == int(n[4]) and int(got.kept[3]) == 0


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_keep_mask_matches_reference(cfg: GSAConfig) -> None:
    """The torch rule (``keep_mask`` over ``aggregate_scores``) keeps the blocks the row-by-row oracle keeps."""
    head, rows, _, _, n = scores_batch()
    for temperature in (1.0, 0.125):
        got = keep_mask(aggregate_scores(head, temperature), n[rows], cfg)
        assert torch.equal(got, keep_mask_reference(head, temperature, n[rows], cfg))


def test_keep_blocks_errors_name_the_allowed_impls() -> None:
    head, rows, table, lens, _ = scores_batch()
    cfg = CONFIGS[0]
    with pytest.raises(ValueError, match=r"keep_blocks has no 'triton' implementation; impl must be one of"):
        keep_blocks(head, 1.0, rows, table, lens, BLOCK_SIZE, cfg, impl="triton")
    with pytest.raises(ValueError, match=r"impl must be one of \['auto', 'triton', 'cpu', 'torch', 'reference'\]"):
        keep_blocks(head, 1.0, rows, table, lens, BLOCK_SIZE, cfg, impl="numba")  # type: ignore[arg-type]
