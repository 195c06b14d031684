"""Run checkpoints: actor (+ critic) as Megatron distributed checkpoints plus the trainer's state
(step, sampler position) in `<output_dir>/checkpoints/step_N`, the last `keep_last` kept."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist

STATE_FILE = "trainer_state.json"


def checkpoint_dir(output: Path, step: int) -> Path:
    return output / "checkpoints" / f"step_{step:06d}"


def save_checkpoint(output: Path, step: int, actor, critic, sampler, keep_last: int,
                    files: dict[str, bytes] | None = None, wandb_run_id: str | None = None) -> Path:
    """Collective: every rank saves its shards; rank 0 writes `files` (name -> bytes), then the
    state last (its presence marks the checkpoint complete) and drops the oldest checkpoints.
    `wandb_run_id`: the wandb run a resume of this checkpoint logs into."""
    directory = checkpoint_dir(output, step)
    actor.engine.check_finite("the checkpoint")
    actor.engine.save(directory / "actor")
    if critic is not None:
        critic.engine.save(directory / "critic")
    if dist.get_rank() == 0:
        for name, data in (files or {}).items():
            (directory / name).write_bytes(data)
        (directory / STATE_FILE).write_text(json.dumps({"step": step, "sampler": sampler.state_dict(),
                                                        "wandb_run_id": wandb_run_id}))
        kept = sorted((output / "checkpoints").glob("step_*"))
        for old in kept[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return directory


def resume_directory(choice: str, output: Path) -> Path | None:
    """The checkpoint `trainer.resume` names: `never` -> None, `auto` -> the latest complete one
    (or None), else the given folder, which must hold a trainer state."""
    if choice == "never":
        return None
    if choice == "auto":
        done = [d for d in sorted((output / "checkpoints").glob("step_*")) if (d / STATE_FILE).is_file()]
        return done[-1] if done else None
    directory = Path(choice)
    if not (directory / STATE_FILE).is_file():
        raise ValueError(f"trainer.resume='{choice}' is not a checkpoint folder (no {STATE_FILE})")
    return directory


def load_checkpoint(directory: Path, actor, critic, sampler) -> tuple[int, str | None]:
    """Restore models, optimizers, schedulers and the sampler position; returns the step and
    the wandb run id the checkpoint's run logged into (None: none, or an older checkpoint)."""
    state = json.loads((directory / STATE_FILE).read_text())
    actor.engine.load(directory / "actor")
    if critic is not None:
        critic.engine.load(directory / "critic")
    sampler.load_state_dict(state["sampler"])
    return int(state["step"]), state.get("wandb_run_id")
