# Sourced by the tests/*/ensure_*.sh scripts, which install a Debian package that a group of tests needs.
#
# apt_install NAME MISSING TESTS PACKAGE [apt-get install options...]
#   installs PACKAGE with apt-get (CI runs as root; elsewhere sudo -n is tried) and returns 0; where it cannot, it
#   says why on stderr ("NAME: MISSING is missing and ...; TESTS will be skipped") and returns 1. It never exits:
#   the caller decides, and the ensure scripts never fail the build.
apt_install() {
  local name=$1 missing=$2 tests=$3 package=$4
  shift 4
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "$name: $missing is missing and there is no apt-get; $tests will be skipped" >&2
    return 1
  fi
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo=(sudo -n)
    else
      echo "$name: $missing is missing and installing it needs root; $tests will be skipped" >&2
      return 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  echo "$name: installing $package with apt-get"
  if ! "${sudo[@]}" apt-get update -qq; then
    echo "$name: apt-get update failed; $tests will be skipped" >&2
    return 1
  fi
  if ! "${sudo[@]}" apt-get install -y -qq "$@" "$package" >/dev/null; then
    echo "$name: apt-get install $package failed; $tests will be skipped" >&2
    return 1
  fi
}
