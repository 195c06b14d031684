"""Toy rollout rows for the tests, batched by the trainer's own `pad_rows` as the generator batches real ones."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from rlfactory_megatron.actor.batch import RolloutBatch, pad_rows


def toy_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
              observations: Sequence[tuple[int, int]] = (), group_size: int = 1,
              step_rows: list[int] | None = None, step_size: int = 0) -> RolloutBatch:
    """Rows of prompt + response, trained on the response tokens except the `observations`
    ([start, end) spans of each response: tool output); groups of `group_size` rows; with
    `step_rows`, a DP-local batch of those rows of a step of `step_size`."""
    masks = []
    for prompt, response in zip(prompts, responses):
        mask = [0] * len(prompt) + [1] * len(response)
        for start, end in observations:
            mask[len(prompt) + start:len(prompt) + end] = [0] * (min(end, len(response)) - start)
        masks.append(mask)
    return pad_rows([[*prompt, *response] for prompt, response in zip(prompts, responses)], masks, group_size,
                    step_rows, step_size)


def random_batch(vocab: int, seed: int = 0, batch_size: int = 6) -> RolloutBatch:
    """Multi-turn rows of random tokens (10, 13, 16, ... long): a prompt of 4, a response with a
    tool observation of 2 tokens in it, groups of 2, random advantages."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [10 + 3 * i for i in range(batch_size)]
    ids = torch.randint(0, vocab, (batch_size, max(lengths)), generator=gen).tolist()
    batch = toy_batch([row[:4] for row in ids], [row[4:n] for row, n in zip(ids, lengths)], observations=[(2, 4)],
                      group_size=2)
    return batch.with_fields(advantages=torch.randn(batch.input_ids.shape, generator=gen))


def engine_batch(prompts: Sequence[Sequence[int]], generations) -> tuple[RolloutBatch, torch.Tensor]:
    """The rows an engine generated (`generations[i]`: the samples of `prompts[i]`), and the
    engine's log-probs aligned to their tokens."""
    rows = [(prompt, g) for prompt, samples in zip(prompts, generations) for g in samples]
    batch = toy_batch([prompt for prompt, _ in rows], [g.token_ids for _, g in rows])
    engine_lp = torch.zeros(batch.input_ids.shape)
    for i, (prompt, g) in enumerate(rows):
        engine_lp[i, len(prompt):len(prompt) + len(g.token_ids)] = torch.tensor(g.log_probs)
    return batch, engine_lp
