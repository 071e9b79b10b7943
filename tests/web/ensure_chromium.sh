#!/usr/bin/env bash
# Make sure Debian's Chromium is at /usr/bin/chromium for the browser tests in tests/web.
#
# Playwright cannot download its own browser builds here, so the tests drive the distribution's Chromium. This
# installs it with apt when it is missing (CI runs as root; elsewhere sudo -n is tried). It never fails the build:
# if Chromium cannot be installed it says why, and the browser tests then skip with that reason.
# Usage: bash tests/web/ensure_chromium.sh
set -uo pipefail

CHROMIUM=${DCANVAS_CHROMIUM:-/usr/bin/chromium}

if [ -x "$CHROMIUM" ]; then
  echo "ensure_chromium: $CHROMIUM is present"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_chromium: $CHROMIUM is missing and there is no apt-get; the browser tests will be skipped" >&2
  exit 0
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "ensure_chromium: $CHROMIUM is missing and installing it needs root; the browser tests will be skipped" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
echo "ensure_chromium: installing chromium with apt-get"
if ! "${SUDO[@]}" apt-get update -qq; then
  echo "ensure_chromium: apt-get update failed; the browser tests will be skipped" >&2
  exit 0
fi
if ! "${SUDO[@]}" apt-get install -y -qq chromium >/dev/null; then
  echo "ensure_chromium: apt-get install chromium failed; the browser tests will be skipped" >&2
  exit 0
fi
if [ -x "$CHROMIUM" ]; then
  echo "ensure_chromium: installed $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
else
  echo "ensure_chromium: apt installed chromium but $CHROMIUM is still missing; the browser tests will be skipped" >&2
fi
exit 0
