#!/usr/bin/env bash
# 2P2D on loopback with the demo model, the seed guide's ports: prefill on 7800-7801, decode on 7802-7803, proxy on
# 7805 (see start_pd.sh).
exec bash "$(dirname "$0")/start_pd.sh"
