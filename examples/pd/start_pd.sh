#!/usr/bin/env bash
# Start xPyD on this machine: NUM_P prefill instances (kv_producer), NUM_D decode instances (kv_consumer), all on
# loopback and sharing one UCM store directory, and the PD proxy in front of them (foreground; Ctrl-C stops all).
#
#   bash examples/pd/start_pd.sh 1 1        # 1P1D: prefill on 8100, decode on 8200, proxy on 8000
#   bash examples/pd/start_pd.sh 2 2        # 2P2D: prefill on 8100-8101, decode on 8200-8201
#
# Then: curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#         -d '{"model": "'"$PWD"'/models/SmolLM2-135M-Instruct", "prompt": "...", "max_tokens": 32}'
#
# Environment: PYTHON (default .venv/bin/python), MODEL (default: the demo model in ./models, built if missing),
# PROXY_PORT (8000), PREFILL_PORT0 (8100), DECODE_PORT0 (8200), UCM_CONFIG_FILE (examples/pd/ucm_pd.yaml),
# VLLM_CPU_KVCACHE_SPACE (GiB per instance, default 1), LOG_DIR (./.pd_logs).
set -euo pipefail
cd "$(dirname "$0")/../.."
NUM_P=${1:-1}
NUM_D=${2:-1}
PYTHON=${PYTHON:-.venv/bin/python}
PROXY_PORT=${PROXY_PORT:-8000}
PREFILL_PORT0=${PREFILL_PORT0:-8100}
DECODE_PORT0=${DECODE_PORT0:-8200}
UCM_CONFIG_FILE=${UCM_CONFIG_FILE:-$PWD/examples/pd/ucm_pd.yaml}
LOG_DIR=${LOG_DIR:-$PWD/.pd_logs}
MODEL=$(realpath "${MODEL:-$("$PYTHON" -m ucm.testing.models smollm2 --models-dir models)}")
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_HOST_IP=127.0.0.1
mkdir -p "$LOG_DIR"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done; wait; }
trap cleanup EXIT INT TERM

start_instance() {  # role port
  local role=$1 port=$2
  local transfer='{"kv_connector":"UCMConnector","kv_connector_module_path":"ucm.integration.vllm.ucm_connector",'
  transfer+='"kv_role":"'$role'","kv_connector_extra_config":{"UCM_CONFIG_FILE":"'$UCM_CONFIG_FILE'"}}'
  setsid "$(dirname "$PYTHON")/vllm" serve "$MODEL" --host 127.0.0.1 --port "$port" \
    --dtype bfloat16 --max-model-len 4096 --enforce-eager --kv-transfer-config "$transfer" \
    >"$LOG_DIR/$role-$port.log" 2>&1 &
  pids+=($!)
  echo "$role on 127.0.0.1:$port (log $LOG_DIR/$role-$port.log)"
}

prefill_ports=() decode_ports=()
for ((i = 0; i < NUM_P; i++)); do prefill_ports+=($((PREFILL_PORT0 + i))); start_instance kv_producer "${prefill_ports[-1]}"; done
for ((i = 0; i < NUM_D; i++)); do decode_ports+=($((DECODE_PORT0 + i))); start_instance kv_consumer "${decode_ports[-1]}"; done

for port in "${prefill_ports[@]}" "${decode_ports[@]}"; do
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "an instance exited; see $LOG_DIR" >&2; exit 1; }; done
    sleep 2
  done
  echo "127.0.0.1:$port ready"
done

echo "model: $MODEL (the \"model\" field of requests)"
"$PYTHON" -m ucm.pd.proxy --port "$PROXY_PORT" \
  --prefiller-hosts 127.0.0.1 --prefiller-ports "${prefill_ports[@]}" \
  --decoder-hosts 127.0.0.1 --decoder-ports "${decode_ports[@]}"
