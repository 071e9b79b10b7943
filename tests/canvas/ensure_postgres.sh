#!/usr/bin/env bash
# Make sure Debian's PostgreSQL server binaries are installed for the PostgreSQL store tests.
#
# The tests start their own throwaway server (tests/canvas/pgserver.py: initdb + pg_ctl on a free loopback port);
# they only need the binaries. This installs the `postgresql` package with apt when they are missing (CI runs as
# root; elsewhere sudo -n is tried). It never fails the build: if PostgreSQL cannot be installed it says why, and
# the PostgreSQL tests then skip with that reason.
# Usage: bash tests/canvas/ensure_postgres.sh
set -uo pipefail

if command -v pg_ctl >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null; then
  echo "ensure_postgres: PostgreSQL is present"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_postgres: PostgreSQL is missing and there is no apt-get; the PostgreSQL tests will be skipped" >&2
  exit 0
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "ensure_postgres: PostgreSQL is missing and installing it needs root; the PostgreSQL tests will be skipped" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
echo "ensure_postgres: installing postgresql with apt-get"
if ! "${SUDO[@]}" apt-get update -qq; then
  echo "ensure_postgres: apt-get update failed; the PostgreSQL tests will be skipped" >&2
  exit 0
fi
# Only the binaries: the package's own cluster is not used (the tests run their own), so it is not started here.
if ! "${SUDO[@]}" apt-get install -y -qq --no-install-recommends postgresql >/dev/null; then
  echo "ensure_postgres: apt-get install postgresql failed; the PostgreSQL tests will be skipped" >&2
  exit 0
fi
echo "ensure_postgres: installed $(compgen -G "/usr/lib/postgresql/*/bin/postgres" | tail -1)"
exit 0
