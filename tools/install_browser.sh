#!/usr/bin/env bash
# Make sure a Chromium exists for the browser tests. Order: one already installed (Debian's
# /usr/bin/chromium, or $ONEMASK_CHROMIUM); as root with apt, Debian's `chromium` package;
# otherwise Playwright's own build (`playwright install chromium`, needs its download host).
set -euo pipefail
venv_bin="${1:-.venv/bin}"
if [ -n "${ONEMASK_CHROMIUM:-}" ] && [ -x "$ONEMASK_CHROMIUM" ]; then
  exit 0
fi
if command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's chromium for the browser tests (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  exit 0
fi
echo "installing Playwright's chromium for the browser tests"
"$venv_bin/playwright" install chromium
