#!/usr/bin/env bash
# Installs tierchat with the MLX backend this machine can run, its test tools and the demo
# model packages:
#   an NVIDIA GPU that `nvidia-smi -L` lists  -> pip install -e ".[cuda,dev,demo]" (mlx-cuda-13)
#   Linux otherwise                           -> libopenblas0-pthread (apt; MLX's CPU matmuls
#                                                run ~20x faster through it), then ".[cpu,dev,demo]"
#   macOS                                     -> ".[dev,demo]" (mlx's Metal backend)
# mlx-cpu and mlx-cuda-13 both ship mlx/lib/libmlx.so (the last one installed wins), so the
# other backend's package is uninstalled first and the chosen one reinstalled after it.
# TIERCHAT_BACKEND=cpu|cuda|metal overrides the choice; TIERCHAT_SETUP_DRY_RUN=1 prints the
# choice ("backend=... extras=...") and the commands ("+ ...") without running them.
set -euo pipefail
cd "$(dirname "$0")/.."

dry="${TIERCHAT_SETUP_DRY_RUN:-}"
run() {
  if [ -n "$dry" ]; then echo "+ $*"; else "$@"; fi
}

pick_backend() {
  if [ -n "${TIERCHAT_BACKEND:-}" ]; then
    echo "$TIERCHAT_BACKEND"
  elif [ "$(uname -s)" = "Darwin" ]; then
    echo metal
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo cuda
  else
    echo cpu
  fi
}

backend="$(pick_backend)"
case "$backend" in
  cuda) extras="cuda,dev,demo"; wanted="mlx-cuda-13"; others="mlx-cpu mlx-cuda-12" ;;
  cpu) extras="cpu,dev,demo"; wanted="mlx-cpu"; others="mlx-cuda-13 mlx-cuda-12" ;;
  metal) extras="dev,demo"; wanted=""; others="" ;;
  *) echo "error: TIERCHAT_BACKEND=$backend: expected cpu, cuda or metal" >&2; exit 2 ;;
esac
echo "backend=$backend extras=$extras"

if [ "$backend" = "cpu" ] && [ "$(uname -s)" = "Linux" ] \
   && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
   && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  if [ -n "$dry" ]; then
    echo "+ $SUDO apt-get install -y -qq libopenblas0-pthread"
  else
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null; } \
      || echo "warning: could not install libopenblas0-pthread; MLX will use its slow reference BLAS" >&2
  fi
fi

switched=""
for pkg in $others; do
  if python3 -m pip show -q "$pkg" >/dev/null 2>&1; then
    run python3 -m pip uninstall -y -q "$pkg"
    switched=1
  fi
done
run python3 -m pip install -q -e ".[$extras]"
if [ -n "$switched" ] && [ -n "$wanted" ]; then
  # the uninstall above removed the libmlx.so that both packages list: put it back
  version="$(python3 -m pip show mlx 2>/dev/null | sed -n 's/^Version: //p')"
  run python3 -m pip install -q --force-reinstall --no-deps "$wanted==${version:-0.32.4}"
fi
