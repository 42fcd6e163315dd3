#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: run the kernel tests natively, then the kernel benchmark (Triton gather/scatter
# vs a device-to-device torch copy of the same bytes), and print a short table. Takes well under 5 minutes.
# Usage: benchmarks/gpu.sh [python]   (default: .venv/bin/python if present, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"

"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible to torch")'
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)'

echo "== kernel tests (native CUDA + interpreter + CPU) =="
timeout 180 "$PY" -m pytest tests/kernels -q -p no:cacheprovider -x

echo "== pytest-benchmark of every block-copy op and GPU layout (FLASH_NHD, MLA) =="
timeout 120 "$PY" -m pytest benchmarks/ --benchmark-only -q -p no:cacheprovider --bench-device cuda

echo "== kernel benchmark: Triton vs device-to-device copy =="
out="$(mktemp)"
timeout 240 "$PY" benchmarks/kernels.py --device cuda --repeats 20 | tee "$out"
echo "== summary (ratio = kernel GB/s / copy GB/s; targets: >= 0.9 at 64 MiB+, >= 0.5 at 16 blocks) =="
tail -n 1 "$out" | "$PY" -c '
import json, sys
res = json.loads(sys.stdin.read())["results"]
print(f"{\"case\":45} {\"MiB\":>8} {\"GB/s\":>8} {\"copy\":>8} {\"ratio\":>6}")
for k, r in res.items():
    print(f"{k:45} {r[\"bytes\"] / 2**20:8.1f} {r[\"gbps\"]:8} {r[\"copy_gbps\"]:8} {r[\"ratio\"]:6}")
'
