"""A failed load must not leave wrong KV in the store: the blocks computed in the step of the failure are not dumped.

When a load fails, vLLM computes the rest of the prompt in the same step with the failed block's slot holding stale
KV, then throws that step's output away and recomputes from the failed block. Any block that became full in that
step was computed over the stale slot: dumping it would store wrong KV under a valid key, with a valid checksum,
served to every later request with that prefix. Here a restarted engine serves a longer prompt ``B`` whose stored
prefix has a damaged second block, then the short prompt ``A``, then ``B`` once more, which now loads every block of
its prefix, the ones dumped after the failure included. Every output must equal a no-cache run's (before the fix,
the last one's log-probs were off by ~2e-2).
"""

from __future__ import annotations

import pytest

from tests.faults.helpers import block_files, block_path, engine_spec, request_block_keys, run_ucm, warnings_of
from tests.helpers import assert_same_output
from ucm.store.posix import HEADER_NBYTES
from ucm.testing.engine import failed_loads, run_engine

pytestmark = pytest.mark.engine

SHORT_TOKENS = 300  # A: 2 full blocks of 128
LONG_TOKENS = 620  # B: A's first 2 blocks, then 2 more full blocks computed (and dumped) in the failing step


@pytest.fixture(scope="module")
def prompts(tokenizer) -> tuple[str, str]:
    from ucm.testing.texts import prompt_of_tokens

    text = prompt_of_tokens(tokenizer, LONG_TOKENS + 40)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids[:SHORT_TOKENS]), tokenizer.decode(ids[:LONG_TOKENS])


@pytest.fixture(scope="module")
def served(tiny_model, prompts, tmp_path_factory):
    short, long = prompts
    store = tmp_path_factory.mktemp("failed_load_dumps") / "store"
    _, stderr = run_ucm(tiny_model, store, [short])
    (keys,) = request_block_keys(stderr)
    assert len(keys) == 2 and len(block_files(store)) == 2
    damaged = block_path(store, keys[1])
    data = bytearray(damaged.read_bytes())
    data[HEADER_NBYTES + len(data) // 3] ^= 0x40
    damaged.write_bytes(bytes(data))
    results, stderr = run_ucm(tiny_model, store, [long, short, long])
    baseline, _ = run_engine(engine_spec(tiny_model, None, [long, short, long]))
    return results, baseline, stderr


def test_the_failing_steps_dump_was_dropped_and_redone(served):
    results, _, stderr = served
    assert failed_loads(stderr) == 1
    assert warnings_of(stderr, "dropped the dump of 2 blocks"), "the failing step's 2 new blocks were not dropped"
    # B: both stored blocks found, the second fails; vLLM recomputes from it and UCM dumps it and the 2 blocks
    # after it again. A: both blocks found. B again: its whole prefix found (all 4 full blocks).
    assert [r.hit_external for r in results] == [2, 2, 4]


def test_every_output_equals_the_no_cache_run(served):
    results, baseline, _ = served
    for got, want in zip(results, baseline, strict=True):
        assert_same_output(got, want)
