"""Turn `model.path` into a HF folder: a real checkpoint, or `tiny://<family>` built once and cached."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlfactory_megatron.models.tiny import make_tiny_hf_model

TINY_SCHEME = "tiny://"


def cache_root() -> Path:
    return Path(os.environ.get("RLF_CACHE_HOME", Path.home() / ".cache" / "rlfactory_megatron"))


def make_tiny_tokenizer(family: str):
    """A chat tokenizer trained on the built-in task's text, sized to fit the tiny model's vocab."""
    from rlfactory_megatron.models.tiny_tokenizer import LLAMA3_TEMPLATE, QWEN_TEMPLATE, train_chat_tokenizer
    from rlfactory_megatron.trainer.tasks import tokenizer_corpus

    if family == "llama":
        return train_chat_tokenizer(LLAMA3_TEMPLATE, eos="<|eot_id|>", bos="<|begin_of_text|>",
                                    corpus=tokenizer_corpus(), vocab_size=480)
    return train_chat_tokenizer(QWEN_TEMPLATE, eos="<|im_end|>", corpus=tokenizer_corpus(), vocab_size=480)


def resolve_model_path(path: str) -> Path:
    if path.startswith(TINY_SCHEME):
        family = path[len(TINY_SCHEME):]
        target = cache_root() / "tiny" / family
        if not (target / "config.json").is_file():
            # Build beside, then rename: concurrent ranks never see a half-written model.
            staging = target.with_name(f".{family}.{os.getpid()}")
            make_tiny_hf_model(family, staging)
            make_tiny_tokenizer(family).save_pretrained(staging)
            try:
                staging.rename(target)
            except OSError:  # another process won the race; its model is identical
                shutil.rmtree(staging, ignore_errors=True)
        return target
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model.path='{path}' is not a Hugging Face model folder (no config.json); "
                         f"give a local folder or {TINY_SCHEME}<llama|qwen2|qwen3>")
    return folder
