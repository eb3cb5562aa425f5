#!/bin/sh
# Installs, in an image, the Debian packages /opt/strata/share/strata/runtime-packages.txt lists
# (container/runtime-packages.sh wrote it where strata was built) and registers the libraries in
# /opt/strata/lib/foreign, then checks that `strata` finds every library it loads.
set -eu
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
xargs -a /opt/strata/share/strata/runtime-packages.txt \
  apt-get install -y -qq --no-install-recommends ca-certificates
rm -rf /var/lib/apt/lists/*
# Libraries from outside Debian that a build loads (a CUDA build's cudart, cuBLAS, NCCL).
if [ -d /opt/strata/lib/foreign ]; then
  echo /opt/strata/lib/foreign > /etc/ld.so.conf.d/strata-foreign.conf
  ldconfig
fi
if ldd /opt/strata/bin/strata | grep "not found"; then
  echo "install-runtime.sh: strata lacks the libraries above" >&2
  exit 1
fi
