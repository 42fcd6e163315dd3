"""UCM's main job on a real model: a long prompt's KV survives an engine restart and is loaded, not recomputed.

Steps (each engine is a fresh process; the store is the embedded default, a local directory):
  0. baseline: vLLM without UCM answers turn 1, and turn 2 after turn 1 (reusing turn 1's blocks from its own
     prefix cache, as vLLM alone serves a conversation): the reference outputs;
  a. cold: vLLM + UCM serves turn 1 (a ~2000-token real text + a question); UCM dumps its full blocks;
  b. restart: a new vLLM + UCM process serves turn 1 again: its KV is loaded from the store;
  c. follow-up: turn 2 extends turn 1 (answer + a new question): the shared blocks come from the store
     (vLLM's own prefix cache is reset first, so the hit is UCM's), the new tail is computed.
Prints a table and, last, ``RESULT {json}``.

Run: ``make demo`` (or ``.venv/bin/python examples/demo.py``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from ucm.testing.engine import RequestResult, failed_loads, run_engine, ucm_transfer_config
from ucm.testing.models import ensure_smollm2
from ucm.testing.texts import prompt_of_tokens

QUESTION_1 = "What is this document? Answer in one sentence."
QUESTION_2 = "Who publishes it, and may I distribute copies of it?"
WARMUP = "Say hello."  # first request of a process pays one-time costs; not measured


def chat(tokenizer, turns: list[tuple[str, str]]) -> str:
    """Prompt text for a chat whose turns are (role, content)."""
    messages = [{"role": role, "content": content} for role, content in turns]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", default="models")
    parser.add_argument("--store", default=".ucm_store/demo", help="UCM store directory (emptied first)")
    parser.add_argument("--doc-tokens", type=int, default=1900, help="length of the document in the prompt")
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model = ensure_smollm2(args.models_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    document = prompt_of_tokens(tokenizer, args.doc_tokens)
    turn1 = chat(tokenizer, [("user", f"{document}\n\n{QUESTION_1}")])

    store = Path(args.store)
    shutil.rmtree(store, ignore_errors=True)
    ucm = ucm_transfer_config(
        {
            "ucm_connectors": [
                {
                    "ucm_connector_name": "UcmPipelineStore",
                    "ucm_connector_config": {"store_pipeline": "Cache|Posix", "storage_backends": str(store)},
                }
            ]
        }
    )

    def spec(connector: dict | None, requests: list[dict]) -> dict:
        warm = {"prompt": WARMUP, "max_tokens": 1}
        reqs = [warm] + [{"max_tokens": args.max_tokens, **r} for r in requests]
        return {
            "model": str(model),
            "dtype": "bfloat16",
            "max_model_len": 4096,
            "connector": connector,
            "requests": reqs,
            "engine_core_process": True,  # as `vllm serve` and LLM(...) run it
        }

    print(f"[demo] model {model}, store {store.resolve()}", flush=True)
    print("[demo] 0. baseline without UCM (turn 1; then turn 1 + turn 2 in one engine) ...", flush=True)
    base, _ = run_engine(spec(None, [{"prompt": turn1}]))
    answer1 = base[1].text.strip()
    turn2 = chat(tokenizer, [("user", f"{document}\n\n{QUESTION_1}"), ("assistant", answer1), ("user", QUESTION_2)])
    # Turn 2 as vLLM alone serves a conversation: turn 1 first, so turn 2 reuses its blocks from vLLM's own prefix
    # cache. (Recomputing turn 2 from scratch in one prefill rounds bf16 differently and may flip a token.)
    base2, _ = run_engine(spec(None, [{"prompt": turn1, "max_tokens": 1}, {"prompt": turn2}]))

    print("[demo] a. cold engine with UCM ...", flush=True)
    cold, _ = run_engine(spec(ucm, [{"prompt": turn1}]))
    print("[demo] b+c. restarted engine with UCM ...", flush=True)
    warm, warm_log = run_engine(spec(ucm, [{"prompt": turn1}, {"prompt": turn2, "reset_prefix_cache": True}]))
    load_failures = failed_loads(warm_log)

    rows: list[tuple[str, RequestResult, RequestResult]] = [
        ("turn 1, no UCM (recompute)", base[1], base[1]),
        ("a. turn 1, cold, with UCM", cold[1], base[1]),
        ("b. turn 1, after restart", warm[1], base[1]),
        ("turn 2, no UCM (vLLM prefix hit)", base2[2], base2[2]),
        ("c. turn 2, after restart", warm[2], base2[2]),
    ]
    print()
    print(f"{'step':32} {'TTFT ms':>9} {'prompt tok':>10} {'hit hbm':>8} {'hit ext':>8}  same as no-UCM?  answer")
    for name, r, ref in rows:
        hbm = "-" if r.hit_hbm < 0 else str(r.hit_hbm)
        ext = "-" if r.hit_external < 0 else str(r.hit_external)
        same = "yes" if r.token_ids == ref.token_ids else "NO"
        text = r.text.strip().replace("\n", " ")
        print(f"{name:32} {r.ttft_ms:9.0f} {r.num_prompt_tokens:10d} {hbm:>8} {ext:>8}  {same:15} {text[:70]}")
    identical = all(r.token_ids == ref.token_ids for _, r, ref in rows)
    blocks = sorted(store.rglob("*.ucmb"))
    print(
        f"\nstore: {len(blocks)} block files, {sum(f.stat().st_size for f in blocks) / 2**20:.1f} MiB in {store}"
        f"\nrestart TTFT {warm[1].ttft_ms:.0f} ms vs cold {cold[1].ttft_ms:.0f} ms "
        f"({cold[1].ttft_ms / warm[1].ttft_ms:.1f}x faster)"
    )
    result = {
        "ttft_cold_ms": round(cold[1].ttft_ms, 1),
        "ttft_restart_ms": round(warm[1].ttft_ms, 1),
        "ttft_followup_ms": round(warm[2].ttft_ms, 1),
        "ttft_recompute_no_ucm_ms": round(base[1].ttft_ms, 1),
        "prompt_tokens": warm[1].num_prompt_tokens,
        "hit_external_blocks": warm[1].hit_external,
        "followup_hit_external_blocks": warm[2].hit_external,
        "failed_block_loads": load_failures,
        "outputs_identical": identical,
    }
    print("RESULT " + json.dumps(result), flush=True)
    if load_failures:
        print(f"WARNING: {load_failures} block loads failed after the restart (recomputed instead)", flush=True)
    return 0 if identical and warm[1].hit_external > 0 and load_failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
