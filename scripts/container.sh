#!/usr/bin/env bash
# Builds and runs strata's container image with podman (docs/container.md).
#
#   scripts/container.sh build [--tag T] [--base IMAGE] [--mirror URL] [--from-build DIR] [--cuda]
#       From source (container/Containerfile; --cuda: container/Containerfile.cuda), or with
#       --from-build from a build folder already made here (container/Containerfile.installed:
#       only the run-time stage, in a minute or two; a CUDA build's image carries the CUDA
#       libraries it loads). Default tag: strata:latest (strata:cuda with --cuda).
#   scripts/container.sh run [--tag T] [PODMAN-RUN-FLAGS...] -- COMMAND...
#       podman run --rm of the image, with what this host needs (see below).
#
# The base image: --base, else Debian 12 from the registry; where no registry can be reached, a
# minimal Debian 12 made from Debian's own packages with mmdebstrap (from --mirror, default
# http://deb.debian.org/debian) and imported as localhost/strata-debian:bookworm (made once, then
# reused).
#
# Hosts whose root may not raise resource limits (no CAP_SYS_RESOURCE) make podman's default
# runtime fail with "setrlimit ... Operation not permitted", and crun refuses hosts with hybrid
# cgroups; `run` then uses runc with the host's open-file limit and says so. RUN steps of a build
# use chroot isolation, which needs neither.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "container.sh: $*" >&2; exit 1; }
command -v podman >/dev/null || die "podman is not installed (scripts/install-deps.sh --with-container)"

base_image() {  # $1: the --base given, or ""; $2: the Debian mirror
  if [ -n "$1" ]; then echo "$1"; return; fi
  local registry=docker.io/library/debian:bookworm local_base=localhost/strata-debian:bookworm
  if podman image exists "$registry"; then echo "$registry"; return; fi
  if podman image exists "$local_base"; then echo "$local_base"; return; fi
  if podman pull -q "$registry" >/dev/null 2>&1; then echo "$registry"; return; fi
  command -v mmdebstrap >/dev/null ||
    die "cannot pull $registry and mmdebstrap is not installed to make a base from Debian's packages (scripts/install-deps.sh --with-container), or give --base IMAGE"
  echo "container.sh: cannot pull $registry; making $local_base from Debian's packages (mmdebstrap, about 2 minutes)" >&2
  mmdebstrap --quiet --variant=minbase bookworm - "$2" </dev/null |
    podman import --quiet - "$local_base" >/dev/null ||
    die "mmdebstrap could not make a Debian 12 base from $2 (is it reachable? --mirror names another)"
  echo "$local_base"
}

build() {
  local tag="" base="" mirror=http://deb.debian.org/debian from_build="" file=container/Containerfile context=.
  while [ $# -gt 0 ]; do
    case "$1" in
      --tag) tag=${2:?--tag needs a value}; shift 2 ;;
      --base) base=${2:?--base needs a value}; shift 2 ;;
      --mirror) mirror=${2:?--mirror needs a URL}; shift 2 ;;
      --from-build) from_build=${2:?--from-build needs a build folder}; shift 2 ;;
      --cuda) file=container/Containerfile.cuda; shift ;;
      *) die "build: unknown flag '$1' (known: --tag, --base, --mirror, --from-build, --cuda)" ;;
    esac
  done
  [ -n "$tag" ] || tag=$([ "$file" = container/Containerfile.cuda ] && echo strata:cuda || echo strata:latest)
  local stage=""
  if [ -n "$from_build" ]; then
    [ "$file" = container/Containerfile ] || die "--from-build makes the CPU image; build the CUDA one from source"
    [ -x "$from_build/bin/strata" ] || die "--from-build $from_build: no bin/strata there (build it first: scripts/build.sh)"
    # What the build was configured with: an image is for other machines and for production.
    local cache="$from_build/CMakeCache.txt"
    if grep -q '^STRATA_NATIVE:BOOL=ON' "$cache" 2>/dev/null; then
      echo "container.sh: warning: $from_build was built with STRATA_NATIVE=ON (for this machine's CPU): the image stops with an illegal instruction on a CPU without its instruction set; configure with -DSTRATA_NATIVE=OFF for an image to ship" >&2
    fi
    if grep -q '^STRATA_FAULT_INJECTION:BOOL=ON' "$cache" 2>/dev/null; then
      echo "container.sh: warning: $from_build has the fault-injection points compiled in (STRATA_FAULTS can trigger them); configure with -DSTRATA_FAULT_INJECTION=OFF for an image to ship" >&2
    fi
    stage=$(mktemp -d)
    trap "rm -rf '$stage'" EXIT
    cmake --install "$from_build" --prefix "$stage/opt/strata" >/dev/null
    mkdir -p "$stage/opt/strata/share/strata" "$stage/container"
    container/runtime-packages.sh "$stage/opt/strata" > "$stage/opt/strata/share/strata/runtime-packages.txt"
    # A CUDA build loads CUDA's run-time libraries (cudart, cuBLAS, NCCL), which are no Debian
    # package: the image carries the very files the build loads (install-runtime.sh registers
    # them with the dynamic linker).
    local foreign
    foreign=$(container/runtime-packages.sh --foreign "$stage/opt/strata")
    if [ -n "$foreign" ]; then
      mkdir -p "$stage/opt/strata/lib/foreign"
      while read -r lib; do cp -L "$lib" "$stage/opt/strata/lib/foreign/"; done <<<"$foreign"
      echo "container.sh: carrying $(wc -l <<<"$foreign") libraries from outside Debian ($(du -sh "$stage/opt/strata/lib/foreign" | cut -f1)): $(tr '\n' ' ' <<<"$foreign")" >&2
    fi
    cp container/install-runtime.sh "$stage/container/"
    file=container/Containerfile.installed context=$stage
  fi
  base=$(base_image "$base" "$mirror")
  echo "container.sh: building $tag from $file on $base" >&2
  podman build --isolation chroot --build-arg "BASE=$base" -f "$PWD/$file" -t "$tag" "$context"
  podman image inspect --format '{{.Id}} {{.Size}}' "$tag" |
    awk -v t="$tag" '{printf "container.sh: built %s (%s, %.0f MB)\n", t, substr($1, 1, 12), $2 / 1e6}' >&2
}

run() {
  local tag=strata:latest flags=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    if [ "$1" = "--tag" ]; then tag=${2:?--tag needs a value}; shift 2; else flags+=("$1"); shift; fi
  done
  [ "${1:-}" = "--" ] || die "run: give the command after --, e.g. run -- strata version"
  shift
  local err
  if err=$(podman run --rm "${flags[@]}" "$tag" true 2>&1); then
    exec podman run --rm "${flags[@]}" "$tag" "$@"
  fi
  case "$err" in
    *setrlimit*|*rlimit*|*"cgroups in hybrid mode"*)
      command -v runc >/dev/null || die "podman cannot start a container here ($err), and runc is not installed (scripts/install-deps.sh --with-container)"
      echo "container.sh: podman's default runtime cannot start containers on this host (resource limits it may not raise, or hybrid cgroups); running with runc and the host's open-file limit" >&2
      exec podman run --rm --runtime runc --ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" \
        --ulimit nproc=4096:4096 "${flags[@]}" "$tag" "$@" ;;  # a limit runc may always set
    *) die "podman cannot start $tag: $err" ;;
  esac
}

case "${1:-}" in
  build) shift; build "$@" ;;
  run) shift; run "$@" ;;
  -h|--help|"") sed -n '2,/^set -euo/p' "$0" | sed '$d'; [ -n "${1:-}" ] ;;
  *) die "unknown command '$1' (known: build, run)" ;;
esac
