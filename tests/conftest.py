"""Suite-wide fixtures: tiny random-weight HF checkpoints built once per session (no downloads)."""
import os

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
