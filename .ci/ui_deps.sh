#!/usr/bin/env bash
# What the MLflow UI test needs from Debian: Chromium (driven headless by Playwright, which is a
# dev dependency; no browser download). Idempotent; needs root to install.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "ui_deps.sh: must run as root (apt-get install chromium)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null
echo "ui_deps.sh: installed $(chromium --version 2>/dev/null | head -1)"
