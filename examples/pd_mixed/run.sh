#!/usr/bin/env bash
# PD-mixed serving with UCM: the seed deployment guide's procedure ("PD混合推理"), on this machine.
#
# One `vllm serve` (prefill and decode of different requests interleaved in one scheduler) with UCMConnector
# (kv_role kv_both, UCM_CONFIG_FILE), and the guide's `vllm bench serve` random-dataset benchmark:
#   run 1  cold: the store is empty; every prompt is computed and its full blocks are dumped to UCM;
#   run 2  the same command on the same server: the same prompts (--seed 123456), their blocks loaded from UCM
#          (its DRAM tier);
#   the server is restarted (SIGTERM, then started again on the same store: UCM's DRAM tier is gone with the process);
#   run 3  the same command once more: the blocks loaded from storage (the block files under storage_backends).
# Then one table row per run: mean and p90 TTFT, TPOT and E2EL (read from each run's --save-result JSON) and UCM's
# hit counts (the server log's per-request lines "request_id: .., total_blocks_num: .., hit hbm: .., hit external:
# .."), and a check: run 1 has no hits, runs 2 and 3 load from UCM (exit status 1 otherwise).
#
#   make pd-mixed            # or: bash examples/pd_mixed/run.sh
#
# What differs from the guide's commands, and why:
# - hosts 127.0.0.1 (the guide: 0.0.0.0 and localhost); the model and UCM_CONFIG_FILE are local paths.
# - vLLM's own prefix caching is off (--no-enable-prefix-caching, as the guide's compression procedure runs vLLM):
#   with it on, run 2 would be served from vLLM's in-memory prefix cache ("hit hbm") and UCM would load nothing,
#   so run 2 would not show UCM. VLLM_PREFIX_CACHING=on keeps vLLM's default, to see that case.
# - sizes scaled to a 2-vCPU CPU machine and SmolLM2-135M (8K context): 10 prompts of 2048 random tokens (the guide:
#   8000) and 32 output tokens (1000); --max-model-len 4096 (17000); --max-num-batched-tokens 2048 (8000: one
#   prompt per step, as there); data/tensor parallel 1/1 (2/4); UCM's DRAM tier 4 GiB (64). A cold run is then
#   seconds of prefill on two cores, not minutes.
# - `vllm bench serve` also gets --percentile-metrics/--metric-percentiles (the guide's compression test uses them)
#   for the p90 figures, and --save-result/--result-dir/--result-filename for the JSON the table is read from.
# - the store named in the config is emptied first (python -m ucm.store clear), so that run 1 is cold;
#   KEEP_STORE=1 skips that.
#
# Environment: PYTHON (.venv/bin/python), MODEL (default: the demo model, built in MODELS_DIR=models if missing),
# PORT (7800), NUM_PROMPTS (10), INPUT_LEN (2048), OUTPUT_LEN (32), UCM_CONFIG_FILE
# (examples/pd_mixed/ucm_config.yaml), OUT_DIR (.pd_logs/pd_mixed: the server logs, each run's `vllm bench serve`
# output and JSON, runs.tsv, summary.json, and server_pgid: the server's process group), VLLM_CPU_KVCACHE_SPACE
# (GiB, 2), VLLM_PREFIX_CACHING (off), KEEP_STORE, SERVE_ARGS (more `vllm serve` arguments, split on spaces, e.g.
# "--dtype float32").
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
VLLM=$(dirname "$PYTHON")/vllm
MODEL=$(realpath "${MODEL:-$("$PYTHON" -m ucm.testing.models smollm2 --models-dir "${MODELS_DIR:-models}")}")
PORT=${PORT:-7800}
NUM_PROMPTS=${NUM_PROMPTS:-10}
INPUT_LEN=${INPUT_LEN:-2048}
OUTPUT_LEN=${OUTPUT_LEN:-32}
UCM_CONFIG_FILE=$(realpath "${UCM_CONFIG_FILE:-examples/pd_mixed/ucm_config.yaml}")
OUT_DIR=$(realpath -m "${OUT_DIR:-.pd_logs/pd_mixed}")
read -r -a SERVE_ARGS <<<"${SERVE_ARGS:-}"
case ${VLLM_PREFIX_CACHING:=off} in
  off) PREFIX_CACHING=--no-enable-prefix-caching ;;
  on) PREFIX_CACHING=--enable-prefix-caching ;;
  *) echo "VLLM_PREFIX_CACHING is '$VLLM_PREFIX_CACHING'; allowed: on, off" >&2; exit 2 ;;
esac
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} VLLM_HOST_IP=127.0.0.1

server_pid=
stop_server() {  # SIGTERM the server's process group (API server and engine core), wait for all of it to exit
  [[ -n $server_pid ]] || return 0
  kill -TERM -- "-$server_pid" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 -- "-$server_pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=
}
trap stop_server EXIT
trap 'exit 130' INT TERM

start_server() {  # log file
  local log=$1
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then
    echo "a server already answers on 127.0.0.1:$PORT; stop it or set PORT" >&2
    exit 1
  fi
  # The guide's `vllm serve` (see the header for what differs).
  setsid "$VLLM" serve "$MODEL" \
    --host 127.0.0.1 \
    --port "$PORT" \
    --gpu-memory-utilization 0.92 \
    --data-parallel-size 1 \
    --tensor-parallel-size 1 \
    --seed 1024 \
    --max-model-len 4096 \
    --max-num-batched-tokens 2048 \
    --max-num-seqs 20 \
    --trust-remote-code \
    --enforce-eager \
    --block-size 128 \
    "$PREFIX_CACHING" "${SERVE_ARGS[@]}" \
    --kv-transfer-config \
    '{
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm.integration.vllm.ucm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"UCM_CONFIG_FILE": "'"$UCM_CONFIG_FILE"'"}
    }' >"$log" 2>&1 &
  server_pid=$!
  echo "$server_pid" >"$OUT_DIR/server_pgid"
  echo "vllm serve $MODEL on 127.0.0.1:$PORT, vLLM prefix caching $VLLM_PREFIX_CACHING (log $log)"
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    if ! kill -0 "$server_pid" 2>/dev/null; then
      server_pid=
      tail -20 "$log" >&2
      echo "vllm serve exited; see $log" >&2
      exit 1
    fi
    sleep 2
  done
}

bench() {  # run name, the server's log file
  local name=$1 log=$2 start
  start=$(stat -c %s "$log")
  echo  # vllm bench serve's last output line may lack its newline
  echo "== $name: vllm bench serve, $NUM_PROMPTS prompts of $INPUT_LEN random tokens, $OUTPUT_LEN output tokens"
  # The guide's `vllm bench serve` (see the header for what differs).
  "$VLLM" bench serve \
    --backend vllm \
    --model "$MODEL" \
    --host 127.0.0.1 \
    --port "$PORT" \
    --seed 123456 \
    --dataset-name random \
    --num-prompts "$NUM_PROMPTS" \
    --random-input-len "$INPUT_LEN" \
    --random-output-len "$OUTPUT_LEN" \
    --request-rate inf \
    --ignore-eos \
    --percentile-metrics "ttft,tpot,itl,e2el" \
    --metric-percentiles "90,99" \
    --save-result --result-dir "$OUT_DIR" --result-filename "$name.json" \
    2>&1 | tee "$OUT_DIR/$name.txt"
  # UCM logs a request's line when the request is scheduled, before its answer: all of this run's lines are in the
  # log between the two offsets.
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$OUT_DIR/$name.json" "$log" "$start" "$(stat -c %s "$log")" \
    >>"$OUT_DIR/runs.tsv"
}

mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/runs.tsv "$OUT_DIR"/run*.json "$OUT_DIR"/summary.json
if [[ -z ${KEEP_STORE:-} ]]; then
  echo "emptying the store of $UCM_CONFIG_FILE (python -m ucm.store clear; KEEP_STORE=1 skips this)"
  if ! out=$("$PYTHON" -m ucm.store clear --config "$UCM_CONFIG_FILE" --yes 2>&1); then
    grep -q "does not exist" <<<"$out" || { echo "$out" >&2; exit 1; }  # no store yet: nothing to empty
  fi
fi

start_server "$OUT_DIR/server1.log"
bench run1_cold "$OUT_DIR/server1.log"
bench run2_same_server "$OUT_DIR/server1.log"
echo
echo "== restart: the server is stopped (SIGTERM) and started again on the same store"
stop_server
start_server "$OUT_DIR/server2.log"
bench run3_after_restart "$OUT_DIR/server2.log"
stop_server
"$PYTHON" examples/pd_mixed/report.py "$OUT_DIR/runs.tsv" --vllm-prefix-caching "$VLLM_PREFIX_CACHING" \
  --json "$OUT_DIR/summary.json"
