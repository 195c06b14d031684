"""`Trainer.step` on one gloo rank: a real tiny Megatron learner between stand-ins for the engine
fleet and the rollout generator (vLLM engines, Ray tools and rewards: tested on their own)."""
from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import torch

from rlfactory_megatron.config import load_config
from rlfactory_megatron.rollout.rows import TrainRows
from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed
from toy_rows import toy_batch

SCORES = [1.0, 0.0, 0.0, 1.0]  # the step's 4 rows: 2 prompts x rollout.n=2, one right answer in each group


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for module in model.modules() for p in module.parameters()]).clone()


class StandInFleet:
    """Stands in for EngineFleet (vLLM engines): logs the calls the trainer makes, with the
    training model's weights at each (the test hands it the model to watch)."""

    def __init__(self, cfg, hf_dir, output, collectives) -> None:
        self.events: list[tuple] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.model = None

    def sleep(self, level: int = 2) -> None:
        self.events.append(("sleep", level))
        self.weights["asleep"] = _weights(self.model)

    def wake_up(self, tags=("weights", "kv_cache")) -> None:
        self.events.append(("wake_up", tuple(tags)))
        self.weights[f"woke {tags[0]}"] = _weights(self.model)

    def update_weights(self, model, version: int) -> None:
        self.events.append(("update_weights", version, model is self.model))
        self.weights[f"version {version}"] = _weights(model)

    def sync_metrics(self) -> dict[str, float]:
        return {"weight_sync/buckets": 1.0}

    def close(self) -> None:
        self.events.append(("close",))


class StandInGenerator:
    """Stands in for RolloutGenerator (agent loops on the engines, rewards, the store): each step
    the same 4 rows of random tokens as one DP rank's batch, scored SCORES; logs the calls."""

    def __init__(self, cfg, fleet, collectives, tokenizer, output, tool_specs, draw, drop_uniform_groups) -> None:
        self.events = fleet.events
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, tokenizer.vocab_size, (4, 12), generator=gen).tolist()
        self.batch = toy_batch([row[:5] for row in ids], [row[5:5 + 3 + i] for i, row in enumerate(ids)],
                               group_size=2, step_rows=[0, 1, 2, 3], step_size=4)
        self.recorded = []

    def generate(self, step: int) -> TrainRows:
        self.events.append(("generate", step))
        rollouts = SimpleNamespace(summaries=[SimpleNamespace(tokens=int(n)) for n in self.batch.lengths])
        return TrainRows(self.batch, torch.zeros(self.batch.input_ids.shape),
                         torch.full(self.batch.input_ids.shape, step, dtype=torch.long), rollouts)

    def rewards(self, rollouts):
        self.events.append(("rewards",))
        return SimpleNamespace(scores=SCORES)

    def record(self, rows, batch, step: int) -> None:
        self.events.append(("record", step))
        self.recorded.append(batch)

    def before_sync(self) -> None:
        self.events.append(("before_sync",))

    def after_sync(self, version: int) -> None:
        self.events.append(("after_sync", version))

    def metrics(self, rollouts, version: int) -> dict[str, float]:
        return {"reward/score/mean": sum(SCORES) / len(SCORES), "rollout/trained_version": float(version)}

    def close(self) -> None:
        pass


def step_worker(hf_dir: str, output_dir: str, steps: int) -> dict:
    """`steps` calls of Trainer.step; what the stand-ins saw and what the trainer returned."""
    from rlfactory_megatron.trainer import trainer as trainer_module

    init_distributed(ParallelSizes(1, 1), seed=5)
    try:
        cfg = load_config(overrides=[f"model.path={hf_dir}", f"trainer.output_dir={output_dir}",
                                     "trainer.prompts_per_step=2", "rollout.n=2", "actor.mini_batch_size=2",
                                     "trainer.sft_steps=0"])
        with mock.patch.object(trainer_module, "EngineFleet", StandInFleet), \
                mock.patch.object(trainer_module, "RolloutGenerator", StandInGenerator):
            trainer = trainer_module.Trainer(cfg, hf_dir)
        fleet, generator = trainer.fleet, trainer.generator
        fleet.model = trainer.learner.actor.megatron
        start = _weights(fleet.model)
        metrics = [trainer.step() for _ in range(steps)]
        trainer.close()
        weights = fleet.weights
        return {
            "events": fleet.events,
            "metrics": metrics,
            "step_index": trainer.step_index,
            "recorded_ids": [torch.equal(b.input_ids, generator.batch.input_ids) for b in generator.recorded],
            "advantages": [b.advantages for b in generator.recorded],
            "loss_mask": generator.batch.loss_mask,
            # training ran while the engines slept: the weights moved between sleep and wake, and
            # the weights handed over are those woken with (and differ from the start's)
            "trained_while_asleep": not torch.equal(weights["asleep"], weights["woke weights"]),
            "handed_last": torch.equal(weights[f"version {steps}"], weights["woke weights"]),
            "moved_from_start": not torch.equal(weights[f"version {steps}"], start),
        }
    finally:
        destroy_distributed()
