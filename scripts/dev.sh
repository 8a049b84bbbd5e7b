#!/usr/bin/env bash
# One entry point for a fresh machine: installs what it needs, then runs the job.
#   bash scripts/dev.sh demo    # the main job: a serving workload on the embedded default store
#   bash scripts/dev.sh test    # the whole test suite: compiled core, then a compiler-less install
#   bash scripts/dev.sh bench   # the side-by-side benchmark (mooncake_keys bench)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}

install_system() {
  # The Mooncake wheel links libibverbs even in its non-CUDA build (plus libcurl and libnuma).
  if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 libcurl4 libnuma1 >/dev/null
    else
      echo "warning: libibverbs1 is missing (apt-get install libibverbs1); Mooncake will be unavailable" >&2
    fi
  fi
}

install_python() {  # $1: the extras to install
  # torch 2.13.0 is the CPU build on this machine's disk; other versions pull gigabytes.
  "$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
  MOONCAKE_KEYS_FORCE_EXTENSIONS=1 "$PY" -m pip install -q --disable-pip-version-check -e ".[$1]"
}

run_pytest() {
  # pytest exits 5 when it collected nothing: that is a failure here, never a pass.
  local rc=0
  "$PY" -m pytest "$@" || rc=$?
  if [ "$rc" = 5 ]; then echo "error: pytest ran no test" >&2; return 1; fi
  return "$rc"
}

masters() { pgrep -x mooncake_master | sort || true; }

no_master_left() {  # $1: the masters that were running before the suite
  local left; left=$(comm -13 <(echo "$1") <(masters) | grep . || true)
  if [ -n "$left" ]; then
    echo "error: the suite left mooncake_master running:" >&2; ps -o pid,etime,cmd -p $left >&2; return 1
  fi
}

cmd_test() {
  install_system
  install_python mooncake,test
  echo "== 1/2: compiled core (the guard test fails if it did not load)"
  "$PY" -c 'import mooncake_keys as mk; print("ACCELERATED =", mk.ACCELERATED)'
  local before; before=$(masters)
  run_pytest -q -p no:cacheprovider tests
  no_master_left "$before"
  echo "== 2/2: a fresh venv, installed with no usable compiler (CC=false): the whole suite on pure Python"
  local tmp; tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$tmp"
  "$PY" -m venv "$tmp/venv"
  local V="$tmp/venv/bin/python"
  "$V" -m pip install -q --disable-pip-version-check torch==2.13.0
  (cd "$tmp" && CC=false "$V" -m pip install -v --disable-pip-version-check ".[mooncake,test]" \
      >"$tmp/install.log" 2>&1) || { cat "$tmp/install.log"; return 1; }
  grep -q "falls back to pure Python" "$tmp/install.log" || { echo "error: expected the pure-Python fallback warning" >&2; cat "$tmp/install.log"; return 1; }
  rm -rf "$tmp/mooncake_keys"  # only the installed copy may be imported
  (cd "$tmp" && CC=false "$V" -c 'import mooncake_keys as mk, sys; print("ACCELERATED =", mk.ACCELERATED, mk.__file__); sys.exit(mk.ACCELERATED)')
  (cd "$tmp" && PY="$V" CC=false run_pytest -q -p no:cacheprovider -m "not c_extension" tests)
  no_master_left "$before"
}

cmd_demo() {
  install_system
  install_python mooncake
  "$PY" -m mooncake_keys demo "$@"
}

cmd_bench() {
  install_system
  install_python mooncake,bench
  "$PY" -m mooncake_keys bench "$@"
}

case "${1:-}" in
  test) shift; cmd_test "$@" ;;
  demo) shift; cmd_demo "$@" ;;
  bench) shift; cmd_bench "$@" ;;
  install) install_system; install_python mooncake,test,bench ;;
  *) echo "usage: bash scripts/dev.sh {demo|test|bench|install}" >&2; exit 2 ;;
esac
