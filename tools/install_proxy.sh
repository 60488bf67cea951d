#!/usr/bin/env bash
# Install configurable-http-proxy (JupyterHub's default proxy, from the npm registry) into the
# venv for the multi-user hub test (tests/browser/test_hub.py); nothing is committed. The exact
# version is pinned here (its own dependencies are pinned to patch releases by its package.json).
# Without npm the step is skipped with a warning (a student running `make lab` needs no Node.js);
# the test then skips, except under CI, where it fails.
set -euo pipefail
CHP_VERSION=5.3.0
venv="${1:-.venv}"
prefix="$venv/share/onemask-chp"
installed="$prefix/node_modules/configurable-http-proxy/package.json"
if [ -f "$installed" ] && grep -q "\"version\": \"$CHP_VERSION\"" "$installed"; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "warning: npm not found, so configurable-http-proxy is not installed and the hub test will skip" >&2
  exit 0
fi
echo "installing configurable-http-proxy $CHP_VERSION for the hub test (npm)"
mkdir -p "$prefix"
npm install --prefix "$prefix" --no-save --no-audit --no-fund --loglevel=error \
  "configurable-http-proxy@$CHP_VERSION" >/dev/null
test -x "$prefix/node_modules/.bin/configurable-http-proxy"
