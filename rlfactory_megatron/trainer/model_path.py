"""Turn `model.path` into a HF folder: a real checkpoint, or `tiny://<family>` built once and cached
(its tokenizer trained on the built-in task's text: tasks.py)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlfactory_megatron.models.tiny import make_tiny_hf_model

TINY_SCHEME = "tiny://"
TINY_VERSION = "v5"  # bump when the tiny model or tokenizer recipe changes
TINY_VOCAB_SIZE = 768  # the tokenizer's merges run out below it on the built-in task's text


def cache_root() -> Path:
    return Path(os.environ.get("RLF_CACHE_HOME", Path.home() / ".cache" / "rlfactory_megatron"))


def make_tiny_tokenizer(family: str, task: str = "calculator_arithmetic"):
    """A chat tokenizer trained on the built-in task's text, sized to fit the tiny model's vocab.

    Trained twice: the draft renders the task's whole conversations (tool schemas, role headers,
    tool responses) through the chat template, and the final one also learns that text, so the
    template's scaffolding costs few tokens."""
    import asyncio

    from rlfactory_megatron.envs.tools import ToolBox, parse_tool_specs
    from rlfactory_megatron.models.tiny_tokenizer import LLAMA3_TEMPLATE, QWEN_TEMPLATE, train_chat_tokenizer
    from rlfactory_megatron.trainer.tasks import TASKS, tokenizer_corpus

    if family == "llama":
        options = dict(chat_template=LLAMA3_TEMPLATE, eos="<|eot_id|>", bos="<|begin_of_text|>")
    else:
        options = dict(chat_template=QWEN_TEMPLATE, eos="<|im_end|>")
    # Merges cross words (numbers stay digit by digit): the template's scaffolding and the tool
    # schema, the same in every prompt, become a few long tokens, so a prompt is ~60 tokens, not
    # ~220, and the tiny model trains and generates ~3x faster on it.
    options.update(vocab_size=TINY_VOCAB_SIZE, split_words=False, split_digits=True)
    corpus = tokenizer_corpus(task)
    draft = train_chat_tokenizer(corpus=corpus, **options)
    spec = TASKS.get(task)
    schemas = asyncio.run(ToolBox.build(parse_tool_specs([dict(tool) for tool in spec.tools]))).schemas()
    rendered = [draft.apply_chat_template(messages + turns, tools=schemas, tokenize=False)
                for messages, turns in spec.conversations(200, seed=1)]
    return train_chat_tokenizer(corpus=corpus + rendered, **options)


def resolve_model_path(path: str, key: str = "model.path", tokenizer: bool = True) -> Path:
    """The HF folder `path` (the value of config key `key`) names, checked to hold what a run
    reads: the model's config.json and (`tokenizer`) its tokenizer, and for the policy
    (`model.path`) a chat template."""
    if path.startswith(TINY_SCHEME):
        family = path[len(TINY_SCHEME):]
        # Versioned: a cache built by an older release (another tokenizer) is never picked up.
        target = cache_root() / "tiny" / f"{family}-{TINY_VERSION}"
        if not (target / "config.json").is_file():
            # Build beside, then rename: concurrent ranks never see a half-written model.
            staging = target.with_name(f".{family}.{os.getpid()}")
            make_tiny_hf_model(family, staging, vocab_size=TINY_VOCAB_SIZE)
            make_tiny_tokenizer(family).save_pretrained(staging)
            try:
                staging.rename(target)
            except OSError:  # another process won the race; its model is identical
                shutil.rmtree(staging, ignore_errors=True)
        return target
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{key}='{path}' is not a Hugging Face model folder (no config.json); "
                         f"give a local folder or {TINY_SCHEME}<llama|qwen2|qwen3|qwen3_moe>")
    if not tokenizer:
        return folder
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{key}='{path}' has no tokenizer ({', '.join(TOKENIZER_FILES)}): save the model's "
                         "tokenizer into the folder (tokenizer.save_pretrained)")
    if key == "model.path" and not _has_chat_template(folder):
        raise ValueError(f"{key}='{path}' has no chat template (tokenizer_config.json's chat_template or "
                         "chat_template.jinja): prompts are rendered with it; use the model's instruct/chat "
                         "release or add its template")
    return folder


# Any one of these is a tokenizer transformers' AutoTokenizer loads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _has_chat_template(folder: Path) -> bool:
    import json

    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))
