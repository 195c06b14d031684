"""The long-tailed workload of `rlf-bench e2e --workload longtail`: the tiny model taught to answer
at lengths drawn from a geometric distribution, as RL answers are (most short, a few to the limit).

A short supervised run (plain torch on the HF model: it is the benchmark's set-up, not a
training path of ours) on the task's prompts followed by filler words cut at a geometric length
and the end-of-turn token. A geometric length has the same stopping chance at every position, so
the model only has to learn one constant end-of-turn probability, 1/mean; sampled at temperature
1 its answers then follow the distribution up to the limit. The taught model is cached by its
recipe, so later runs start at once.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path

FILLER = ("the", "sum", "of", "and", "is", "we", "add", "then", "number", "answer", "so", "first",
          "next", "carry", "digit", "total", "result", "it", "gives", "plus")


def geometric_length(rng: random.Random, mean: float, limit: int) -> int:
    """A length >= 1 with mean `mean` before the cut at `limit` (stop chance 1/mean per token)."""
    length = 1
    while length < limit and rng.random() >= 1.0 / mean:
        length += 1
    return length


def _examples(tokenizer, prompts: list[list[dict]], count: int, mean: float, limit: int, seed: int):
    """(token ids, trained mask) pairs: a prompt (not trained), a geometric-length answer, end of turn."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        prompt = tokenizer.apply_chat_template(prompts[index % len(prompts)], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
        answer = filler_ids(tokenizer, rng, geometric_length(rng, mean, limit) - 1) + [tokenizer.eos_token_id]
        out.append((list(prompt) + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def filler_ids(tokenizer, rng: random.Random, length: int) -> list[int]:
    """`length` tokens of filler words."""
    words: list[int] = []
    while len(words) < length:
        words += tokenizer.encode(" " + " ".join(rng.choice(FILLER) for _ in range(16)), add_special_tokens=False)
    return words[:length]


def make_longtail_model(hf_dir: str | Path, prompts: list[list[dict]], mean: float = 64.0, limit: int = 512,
                        steps: int = 300, batch: int = 32, lr: float = 3e-3, seed: int = 0,
                        cache: Path | None = None, verbose: bool = True) -> Path:
    """A copy of the HF model at `hf_dir` taught the long-tailed answer lengths; returns its folder."""
    recipe = {"prompts": prompts, "mean": mean, "limit": limit, "version": 1}
    return teach(hf_dir, "longtail", recipe,
                 lambda tokenizer: _examples(tokenizer, prompts, steps * batch, mean, limit, seed),
                 steps=steps, batch=batch, lr=lr, seed=seed, cache=cache, verbose=verbose)


def teach(hf_dir: str | Path, name: str, recipe: dict, make_examples, steps: int, batch: int, lr: float,
          seed: int, cache: Path | None = None, verbose: bool = True) -> Path:
    """A copy of the HF model at `hf_dir` trained on `make_examples(tokenizer)` ((token ids, trained
    mask) pairs, `batch` per step), cached under `cache` (default <cache root>/<name>) by the model's
    files and the recipe; returns its folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfactory_megatron.trainer.model_path import cache_root

    # Keyed by the model's files, not its folder: a tiny model rebuilt elsewhere is the same model.
    files = sorted(p for p in Path(hf_dir).iterdir() if p.is_file())
    recipe = {**recipe, "model": hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest(),
              "steps": steps, "batch": batch, "lr": lr, "seed": seed}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    target = (cache or cache_root() / name) / key
    if (target / "config.json").is_file():
        return target
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    examples = make_examples(tokenizer)
    start = time.perf_counter()
    for step in range(steps):
        chunk = examples[step * batch:(step + 1) * batch]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)  # untrained tokens and padding
        attention = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (tokens, trained) in enumerate(chunk):
            ids[row, :len(tokens)] = torch.tensor(tokens)
            labels[row, :len(tokens)] = torch.where(torch.tensor(trained, dtype=torch.bool), torch.tensor(tokens), -100)
            attention[row, :len(tokens)] = 1
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        done = step + 1
        if verbose and (done % 50 == 0 or done == steps):
            elapsed = time.perf_counter() - start
            print(f"{name} SFT {done}/{steps} | loss {loss.item():.3f} | {done / elapsed:.2f} steps/s "
                  f"| ETA {int(elapsed / done * (steps - done))}s", flush=True)
    # Build beside, then rename: a concurrent run never loads a half-written model.
    staging = target.with_name(f".{key}.{os.getpid()}")
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # another run finished first; its model is the same recipe's
        shutil.rmtree(staging, ignore_errors=True)
    return target
