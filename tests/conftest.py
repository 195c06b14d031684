"""Suite-wide fixtures: tiny random-weight HF checkpoints built once per session (no downloads)."""
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# One checkpoint per supported family, each with the feature that family adds:
# llama: Llama-3 rope scaling; qwen2: qkv bias + a vocab that megatron must pad; qwen3: q/k norm + tied embeddings.
TINY_VARIANTS = {
    "llama": dict(),
    "qwen2": dict(vocab_size=500),
    "qwen3": dict(tie_word_embeddings=True),
}


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory):
    from rlfactory_megatron.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny_hf")
    return {name: str(make_tiny_hf_model(name, root / name, **kw)) for name, kw in TINY_VARIANTS.items()}


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole suite (a second ray.init in the same process would fail).

    Ray workers import the envs tests' helper tools by name, hence tests/envs on their path.
    """
    import ray

    if not ray.is_initialized():
        envs_tests = str(Path(__file__).resolve().parent / "envs")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": envs_tests}})
    yield ray
    ray.shutdown()
