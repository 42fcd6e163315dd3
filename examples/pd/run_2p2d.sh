#!/usr/bin/env bash
# 2P2D on loopback with the demo model (see start_pd.sh).
exec bash "$(dirname "$0")/start_pd.sh" 2 2
