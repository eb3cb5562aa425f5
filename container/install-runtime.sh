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
libs=$(ldd /opt/strata/bin/strata)
if echo "$libs" | grep "not found"; then
  echo "install-runtime.sh: strata lacks the libraries above" >&2
  exit 1
fi
# A CUDA build opens cuBLAS on its first GPU op (dlopen: ldd does not show it).
cudart=$(echo "$libs" | sed -n 's/^[[:space:]]*libcudart\.so\.\([0-9]*\) .*/\1/p')
if [ -n "$cudart" ] && ! ldconfig -p | grep -q "libcublas\.so\.$cudart "; then
  echo "install-runtime.sh: strata loads CUDA $cudart's runtime, but no libcublas.so.$cudart is registered with the dynamic linker" >&2
  exit 1
fi
