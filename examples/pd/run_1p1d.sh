#!/usr/bin/env bash
# 1P1D on loopback with the demo model: prefill on 7800, decode on 7801, proxy on 7805 (see start_pd.sh).
PREFILL_PORTS=${PREFILL_PORTS:-7800} DECODE_PORTS=${DECODE_PORTS:-7801} exec bash "$(dirname "$0")/start_pd.sh"
