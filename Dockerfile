# The GPU stack as an image: CUDA 13.0 toolkit and cuDNN (Transformer-Engine's PyTorch extension
# compiles against them; torch 2.13 from PyPI is a CUDA 13.0 build), Python 3.12, exactly
# requirements/gpu.lock through ./install.sh --gpu, and this package. docs/install.md: build, push,
# run with docker, enroot/pyxis (Slurm) and Apptainer.
#   docker build -t rlfactory-megatron:gpu .
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda
# Ubuntu 24.04's Python is 3.12, the lock's; bubblewrap is the python tool's sandbox; Open MPI is
# what mpi4py's wheel loads (clusters may bind their own instead).
RUN apt-get update && apt-get install -y --no-install-recommends \
      python3.12 python3.12-venv python3.12-dev build-essential git bubblewrap openmpi-bin libopenmpi-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/rlfactory-megatron
COPY . .
# The build host has no GPU: install.sh's driver check is for machines that run the stack. TE's
# kernels are compiled for these architectures (Ampere, Hopper, Blackwell); narrow it to build faster.
ARG NVTE_CUDA_ARCHS="80;90;100"
RUN RLF_BUILD_WITHOUT_GPU=1 PYTHON=python3.12 NVTE_CUDA_ARCHS="$NVTE_CUDA_ARCHS" ./install.sh --gpu
ENV PATH=/opt/rlfactory-megatron/.venv/bin:$PATH
