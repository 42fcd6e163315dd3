#!/usr/bin/env bash
# Centralized PD disaggregation on this machine, in the seed deployment guide's form ("集中式PD分离", example 2P2D):
# prefill instances on ports 7800 and 7801, decode instances on 7802 and 7803, each a `vllm serve` with UCMConnector
# and the same UCM config (examples/pd/ucm_pd.yaml: one store directory they all see; on a cluster, an NFS or 3FS
# mount), and the PD proxy on 7805 with the guide's flags (python -m ucm.pd.proxy). Foreground; Ctrl-C stops all.
#
#   bash examples/pd/start_pd.sh                                          # 2P2D (examples/pd/run_2p2d.sh)
#   PREFILL_PORTS=7800 DECODE_PORTS=7801 bash examples/pd/start_pd.sh     # 1P1D (examples/pd/run_1p1d.sh)
#
# Then the guide's step 5 (sizes scaled as in examples/pd_mixed/run.sh), from another shell:
#   .venv/bin/vllm bench serve --backend vllm --model "$PWD/models/SmolLM2-135M-Instruct" --host 127.0.0.1 \
#     --port 7805 --seed 123456 --dataset-name random --num-prompts 10 --random-input-len 2048 \
#     --random-output-len 32 --request-rate inf --ignore-eos
# Each decode instance's log shows UCM loading what the prefill instance stored: "hit external: <blocks>".
#
# What differs from the guide's commands, and why:
# - hosts 127.0.0.1 (the guide: 0.0.0.0 and 192.168.10.x); the model and UCM_CONFIG_FILE are local paths.
# - sizes: tensor parallel 1 (4; no accelerators here), --max-model-len 4096 (17000; SmolLM2 has 8K positions),
#   --max-num-batched-tokens 2048 (8000), the DRAM tier in ucm_pd.yaml 2 GiB (64); ASCEND_RT_VISIBLE_DEVICES dropped.
# - nothing else: every instance is kv_both as in the guide (a prefill instance then also loads prefixes that are
#   already stored; docs/pd.md has kv_producer / kv_consumer), and the decode instances keep the guide's
#   --compilation-config and run without --enforce-eager: on CPU vLLM turns CUDA graphs off and compiles the model
#   with torch.compile (a slower first start; later starts use vLLM's compile cache).
#
# Environment: PYTHON (.venv/bin/python), MODEL (default: the demo model, built in ./models if missing),
# PREFILL_PORTS ("7800 7801"), DECODE_PORTS ("7802 7803"), PROXY_PORT (7805), UCM_CONFIG_FILE
# (examples/pd/ucm_pd.yaml), VLLM_CPU_KVCACHE_SPACE (GiB per instance, 1), LOG_DIR (.pd_logs: one log per instance,
# and server_pgids: the instances' process groups), SERVE_ARGS (more arguments for every `vllm serve`, split on
# spaces, e.g. "--dtype float32").
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
VLLM=$(dirname "$PYTHON")/vllm
read -r -a PREFILL_PORTS <<<"${PREFILL_PORTS:-7800 7801}"
read -r -a DECODE_PORTS <<<"${DECODE_PORTS:-7802 7803}"
PROXY_PORT=${PROXY_PORT:-7805}
UCM_CONFIG_FILE=$(realpath "${UCM_CONFIG_FILE:-examples/pd/ucm_pd.yaml}")
LOG_DIR=$(realpath -m "${LOG_DIR:-.pd_logs}")
read -r -a SERVE_ARGS <<<"${SERVE_ARGS:-}"
MODEL=$(realpath "${MODEL:-$("$PYTHON" -m ucm.testing.models smollm2 --models-dir models)}")
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_HOST_IP=127.0.0.1
export PYTHONHASHSEED=123456  # as in the guide, on every instance
mkdir -p "$LOG_DIR"
: >"$LOG_DIR/server_pgids"

pgids=()
proxy_pid=
cleanup() {  # SIGTERM the proxy and every instance's process group (API server and engine core); SIGKILL what is
  # left after 60 s
  [[ -z $proxy_pid ]] || kill -TERM "$proxy_pid" 2>/dev/null || true
  for pgid in "${pgids[@]}"; do kill -TERM -- "-$pgid" 2>/dev/null || true; done
  for pgid in "${pgids[@]}"; do
    for _ in $(seq 60); do kill -0 -- "-$pgid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pgid" 2>/dev/null || true
  done
  wait
}
trap cleanup EXIT
trap 'exit 130' INT TERM

TRANSFER_CONFIG='{
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm.integration.vllm.ucm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"UCM_CONFIG_FILE": "'"$UCM_CONFIG_FILE"'"}
    }'

start_instance() {  # kind (prefill|decode), port, then the flags that differ: the guide's steps 2 and 3
  local kind=$1 port=$2
  shift 2
  setsid "$VLLM" serve "$MODEL" \
    --host 127.0.0.1 \
    --port "$port" \
    --gpu-memory-utilization 0.92 \
    --data-parallel-size 1 \
    --tensor-parallel-size 1 \
    --seed 1024 \
    --max-model-len 4096 \
    --max-num-batched-tokens 2048 \
    --max-num-seqs 20 \
    --trust-remote-code \
    "$@" \
    "${SERVE_ARGS[@]}" \
    --kv-transfer-config \
    "$TRANSFER_CONFIG" >"$LOG_DIR/$kind-$port.log" 2>&1 &
  pgids+=($!)
  echo $! >>"$LOG_DIR/server_pgids"
  echo "$kind instance on 127.0.0.1:$port (log $LOG_DIR/$kind-$port.log)"
}

for port in "${PREFILL_PORTS[@]}" "${DECODE_PORTS[@]}" "$PROXY_PORT"; do
  if curl -s -o /dev/null "http://127.0.0.1:$port/"; then
    echo "something already answers on 127.0.0.1:$port; stop it or choose other ports" >&2
    exit 1
  fi
done
for port in "${PREFILL_PORTS[@]}"; do start_instance prefill "$port" --enforce-eager; done
for port in "${DECODE_PORTS[@]}"; do
  start_instance decode "$port" --compilation-config '{"cudagraph_mode":"FULL_DECODE_ONLY"}'
done

for port in "${PREFILL_PORTS[@]}" "${DECODE_PORTS[@]}"; do
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    for pgid in "${pgids[@]}"; do
      kill -0 "$pgid" 2>/dev/null || { echo "an instance exited; see the logs in $LOG_DIR" >&2; exit 1; }
    done
    sleep 2
  done
  echo "127.0.0.1:$port ready"
done

# The guide's step 4, with this repository's proxy (one host per port, as there).
prefill_hosts=() decode_hosts=()
for _ in "${PREFILL_PORTS[@]}"; do prefill_hosts+=(127.0.0.1); done
for _ in "${DECODE_PORTS[@]}"; do decode_hosts+=(127.0.0.1); done
echo "model: $MODEL (the \"model\" field of requests); proxy on 127.0.0.1:$PROXY_PORT"
"$PYTHON" -m ucm.pd.proxy \
  --port "$PROXY_PORT" \
  --host 127.0.0.1 \
  --prefiller-hosts "${prefill_hosts[@]}" \
  --prefiller-ports "${PREFILL_PORTS[@]}" \
  --decoder-hosts "${decode_hosts[@]}" \
  --decoder-ports "${DECODE_PORTS[@]}" &
proxy_pid=$!
wait "$proxy_pid"  # in the background so that a SIGTERM to this script alone (not its group) runs the cleanup at once
