"""Fixtures for the envs tests: the small Qwen- and Llama-3-style tokenizers (Ray comes from tests/conftest.py)."""
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Test helper modules of this folder (rlf_fault_tools) import by name, here and in Ray workers.

from rlfactory_megatron.models.tiny_tokenizer import LLAMA3_TEMPLATE, QWEN_TEMPLATE, train_chat_tokenizer


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return train_chat_tokenizer(QWEN_TEMPLATE, eos="<|im_end|>", bos=None)


@pytest.fixture(scope="session")
def llama3_tokenizer():
    return train_chat_tokenizer(LLAMA3_TEMPLATE, eos="<|eot_id|>", bos="<|begin_of_text|>")

