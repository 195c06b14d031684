"""Metrics to metrics.jsonl and TensorBoard, and one progress line per step with phase times and ETA."""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path


def wandb_settings(cfg) -> dict | None:
    """`wandb.init` arguments from the logging.wandb_* keys (None: no wandb), the whole config included."""
    from omegaconf import OmegaConf

    logging = cfg.logging
    if logging.wandb_project is None:
        return None
    return {"project": logging.wandb_project, "name": logging.wandb_name or Path(cfg.trainer.output_dir).name,
            "entity": logging.wandb_entity, "tags": list(logging.wandb_tags), "mode": logging.wandb_mode,
            "config": OmegaConf.to_container(cfg, resolve=True)}


class MetricsLogger:
    def __init__(self, output_dir: str | Path, total_steps: int, jsonl: bool = True, tensorboard: bool = True,
                 wandb: dict | None = None, progress_every: int = 1) -> None:
        self.dir = Path(output_dir)
        self.progress_every = progress_every  # console lines; the metric files get every step
        self.dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.jsonl = open(self.dir / "metrics.jsonl", "a") if jsonl else None
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        # wandb starts with the first record, once `rewind` has said which run a resumed one continues.
        self._wandb_init = wandb
        self.wandb = None
        self.wandb_run_id: str | None = None  # kept in checkpoints, so that a resumed run logs into the same run
        if wandb is not None:
            self.wandb_run_id = uuid.uuid4().hex[:8]  # wandb's own ids are 8 characters of [a-z0-9]
        self._start: float | None = None  # set at the first step, so set-up and warm-start don't skew the ETA
        self._first_step: int | None = None

    def rewind(self, step: int, wandb_run_id: str | None = None) -> None:
        """After resuming at `step`: forget what a killed run logged past it, so every step is
        recorded once (metrics.jsonl rows dropped, TensorBoard events purged), and go on in the
        wandb run the checkpoint names."""
        if self.jsonl:
            self.jsonl.close()
            path = self.dir / "metrics.jsonl"
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and _complete_step(line) is not None and _complete_step(line) <= step]
            path.write_text("".join(line + "\n" for line in kept))
            self.jsonl = open(path, "a")
        if self.tb:
            from torch.utils.tensorboard import SummaryWriter

            self.tb.close()
            self.tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=step + 1)
        if self._wandb_init is not None and wandb_run_id is not None:
            self.wandb_run_id = wandb_run_id

    def _wandb_run(self):
        if self.wandb is None and self._wandb_init is not None:
            import wandb

            # quiet: the console is the run's progress lines; wandb's banner goes to its own log.
            self.wandb = wandb.init(**self._wandb_init, id=self.wandb_run_id, resume="allow", dir=str(self.dir),
                                    settings=wandb.Settings(quiet=True))
        return self.wandb

    def log(self, step: int, metrics: dict[str, float], progress: bool = True) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.tb:
            for key, value in record.items():
                if key != "step":
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()
        run = self._wandb_run()
        # A resumed wandb run already holds the steps the killed run logged past the checkpoint; a
        # resumed run is exact, so those steps' values are the ones it would log again.
        if run is not None and step >= run.step:
            run.log(record, step=step)
        if progress:
            line = self.progress_line(step, metrics)  # also keeps the ETA's clock
            if step % self.progress_every == 0 or step == self.total_steps:
                print(line, flush=True)

    def text(self, tag: str, text: str, step: int) -> None:
        """Text (e.g. trajectories) under `tag` in TensorBoard's Text tab, shown as written."""
        if self.tb:
            # TensorBoard renders markdown: four spaces of indent keep the text as it is.
            self.tb.add_text(tag, "\n".join("    " + line for line in text.splitlines()), step)
            self.tb.flush()

    def progress_line(self, step: int, metrics: dict[str, float]) -> str:
        if self._first_step is None:
            self._first_step = step - 1
            self._start = time.perf_counter() - metrics.get("perf/step_s", 0.0)
        done = step - self._first_step
        elapsed = time.perf_counter() - self._start
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        phases = " ".join(f"{k.split('/')[-1].removesuffix('_s')} {metrics[k]:.1f}s"
                          for k in sorted(metrics) if k.startswith("time/"))
        reward = metrics.get("reward/score/mean", float("nan"))
        tokens = metrics.get("perf/tokens_per_s", 0.0)
        return (f"step {step}/{self.total_steps} | reward {reward:.3f} | {phases} | {tokens:.0f} tok/s "
                f"| ETA {int(eta // 60)}m{int(eta % 60):02d}s")

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def _complete_step(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line a kill cut short."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
