"""Packaging for rlfactory-megatron.

kernels/, envs/ and rewards/ are top-level folders in the repository but install
inside the `rlfactory_megatron` namespace: PyPI already has packages named
`kernels` (probed by transformers) and `envs`, which a bare import would shadow.
"""
from setuptools import find_packages, setup

_SUBTREES = ("kernels", "envs", "rewards")


def _packages() -> list[str]:
    packages = find_packages(include=["rlfactory_megatron", "rlfactory_megatron.*"])
    for subtree in _SUBTREES:
        packages.append(f"rlfactory_megatron.{subtree}")
        packages += [f"rlfactory_megatron.{subtree}.{p}" for p in find_packages(where=subtree)]
    return packages


setup(
    name="rlfactory-megatron",
    version="0.1.0",
    description="Megatron-Core RL backend for training tool-using LLM agents",
    python_requires=">=3.10",
    packages=_packages(),
    package_dir={f"rlfactory_megatron.{s}": s for s in _SUBTREES},
    package_data={"rlfactory_megatron": ["config/*.yaml", "config/examples/*.yaml"]},
    include_package_data=True,
    install_requires=["torch>=2.6", "megatron-core>=0.16", "omegaconf>=2.3", "psutil", "safetensors", "transformers"],
    entry_points={
        "console_scripts": [
            "rlf-train=rlfactory_megatron.cli.train:main",
            "rlf-convert=rlfactory_megatron.cli.convert:main",
            "rlf-bench=rlfactory_megatron.cli.bench:main",
            "rlf-cache=rlfactory_megatron.cli.cache:main",
        ]
    },
)
