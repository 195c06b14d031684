"""Run checkpoints in `<output_dir>/checkpoints/step_N`, the last `keep_last` kept: actor (+ critic)
as Megatron distributed checkpoints (the actor's with what `rlf-convert mcore-to-hf` needs), the
actor as a HF folder (trainer.save_hf), and the trainer's state (step, sampler position)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from rlfactory_megatron.config import leaf_values

STATE_FILE = "trainer_state.json"
ACTOR_DIR = "actor"
HF_DIR = "hf"  # the actor as a HF model folder
CONFIG_FILE = "config.yaml"  # the run's whole config, in its output folder and in each checkpoint

# Keys a resumed run may change: how long it runs, what it keeps, logs and validates, and how
# fast it goes. Any other key changes the model or its trajectories: a resume with another value
# is another run, refused.
MAY_CHANGE_ON_RESUME = ("trainer.total_steps", "trainer.save_every", "trainer.keep_last", "trainer.save_hf",
                        "trainer.resume", "trainer.output_dir", "trainer.val_every", "trainer.val_prompts",
                        "trainer.sft_cache", "trainer.max_skipped_updates", "logging.", "weight_sync.bucket_mb",
                        "tools.num_workers", "tools.max_concurrency", "tools.channel", "reward.num_workers",
                        "rollout.gpu_memory_utilization", "parallel.device_memory_gib", "cache.tool_cache_max_mb",
                        "model.recompute")  # (auto resolves by the device's memory: bit-exact either way)


def checkpoint_dir(output: Path, step: int) -> Path:
    return output / "checkpoints" / f"step_{step:06d}"


def actor_model_dir(path: str | Path) -> Path:
    """The Megatron model folder `path` names: a run checkpoint's actor/ for a run checkpoint,
    else `path` itself."""
    from rlfactory_megatron.models.mcore_checkpoint import META_FILE

    path = Path(path)
    return path / ACTOR_DIR if (path / ACTOR_DIR / META_FILE).is_file() else path


def save_checkpoint(output: Path, step: int, actor, critic, sampler, keep_last: int, hf_dir: str, save_hf: bool,
                    files: dict[str, bytes] | None = None, wandb_run_id: str | None = None) -> Path:
    """Collective: every rank saves its shards, the actor's HF folder streams to rank 0 (with
    `save_hf`); rank 0 writes `files` (name -> bytes), then the state last (its presence marks
    the checkpoint complete) and drops the oldest checkpoints. `wandb_run_id`: the wandb run a
    resume of this checkpoint logs into."""
    from rlfactory_megatron.models.mcore_checkpoint import write_model_meta

    directory = checkpoint_dir(output, step)
    actor.megatron.check_finite("the checkpoint")
    actor.megatron.save(directory / ACTOR_DIR)
    if dist.get_rank() == 0:
        write_model_meta(directory / ACTOR_DIR, actor.megatron.arch, hf_dir, actor.megatron.modules()[0].vocab_size)
    if save_hf:
        _write_hf(actor.megatron, directory / HF_DIR, hf_dir)
    if critic is not None:
        critic.megatron.save(directory / "critic")
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


def _write_hf(engine, out: Path, hf_dir: str) -> None:
    """The model as a HF folder in its checkpoint's dtype, with the run's model files (config,
    tokenizer, chat template): each full tensor gathered over TP and PP (engine.iter_hf_weights)
    into rank 0's safetensors shards, never the whole model in one process. Replicas of the
    weights rank 0 gathers sit it out: the expert-data-parallel ones, which at ep 1 are the
    data-parallel replicas; at ep > 1 a MoE model's experts are spread over data-parallel ranks,
    whose export gathers them (they all take part)."""
    from megatron.core import parallel_state

    from rlfactory_megatron.models.hf_checkpoint import write_hf_folder

    if parallel_state.get_expert_data_parallel_rank() != 0:
        return
    tensors = engine.iter_hf_weights(dtype=getattr(torch, engine.arch.torch_dtype))
    write_hf_folder(tensors, out, hf_dir, engine.arch.hf_config, writer=dist.get_rank() == 0)


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


def check_resume(cfg, output: Path) -> Path | None:
    """The checkpoint this run resumes (None: it starts fresh), after comparing the config it was
    trained with against `cfg`: a changed key outside MAY_CHANGE_ON_RESUME raises ValueError
    naming each (an output folder holds one run). A checkpoint from before configs were kept in
    checkpoints is compared with the folder's config.yaml."""
    directory = resume_directory(cfg.trainer.resume, output)
    if directory is None:
        return None
    stored = next((f for f in (directory / CONFIG_FILE, output / CONFIG_FILE) if f.is_file()), None)
    if stored is None:
        return directory
    before = leaf_values(OmegaConf.create(stored.read_text()))
    now = leaf_values(OmegaConf.to_container(cfg, resolve=True))
    # (a key only one release has has no value to differ from)
    changed = [f"{key}={now[key]} (was {before[key]})" for key in sorted(before.keys() & now.keys())
               if before[key] != now[key] and not key.startswith(MAY_CHANGE_ON_RESUME)]
    if changed:
        raise ValueError(f"trainer.resume={cfg.trainer.resume} would continue {directory}, trained with other settings: "
                         f"{'; '.join(changed)}; give this run its own trainer.output_dir (or restore those "
                         "settings, or trainer.resume=never to start over in this folder)")
    return directory


def load_checkpoint(directory: Path, actor, critic, sampler) -> tuple[int, str | None]:
    """Restore models, optimizers, schedulers and the sampler position; returns the step and
    the wandb run id the checkpoint's run logged into (None: none, or an older checkpoint)."""
    state = json.loads((directory / STATE_FILE).read_text())
    actor.megatron.load(directory / ACTOR_DIR)
    if critic is not None:
        critic.megatron.load(directory / "critic")
    sampler.load_state_dict(state["sampler"])
    return int(state["step"]), state.get("wandb_run_id")
