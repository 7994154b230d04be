#!/usr/bin/env bash
# Headless browser for tests/integration/test_dashboard_browser.py: Debian's Chromium (/usr/bin/chromium)
# and the Playwright Python package in .venv. Idempotent. Never runs `playwright install` (that downloads
# a browser); the tests launch /usr/bin/chromium through executable_path instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"

if [ ! -x /usr/bin/chromium ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium
fi

if ! "$VENV/bin/python" -c "import playwright" 2>/dev/null; then
  "$VENV/bin/pip" install -q playwright
fi

echo "browser ok: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium); playwright $("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("playwright"))')"
