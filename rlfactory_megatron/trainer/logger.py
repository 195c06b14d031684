"""Metrics to metrics.jsonl and TensorBoard, and one progress line per step with phase times and ETA."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, output_dir: str | Path, total_steps: int, jsonl: bool = True, tensorboard: bool = True,
                 wandb_project: str | None = None) -> None:
        self.dir = Path(output_dir)
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

    def log(self, step: int, metrics: dict[str, float]) -> None:
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
        print(self.progress_line(step, metrics), flush=True)

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
