#!/usr/bin/env bash
# 1P1D on loopback with the demo model (see start_pd.sh).
exec bash "$(dirname "$0")/start_pd.sh" 1 1
