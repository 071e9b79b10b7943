#!/usr/bin/env bash
# Make sure Debian's PostgreSQL server binaries are installed for the PostgreSQL store tests.
#
# The tests start their own throwaway server (canvas/store/pgserver.py: initdb + pg_ctl on a free loopback port);
# they only need the binaries. This installs the `postgresql` package with apt when they are missing
# (tests/apt_install.sh). It never fails the build: if PostgreSQL cannot be installed it says why, and the
# PostgreSQL tests then skip with that reason.
# Usage: bash tests/canvas/ensure_postgres.sh
set -uo pipefail
source "$(dirname "$0")/../apt_install.sh"

if command -v pg_ctl >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null; then
  echo "ensure_postgres: PostgreSQL is present"
  exit 0
fi
# Only the binaries: the package's own cluster is not used (the tests run their own), so it is not started here.
apt_install ensure_postgres PostgreSQL "the PostgreSQL tests" postgresql --no-install-recommends || exit 0
echo "ensure_postgres: installed $(compgen -G "/usr/lib/postgresql/*/bin/postgres" | tail -1)"
exit 0
