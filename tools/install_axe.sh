#!/usr/bin/env bash
# Install axe-core (Deque's accessibility engine, from the npm registry) for the book's
# accessibility test (tests/browser/test_a11y.py), into the venv: nothing is committed and
# nothing is served to readers. axe-core has no dependencies; the exact version is pinned here.
# Without npm the step is skipped with a warning (a student running `make lab` needs no Node.js);
# the test then skips, except under CI, where it fails.
set -euo pipefail
AXE_VERSION=4.14.1
venv="${1:-.venv}"
prefix="$venv/share/onemask-axe"
installed="$prefix/node_modules/axe-core/package.json"
if [ -f "$installed" ] && grep -q "\"version\": \"$AXE_VERSION\"" "$installed"; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "warning: npm not found, so axe-core is not installed and the accessibility test will skip" >&2
  exit 0
fi
echo "installing axe-core $AXE_VERSION for the accessibility test (npm)"
mkdir -p "$prefix"
npm install --prefix "$prefix" --no-save --no-package-lock --no-audit --no-fund --loglevel=error \
  "axe-core@$AXE_VERSION" >/dev/null
test -f "$prefix/node_modules/axe-core/axe.min.js"
