#!/usr/bin/env bash
# Make sure Debian's Chromium is at /usr/bin/chromium for the browser tests in tests/web.
#
# Playwright cannot download its own browser builds here, so the tests drive the distribution's Chromium. This
# installs it with apt when it is missing (tests/apt_install.sh). It never fails the build: if Chromium cannot be
# installed it says why, and the browser tests then skip with that reason.
# Usage: bash tests/web/ensure_chromium.sh
set -uo pipefail
source "$(dirname "$0")/../apt_install.sh"

CHROMIUM=${DCANVAS_CHROMIUM:-/usr/bin/chromium}

if [ -x "$CHROMIUM" ]; then
  echo "ensure_chromium: $CHROMIUM is present"
  exit 0
fi
apt_install ensure_chromium "$CHROMIUM" "the browser tests" chromium || exit 0
if [ -x "$CHROMIUM" ]; then
  echo "ensure_chromium: installed $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
else
  echo "ensure_chromium: apt installed chromium but $CHROMIUM is still missing; the browser tests will be skipped" >&2
fi
exit 0
