"""The SFT warm-start's result, reused by runs that would compute the same one (trainer.sft_cache).

An RL sweep (learning rates, engine layouts, staleness) usually starts every run from one
warm-start; each would spend the same minutes (hours, on a large model) computing it. With
`trainer.sft_cache=<dir>` the first run stores the actor's state after the warm-start (weights,
optimizer moments, LR schedule) under a key of everything that decides it, and a later run
with the same key loads it instead: it then trains exactly as if it had computed it.

The key covers the model's files, the demonstration rows (token ids and masks, so the data,
prompt rendering and tools are in it), the sections that shape the actor and its updates
(`model`, `parallel`, `actor`), the warm-start's own settings, the seed, the RL schedule's
length, the sampling temperature the actor's log-probs assume, the world size, the thread
count (it changes the float sums' order) and the library versions. What only the RL phase or
the rollout placement reads (rollout.mode, num_engines, max_staleness, logging...) is not in it,
nor what changes where state lives but no number (actor.offload, parallel.device_memory_gib).
Model files over HASHED_WHOLE_BYTES are keyed by name, size and their first and last MiB.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

COMPLETE_FILE = "warm_start.json"  # written last: its presence marks an entry complete
HASHED_WHOLE_BYTES = 64 * 2**20
EDGE_BYTES = 2**20
# Outside the sections keyed whole: the settings that decide the warm-start's result.
TRAINER_KEYS = ("seed", "total_steps", "sft_steps", "sft_batch_size", "sft_lr", "sft_lr_decay_style")
ROLLOUT_KEYS = ("temperature",)


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        if size <= HASHED_WHOLE_BYTES:
            digest.update(f.read())
        else:
            digest.update(f.read(EDGE_BYTES))
            f.seek(size - EDGE_BYTES)
            digest.update(f.read(EDGE_BYTES))
    return digest.hexdigest()


def warm_start_key(cfg, hf_dir: str, rows: list[tuple[list[int], list[int]]]) -> str:
    """The same on every rank of a run (rows are the broadcast ones), and across runs exactly
    when their warm-starts would be equal."""
    import megatron.core
    from omegaconf import OmegaConf

    settings = {section: OmegaConf.to_container(cfg[section], resolve=True) for section in ("model", "parallel", "actor")}
    settings["trainer"] = {k: cfg.trainer[k] for k in TRAINER_KEYS}
    settings["rollout"] = {k: cfg.rollout[k] for k in ROLLOUT_KEYS}
    settings["model"].pop("path", None)  # the files below say what the model is, wherever it lies
    # Where the state waits while engines generate, and the memory it is planned against, change no number.
    settings["actor"].pop("offload", None)
    settings["parallel"].pop("device_memory_gib", None)
    settings["world_size"] = dist.get_world_size()
    settings["threads"] = torch.get_num_threads()
    settings["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    settings["versions"] = [torch.__version__, megatron.core.__version__]
    settings["model_files"] = {p.name: _file_digest(p) for p in sorted(Path(hf_dir).iterdir()) if p.is_file()}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    digest.update(json.dumps(rows).encode())
    return digest.hexdigest()[:24]


class WarmStartCache:
    """One entry (`<trainer.sft_cache>/<key>`); every method is collective over the run's ranks,
    which must see the same folder (as they do the checkpoints)."""

    def __init__(self, root: str, key: str, output: Path) -> None:
        self.entry = Path(root) / key
        self.run = str(Path(output).resolve())  # recorded with what it stores, and names its partial entry

    def load(self, actor) -> dict | None:
        """The warm-start's record if the entry is complete (the actor then holds its state), else None."""
        record = [None]
        if dist.get_rank() == 0 and (self.entry / COMPLETE_FILE).is_file():
            record = [json.loads((self.entry / COMPLETE_FILE).read_text())]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(record, src=0)
        if record[0] is not None:
            actor.megatron.load(self.entry / "actor")
        return record[0]

    def store(self, actor, record: dict) -> None:
        """Written beside the entry, then renamed into place: a run killed meanwhile, or another
        run storing the same key at the same time, never leaves a partial entry in it."""
        record = {**record, "run": self.run}
        partial = self.entry.with_name(f"{self.entry.name}.partial-{hashlib.sha256(self.run.encode()).hexdigest()[:12]}")
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        actor.megatron.save(partial / "actor")  # collective; it makes the folder
        if dist.get_rank() == 0:
            (partial / COMPLETE_FILE).write_text(json.dumps(record))
            try:
                partial.rename(self.entry)
            except OSError:  # another run stored it first: the same state, by its key
                shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()
