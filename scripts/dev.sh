#!/usr/bin/env bash
# One entry point for a fresh machine: installs what it needs, then runs the job.
#   bash scripts/dev.sh demo    # the main job: a serving workload on the embedded default store
#   bash scripts/dev.sh test    # the whole test suite: both cores, real Mooncake, real vLLM 0.33 / 0.25
#   bash scripts/dev.sh bench   # the side-by-side benchmark (mooncake_keys bench), vLLM 0.33 beside
#
# Everything Python goes into the project venv .venv (never the system interpreter). The vLLM
# releases the tests compare against live in their own venvs under $MOONCAKE_KEYS_CACHE
# (default ~/.cache/mooncake_keys), built once and reused; each sees the project venv through a
# .pth file, so torch and Mooncake are installed once.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE_PY=${PYTHON:-python3}
VENV=$ROOT/.venv
PY=$VENV/bin/python
CACHE=${MOONCAKE_KEYS_CACHE:-$HOME/.cache/mooncake_keys}
PIP_FLAGS=(-q --disable-pip-version-check)
# torch 2.13.0 is the CPU build on this machine's disk; a newer one would pull gigabytes.
TORCH=torch==2.13.0
VLLM_IMPORT=vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker
# Bump when the recipe of a vLLM venv changes: a cached venv of another recipe is rebuilt.
VLLM_VENV_RECIPE=2

install_system() {
  # The Mooncake wheel links libibverbs even in its non-CUDA build (plus libcurl and libnuma);
  # etcd runs the Mooncake HA tests.
  local need=()
  ldconfig -p | grep -q 'libibverbs.so.1 ' || need+=(libibverbs1 libcurl4 libnuma1)
  command -v etcd >/dev/null || need+=(etcd-server)
  [ ${#need[@]} = 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "warning: missing system packages (${need[*]}): apt-get install them; Mooncake parts will be unavailable" >&2
  fi
}

ensure_venv() {
  [ -x "$PY" ] || "$BASE_PY" -m venv "$VENV"
}

install_python() {  # $1: the extras; $2 (optional): 1 to make a failed compile fatal
  ensure_venv
  "$PY" -m pip install "${PIP_FLAGS[@]}" "$TORCH"
  MOONCAKE_KEYS_FORCE_EXTENSIONS=${2:-} "$PY" -m pip install "${PIP_FLAGS[@]}" -e ".[$1]"
}

vllm_requirements() {  # $1: a vLLM wheel; prints the light requirements its lookup code imports
  "$PY" - "$1" <<'EOF'
import re, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
# GPU kernels, CUDA, multimedia and torch itself stay out: the lookup code does not import them.
skip = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer|apache-tvm|tilelang|"
                  r"nvidia|nvtx|fastsafetensors|instanttensor|quack|tokenspeed|humming|numba|opencv|mistral.common|"
                  r"compressed-tensors|depyf|outlines.core|lm-format|anthropic|mcp|opentelemetry|model-hosting)",
                  re.I)
for line in wheel.read(meta).decode().splitlines():
    if line.startswith("Requires-Dist: ") and "extra ==" not in line:
        req = line[len("Requires-Dist: "):]
        if not skip.match(req):
            print(req)
EOF
}

vllm_venv() {  # $1: a vLLM version; makes (once) and prints the path of its venv
  local ver=$1 dir="$CACHE/vllm-$1" site
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ "$(cat "$dir/.mooncake_keys-ready" 2>/dev/null)" != "recipe $VLLM_VENV_RECIPE" ]; then
    echo "== building the vLLM $ver test venv in $dir (once; a few minutes)" >&2
    rm -rf "$dir"
    mkdir -p "$CACHE/wheels"
    "$BASE_PY" -m venv "$dir"
    write_pth "$dir" "$site"
    ls "$CACHE"/wheels/vllm-"$ver"-*.whl >/dev/null 2>&1 || "$PY" -m pip download "${PIP_FLAGS[@]}" --no-deps "vllm==$ver" -d "$CACHE/wheels" >&2
    local wheel; wheel=$(ls "$CACHE"/wheels/vllm-"$ver"-*.whl | head -1)
    "$dir/bin/pip" install "${PIP_FLAGS[@]}" --no-deps "$wheel" >&2
    vllm_requirements "$wheel" >"$dir/requirements-light.txt"
    "$dir/bin/pip" install "${PIP_FLAGS[@]}" -r "$dir/requirements-light.txt" >&2
    echo "recipe $VLLM_VENV_RECIPE" >"$dir/.mooncake_keys-ready"
  fi
  write_pth "$dir" "$site"  # this checkout's venv, wherever it is
  # pip counted the packages of the project venv that built this venv as installed; this
  # checkout's venv may lack some (a fresh clone has no asv, hence no PyYAML): add them here
  # (about 5 s when nothing is missing), then check vLLM's lookup code imports.
  "$dir/bin/pip" install "${PIP_FLAGS[@]}" -r "$dir/requirements-light.txt" >&2
  "$dir/bin/python" -c "import $VLLM_IMPORT" >/dev/null \
    || { echo "error: vLLM $ver's lookup code does not import in $dir" >&2; return 1; }
  echo "$dir"
}

write_pth() {  # $1: a vLLM venv, $2: the project venv's site-packages
  # addsitedir (not a bare path): the project venv's own .pth files run too (the editable install).
  local vsite; vsite=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$2')" >"$vsite/_mooncake_keys_project_venv.pth"
}

run_pytest() {  # $1: the python; the rest: pytest arguments
  # pytest exits 5 when it collected nothing: that is a failure here, never a pass.
  local py=$1; shift
  local rc=0
  "$py" -m pytest "$@" || rc=$?
  if [ "$rc" = 5 ]; then echo "error: pytest ran no test" >&2; return 1; fi
  return "$rc"
}

leftovers() { { pgrep -x mooncake_master; pgrep -x etcd; } | sort || true; }

nothing_left() {  # $1: the mooncake_master / etcd processes that were running before
  local left; left=$(comm -13 <(echo "$1") <(leftovers) | grep . || true)
  if [ -n "$left" ]; then
    echo "error: the suite left processes running:" >&2; ps -o pid,etime,cmd -p $left >&2; return 1
  fi
}

cmd_test() {
  install_system
  install_python mooncake,test 1
  local before; before=$(leftovers)
  echo "== 1/4: compiled core (the guard test fails if it did not load)"
  "$PY" -c 'import mooncake_keys as mk; print("ACCELERATED =", mk.ACCELERATED)'
  MK_REQUIRE_REAL=1 run_pytest "$PY" -q -p no:cacheprovider tests --ignore=tests/against_vllm
  nothing_left "$before"
  local release
  for release in 0.33.0 0.25.1; do
    local v; v=$(vllm_venv "$release")
    echo "== ${release%.*}: against vLLM $release's own code, compiled core then MOONCAKE_KEYS_NO_EXTENSIONS=1"
    MK_REQUIRE_REAL=1 MK_REQUIRE_VLLM=$release run_pytest "$v/bin/python" -q -p no:cacheprovider tests/against_vllm
    MK_REQUIRE_REAL=1 MK_REQUIRE_VLLM=$release MOONCAKE_KEYS_NO_EXTENSIONS=1 run_pytest "$v/bin/python" -q -p no:cacheprovider tests/against_vllm
    nothing_left "$before"
  done
  echo "== 4/4: a fresh venv, installed with no usable compiler (CC=false): the whole suite on pure Python"
  local tmp; tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$tmp"
  "$BASE_PY" -m venv "$tmp/venv"
  local V="$tmp/venv/bin/python"
  "$V" -m pip install "${PIP_FLAGS[@]}" "$TORCH"
  (cd "$tmp" && CC=false "$V" -m pip install -v --disable-pip-version-check ".[mooncake,test]" \
      >"$tmp/install.log" 2>&1) || { cat "$tmp/install.log"; return 1; }
  grep -q "falls back to pure Python" "$tmp/install.log" || { echo "error: expected the pure-Python fallback warning" >&2; cat "$tmp/install.log"; return 1; }
  rm -rf "$tmp/mooncake_keys"  # only the installed copy may be imported
  (cd "$tmp" && CC=false "$V" -c 'import mooncake_keys as mk, sys; print("ACCELERATED =", mk.ACCELERATED, mk.__file__); sys.exit(mk.ACCELERATED)')
  (cd "$tmp" && CC=false MK_REQUIRE_REAL=1 run_pytest "$V" -q -p no:cacheprovider -m "not c_extension" tests --ignore=tests/against_vllm)
  nothing_left "$before"
}

cmd_demo() {
  install_system
  install_python mooncake
  "$PY" -m mooncake_keys demo "$@"
}

cmd_bench() {
  install_system
  install_python mooncake,bench
  local v; v=$(vllm_venv 0.33.0)
  "$v/bin/python" -m mooncake_keys bench "$@"
}

case "${1:-}" in
  test) shift; cmd_test "$@" ;;
  demo) shift; cmd_demo "$@" ;;
  bench) shift; cmd_bench "$@" ;;
  install) install_system; install_python mooncake,test,bench ;;
  *) echo "usage: bash scripts/dev.sh {demo|test|bench|install}" >&2; exit 2 ;;
esac
