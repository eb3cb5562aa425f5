#!/usr/bin/env bash
# Installs the Debian packages that strata's build, tests and examples need.
#
#   scripts/install-deps.sh              build + tests + default example
#   scripts/install-deps.sh --with-torch also python3-torch (baseline of bench_moe_layer)
#   scripts/install-deps.sh --with-plots also python3-matplotlib (bench/compare_moe.py's figure)
#   scripts/install-deps.sh --with-browser also chromium (the dashboard's test opens the page in it)
#   scripts/install-deps.sh --with-container also podman, runc and mmdebstrap (the image:
#                                         scripts/container.sh) and python3-yaml (its recipe check)
#
# Idempotent: packages already installed are skipped, and `apt-get update` runs at most once per
# call (only when something is missing). Works as root or through sudo.
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  libabsl-dev
  libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc
  libmicrohttpd-dev       # the HTTP endpoint: dashboard, /metrics (web/)
  gnuplot-nox             # strata plot
  liburing-dev librocksdb-dev fio
  libgloo-dev
  libopenblas-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  fortunes              # corpus of the default example (examples/moe_lm)
  openssl               # the coordinator's TLS test makes its certificate with it
  python3
  python3-numpy           # tests/checkpoint/safetensors_forward.py: the export's independent reader
  patchelf xz-utils file  # scripts/package.sh: RUNPATH, the tarball, telling binaries apart
  universal-ctags         # scripts/code-sizes.sh: where each function ends
  clang                   # scripts/check-locking.sh: the thread-safety analysis
)

for arg in "$@"; do
  case "$arg" in
    --with-torch) packages+=(python3-torch) ;;
    --with-plots) packages+=(python3-matplotlib) ;;
    --with-browser) packages+=(chromium) ;;
    --with-container) packages+=(podman runc mmdebstrap python3-yaml) ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install-deps.sh: unknown option '$arg' (known: --with-torch, --with-plots, --with-browser, --with-container)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  sudo_cmd=()
elif command -v sudo >/dev/null 2>&1; then
  sudo_cmd=(sudo)
else
  echo "install-deps: need root or sudo to install: ${missing[*]}" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
