"""Run a real vLLM engine (offline ``LLM``) in a fresh subprocess: for tests, the demo and benchmarks.

Each call of :func:`run_engine` is a new process, so a second call is a real restart: nothing survives but files.
The child runs the requests one at a time (batching changes bf16 results on CPU), records per request the output
token ids, their log-probs and TTFT, and the parent parses UCM's per-request log line
(``request_id: .., total_blocks_num: .., hit hbm: .., hit external: ..``) from the child's stderr.

Spec (a dict, JSON-serializable)::

    {"model": "/path", "dtype": "bfloat16", "max_model_len": 4096, "kvcache_gib": 1,
     "enable_prefix_caching": true,
     "engine_args": {"max_num_batched_tokens": 256},   # optional: more LLM(...) keyword arguments
     "connector": null | {"kv_connector": "UCMConnector", ...}   # vLLM's kv_transfer_config as a dict
     "requests": [{"prompt": "...", "max_tokens": 16, "cache_salt": null, "reset_prefix_cache": false,
                   "before_cmd": null,      # a shell command the child runs before the request
                   "top_logprobs": 0,       # also record the k most likely tokens' log-probs at each step
                   "prompt_logprobs": false # also record the log-prob of every prompt token (teacher forced)
                   }, ...],
     "reset_prefix_cache": false,       # reset vLLM's own prefix cache before every request
     "batch": false,                    # true: every request in one generate call, batched by vLLM's scheduler
                                        # (no before_cmd / reset_prefix_cache; hit counts not parsed: -1)
     "engine_core_process": false}      # true: vLLM's engine core in its own process (see below)

By default the engine core runs inside the child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the same scheduler,
model runner and connector code (both connector roles, in one process), without a second process that polls for
work, which on a machine with few cores shortens a test's engine run (see "Test suite duration" in
benchmarks/RESULTS.md). ``"engine_core_process": true`` keeps vLLM's default layout (``LLM`` and ``vllm serve``:
a separate engine-core process), for benchmarks, the demo and the tests that must see that layout.

``before_cmd`` lets a test change the world while the engine serves (delete the storage directory, fill a disk);
``run_engine(wrapper=[...])`` runs the child under a command prefix (e.g. ``setpriv`` dropping capabilities).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm.testing import forkserver

UCM_CONNECTOR = "UCMConnector"
UCM_MODULE = "ucm.integration.vllm.ucm_connector"
# UCM's per-request log line (``UCMScheduler.get_num_new_matched_tokens``): request id, full prompt blocks, blocks
# vLLM's prefix cache held, blocks the store supplies.
HIT_RE = re.compile(r"request_id: (\S+), total_blocks_num: (\d+), hit hbm: (\d+), hit external: (\d+)")
# The same line in a data-parallel engine: HIT_RE's fields, then the DP rank (ucm/integration/vllm/scheduler.py).
DP_HIT_RE = re.compile(HIT_RE.pattern + r", dp rank: (\d+)")
# CacheBlend's per-blend line (``ucm.integration.vllm.blend.Blender.blend``): request id, run start and end (tokens),
# chunks, tokens with their chunk's own KV (loaded, or computed now), chunks computed on their own and stored now,
# tokens recomputed after the check layer, chunk loads and computations (ms), the pass (ms).
BLEND_RE = re.compile(
    r"request_id: (\S+), blend of tokens (\d+)-(\d+): (\d+) chunks, (\d+) tokens with their chunk's own KV \((\d+) "
    r"chunks were not stored: computed on their own and stored now\), (\d+) recomputed after \S+ \(ratio [\d.]+, by "
    r"(?:KV deviation|the question's attention)\); "
    r"chunks ([\d.]+) ms, pass ([\d.]+) ms"
)
_RESULT_PREFIX = "UCM_ENGINE_RESULT "
_LOAD_FAILED_RE = re.compile(r"\[UC\]\[W\] (\d+) of \d+ blocks failed to load")


def failed_loads(stderr: str) -> int:
    """Blocks whose load failed (and were recomputed), from UCM's warnings in an engine's stderr."""
    return sum(int(n) for n in _LOAD_FAILED_RE.findall(stderr))


def ucm_transfer_config(extra_config: dict[str, Any], kv_role: str = "kv_both") -> dict[str, Any]:
    """vLLM ``kv_transfer_config`` for UCMConnector with ``kv_connector_extra_config = extra_config``."""
    return {
        "kv_connector": UCM_CONNECTOR,
        "kv_connector_module_path": UCM_MODULE,
        "kv_role": kv_role,
        "kv_connector_extra_config": extra_config,
    }


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a CPU vLLM engine: loopback sockets, KV cache size, fixed OpenMP binding."""
    env = dict(os.environ)
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # The same cores with and without a connector (vLLM reserves one for connectors otherwise, which changes
    # bf16 results): comparisons across engines need this.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if extra:
        env.update(extra)
    return env


@dataclass
class RequestResult:
    """One request's outcome.

    Attributes:
        token_ids: generated token ids (greedy).
        text: generated text.
        logprobs: log-prob of each generated token.
        ttft_ms: time to first token (engine's first_token_latency), ms.
        num_prompt_tokens: prompt length in tokens.
        hit_hbm / hit_external / total_blocks: from UCM's log line (-1 without UCM).
        wall_ms: the request's wall time in the child (``generate`` call), ms: TTFT plus all decode steps.
        top_logprobs: per generated token, ``{token id: log-prob}`` of the ``top_logprobs`` most likely tokens (and
            the chosen one); empty unless the request asked for them.
        prompt_logprobs: log-prob of prompt tokens 1.. given the tokens before them (the first token has none);
            empty unless the request set ``prompt_logprobs``. vLLM computes every prompt token of such a request
            (it skips its prefix cache and the connector's external hits).
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]
    ttft_ms: float
    num_prompt_tokens: int
    hit_hbm: int = -1
    hit_external: int = -1
    total_blocks: int = -1
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    wall_ms: float = 0.0


def _uses_ucm(transfer: dict[str, Any] | None) -> bool:
    """Whether a ``kv_transfer_config`` is UCMConnector or a MultiConnector holding one."""
    if not transfer:
        return False
    if transfer.get("kv_connector") == UCM_CONNECTOR:
        return True
    children = (transfer.get("kv_connector_extra_config") or {}).get("connectors") or []
    return any(_uses_ucm(child) for child in children)


def run_engine(
    spec: dict[str, Any],
    env: dict[str, str] | None = None,
    timeout_s: float = 900,
    log_path: Path | None = None,
    wrapper: Sequence[str] = (),
) -> tuple[list[RequestResult], str]:
    """Run ``spec`` in a fresh engine process; return the per-request results and the child's stderr.

    ``env`` adds to :func:`engine_env` (``VLLM_ENABLE_V1_MULTIPROCESSING`` comes from the spec's
    ``engine_core_process``, see the module doc); ``wrapper`` is a command prefix for the child (``[]``: none).
    With ``UCM_ENGINE_FORKSERVER=1`` (the test suite) and no wrapper, the process is forked from a server that has
    imported vLLM already (:mod:`ucm.testing.forkserver`).

    Raises:
        RuntimeError: the child failed, ran past ``timeout_s`` seconds (it is killed), or did not end within
            :data:`ucm.testing.forkserver.KILL_WAIT_S` s of being killed (stuck in the kernel); the message holds
            its stderr tail, and ``log_path`` what it wrote.
    """
    child_env = engine_env(env)
    child_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("engine_core_process") else "0"
    server = forkserver.server_for(child_env) if forkserver.enabled() and not wrapper else None
    try:
        if server is not None:
            proc = server.run(spec, child_env, timeout_s)
        else:
            proc = _run_plain([*wrapper, sys.executable, "-m", "ucm.testing.engine"], spec, child_env, timeout_s)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr if isinstance(exc.stderr, str) else ""  # both run paths give text
        if log_path is not None:
            log_path.write_text(stderr)
        raise RuntimeError(f"engine process ran past {timeout_s} s and was killed:\n{stderr[-6000:]}") from None
    if log_path is not None:
        log_path.write_text(proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine process failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    raw = json.loads(lines[-1][len(_RESULT_PREFIX) :])
    for r in raw:  # JSON object keys are strings
        r["top_logprobs"] = [{int(k): v for k, v in step.items()} for step in r.get("top_logprobs", [])]
    results = [RequestResult(**r) for r in raw]
    hits = HIT_RE.findall(proc.stderr)
    if _uses_ucm(spec.get("connector")) and not spec.get("batch"):
        if len(hits) != len(results):
            raise RuntimeError(f"expected {len(results)} UCM request lines, found {len(hits)}:\n{proc.stderr[-4000:]}")
        for r, (_, total, hbm, ext) in zip(results, hits, strict=True):
            r.total_blocks, r.hit_hbm, r.hit_external = int(total), int(hbm), int(ext)
    return results, proc.stderr


def _run_plain(
    cmd: list[str], spec: dict[str, Any], env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, input=spec as JSON, capture_output=True, text=True, timeout=timeout_s)``, except that a
    child killed for its timeout is waited for at most :data:`ucm.testing.forkserver.KILL_WAIT_S` s, not without
    bound (a child stuck in the kernel, on a hung mount, does not end on SIGKILL).

    Raises:
        subprocess.TimeoutExpired: the child ran past ``timeout_s`` (killed; ``stderr`` holds what it wrote).
        RuntimeError: the killed child did not end within the wait.
    """
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        stdout, stderr = proc.communicate(json.dumps(spec), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            stdout, stderr = proc.communicate(timeout=forkserver.KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            raise forkserver.stuck_error(f"engine process {proc.pid}", timeout_s, "") from None
        raise subprocess.TimeoutExpired(cmd, timeout_s, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _child(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(spec.get("engine_args", {}))
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = spec["connector"]
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        max_model_len=spec.get("max_model_len", 4096),
        enforce_eager=True,
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    if spec.get("batch"):
        prompts = [_prompt(req) for req in spec["requests"]]
        t0 = time.perf_counter()
        batch = llm.generate(prompts, [_params(req) for req in spec["requests"]], use_tqdm=False)  # type: ignore[arg-type]
        wall_ms = (time.perf_counter() - t0) * 1e3
        return [_record(req, result, wall_ms) for req, result in zip(spec["requests"], batch, strict=True)]
    out: list[dict[str, Any]] = []
    for req in spec["requests"]:
        if req.get("before_cmd"):
            subprocess.run(req["before_cmd"], shell=True, check=True)
        if spec.get("reset_prefix_cache") or req.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        t0 = time.perf_counter()
        (result,) = llm.generate([_prompt(req)], _params(req), use_tqdm=False)  # type: ignore[arg-type]
        out.append(_record(req, result, (time.perf_counter() - t0) * 1e3))
    return out


def _prompt(req: dict[str, Any]) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt": req["prompt"]}
    if req.get("cache_salt") is not None:
        prompt["cache_salt"] = req["cache_salt"]
    return prompt


def _params(req: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=req.get("max_tokens", 16),
        logprobs=int(req.get("top_logprobs", 0)),
        prompt_logprobs=0 if req.get("prompt_logprobs") else None,
    )


def _record(req: dict[str, Any], result: Any, wall_ms: float) -> dict[str, Any]:
    """One request's result as :class:`RequestResult` fields (without the hit counts the parent parses)."""
    completion = result.outputs[0]
    ttft = getattr(result.metrics, "first_token_latency", 0.0) if result.metrics else 0.0
    logprobs = [
        float(step[tok].logprob) if step else float("nan")
        for step, tok in zip(completion.logprobs or [], completion.token_ids, strict=False)
    ]
    record: dict[str, Any] = {
        "token_ids": list(completion.token_ids),
        "text": completion.text,
        "logprobs": logprobs,
        "ttft_ms": ttft * 1e3 if ttft > 0 else wall_ms,
        "num_prompt_tokens": len(result.prompt_token_ids or []),
        "wall_ms": wall_ms,
    }
    if int(req.get("top_logprobs", 0)):
        record["top_logprobs"] = [
            {str(tok): float(lp.logprob) for tok, lp in step.items()} for step in completion.logprobs or []
        ]
    if req.get("prompt_logprobs"):
        record["prompt_logprobs"] = [
            float(step[tok].logprob)
            for step, tok in zip(result.prompt_logprobs or [], result.prompt_token_ids or [], strict=False)
            if step
        ]
    return record


def run_child(spec: dict[str, Any]) -> None:
    """The engine process's work: run ``spec`` and print the results for :func:`run_engine`."""
    print(_RESULT_PREFIX + json.dumps(_child(spec)), flush=True)


if __name__ == "__main__":
    run_child(json.loads(sys.stdin.read()))
