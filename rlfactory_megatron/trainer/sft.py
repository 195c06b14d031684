"""Supervised warm-start before RL: demonstrations rendered as the agent loop renders turns,
trained on the assistant's tokens only, at its own LR (trainer.sft_lr, trainer.sft_lr_decay_style) that leaves the RL schedule untouched."""
from __future__ import annotations

import math
import random
import time

from rlfactory_megatron.actor.batch import pad_rows
from rlfactory_megatron.rollout.prompts import PromptRecord, fit_prompt


def demonstration_rows(records: list[PromptRecord], manager, tool_schemas, max_prompt_tokens: int,
                       truncation: str) -> list[tuple[list[int], list[int]]]:
    """Prompt + demonstration tokens of every record that has one, mask 1 on the assistant's
    tokens only (the prompt as the engines get it; tool responses as the agent loop renders them;
    each assistant turn closed by the marker generation stops on: Llama 3's <|eom_id|> after a
    tool call, else end of turn)."""
    rows = []
    for record in records:
        if not record.demonstration:
            continue
        ids = fit_prompt(manager.render_prompt(record.messages, tool_schemas), max_prompt_tokens, truncation,
                         record.origin)
        mask = [0] * len(ids)
        for turn in record.demonstration:
            if turn["role"] == "tool":
                piece, trained = manager.render_observation([turn["content"]]), 0
            else:
                end = manager.turn_end_of(calls_tools=bool(manager.parse(turn["content"]).tool_calls))
                piece, trained = manager.tokenizer.encode(turn["content"] + end, add_special_tokens=False), 1
            ids += piece
            mask += [trained] * len(piece)
        rows.append((ids, mask))
    return rows


def sft_lr_at(step: int, steps: int, lr: float, style: str) -> float:
    """The warm-start's LR at its step `step` (1-based): decay ends one step short of 0, so the
    last step still learns."""
    progress = (step - 1) / steps
    if style == "linear":
        return lr * (1.0 - progress)
    if style == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr


def sft_warm_start(actor, rows: list[tuple[list[int], list[int]]], cfg, verbose: bool,
                   cache=None) -> dict[str, float]:
    """trainer.sft_steps optimizer steps from trainer.sft_lr (constant, or decayed towards 0 by
    trainer.sft_lr_decay_style), each on a fresh seeded draw of trainer.sft_batch_size rows;
    progress with rate and ETA every 10 steps. With a `cache` (warm_start_cache.py) holding this
    warm-start, the actor loads it instead; without, the result is stored there."""
    reused = cache.load(actor) if cache is not None else None
    if reused is not None:
        if verbose:
            print(f"rlf-train: SFT warm-start done ({reused['steps']} steps, loss {reused['loss']:.3f}; "
                  f"reused from {cache.entry}, stored by {reused['run']})", flush=True)
        return {"sft/loss": reused["loss"]}
    rng = random.Random(cfg.seed)
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    with actor.megatron.fixed_lr(cfg.sft_lr) as set_lr:
        for done in range(1, cfg.sft_steps + 1):
            set_lr(sft_lr_at(done, cfg.sft_steps, cfg.sft_lr, cfg.sft_lr_decay_style))
            ids, masks = zip(*(rows[rng.randrange(len(rows))] for _ in range(cfg.sft_batch_size)))
            metrics = actor.sft_update(pad_rows(list(ids), list(masks)))
            if verbose and (done % 10 == 0 or done == cfg.sft_steps):
                elapsed = time.perf_counter() - start
                print(f"sft {done}/{cfg.sft_steps} | loss {metrics['sft/loss']:.3f} | {done / elapsed:.2f} steps/s "
                      f"| ETA {int(elapsed / done * (cfg.sft_steps - done))}s", flush=True)
    if verbose:
        print(f"rlf-train: SFT warm-start done ({cfg.sft_steps} steps, loss {metrics['sft/loss']:.3f})")
    if cache is not None:
        cache.store(actor, {"steps": cfg.sft_steps, "loss": metrics["sft/loss"]})
    return metrics
