"""Metrics to metrics.jsonl and TensorBoard, and one progress line per step with phase times and ETA."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, output_dir: str | Path, total_steps: int, jsonl: bool = True, tensorboard: bool = True,
                 wandb_project: str | None = None, progress_every: int = 1) -> None:
        self.dir = Path(output_dir)
        self.progress_every = progress_every  # console lines; the metric files get every step
        self.dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.jsonl = open(self.dir / "metrics.jsonl", "a") if jsonl else None
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        self.wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                print("rlf-train: logging.wandb_project is set but wandb is not installed; skipping wandb",
                      file=sys.stderr)
            else:
                self.wandb = wandb.init(project=wandb_project, dir=str(self.dir))
        self._start: float | None = None  # set at the first step, so set-up and warm-start don't skew the ETA
        self._first_step: int | None = None

    def rewind(self, step: int) -> None:
        """After resuming at `step`: forget what a killed run logged past it, so every step is
        recorded once (metrics.jsonl rows dropped, TensorBoard events purged)."""
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
        if self.wandb:
            self.wandb.log(record, step=step)
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
