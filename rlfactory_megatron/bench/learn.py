"""`rlf-bench learn`: does the embedded default learn on every seed and thread setting?

Runs `rlf-train` (the README's first command, plus `trainer.seed` and an output folder) once per
seed and thread setting, one run at a time, and reports for each run and as the median (with the
spread): held-out greedy accuracy before RL and after the last step, and the mean sampled reward
of the first and the last 10 steps. Writes `learn.json`, `learn.md` (the table) and `learn.png`
(held-out accuracy and reward per step, one curve per run) into `--out`. Exit 1 when a run gains
less than `--min-gain` held-out accuracy or its last steps' reward is not above its first steps'.

A thread setting is a value of OMP_NUM_THREADS for the run, or `auto`: none set, as a newcomer
runs it, so rlf-train chooses.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlfactory_megatron.bench.environment import environment
from rlfactory_megatron.runtime.threads import THREAD_VARIABLES

WINDOW = 10  # steps averaged at each end of the run


@dataclass
class LearnRun:
    seed: int
    threads: str
    seconds: float = 0.0
    val_before: float = float("nan")
    val_after: float = float("nan")
    reward_first: float = float("nan")
    reward_last: float = float("nan")
    val_curve: dict[int, float] = field(default_factory=dict)
    reward_curve: dict[int, float] = field(default_factory=dict)
    error: str = ""

    @property
    def gain(self) -> float:
        return self.val_after - self.val_before

    def learned(self, min_gain: float) -> bool:
        return not self.error and self.gain >= min_gain and self.reward_last > self.reward_first


def summarize(run: LearnRun, metrics_jsonl: Path) -> LearnRun:
    rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    run.val_curve = {r["step"]: r["val/score_mean"] for r in rows if "val/score_mean" in r}
    run.reward_curve = {r["step"]: r["reward/score/mean"] for r in rows if r["step"] > 0 and "reward/score/mean" in r}
    if not run.val_curve or not run.reward_curve:
        run.error = f"{metrics_jsonl} has no validation or reward metrics"
        return run
    steps = sorted(run.reward_curve)
    window = min(WINDOW, max(1, len(steps) // 3))
    run.val_before, run.val_after = run.val_curve[min(run.val_curve)], run.val_curve[max(run.val_curve)]
    run.reward_first = statistics.fmean(run.reward_curve[s] for s in steps[:window])
    run.reward_last = statistics.fmean(run.reward_curve[s] for s in steps[-window:])
    return run


def _train(run: LearnRun, out_dir: Path, overrides: list[str]) -> LearnRun:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    if run.threads != "auto":
        env["OMP_NUM_THREADS"] = run.threads
    command = [str(Path(sys.executable).parent / "rlf-train"), f"trainer.seed={run.seed}",
               f"trainer.output_dir={out_dir}", *overrides]
    tag = f"[seed {run.seed} threads {run.threads}]"
    start = time.monotonic()
    # Its per-step progress lines (rate, ETA) pass through, tagged with the run.
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        tail = []
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-20:]
            print(f"{tag} {line.rstrip()}", flush=True)
    run.seconds = round(time.monotonic() - start, 1)
    if proc.returncode != 0:
        run.error = f"rlf-train exited {proc.returncode}: {tail[-1] if tail else ''}"
        return run
    return summarize(run, out_dir / "metrics.jsonl")


def _median_and_spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(runs: list[LearnRun], min_gain: float) -> str:
    lines = ["| seed | threads | held-out accuracy before -> after | reward first -> last 10 steps | learned | minutes |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        if r.error:
            lines.append(f"| {r.seed} | {r.threads} | failed: {r.error} | | no | {r.seconds / 60:.1f} |")
            continue
        lines.append(f"| {r.seed} | {r.threads} | {r.val_before:.2f} -> {r.val_after:.2f} | "
                     f"{r.reward_first:.2f} -> {r.reward_last:.2f} | {'yes' if r.learned(min_gain) else 'no'} | "
                     f"{r.seconds / 60:.1f} |")
    done = [r for r in runs if not r.error]
    if done:
        lines.append(f"| median (min-max) | | {_median_and_spread([r.val_before for r in done])} -> "
                     f"{_median_and_spread([r.val_after for r in done])} | "
                     f"{_median_and_spread([r.reward_first for r in done])} -> "
                     f"{_median_and_spread([r.reward_last for r in done])} | "
                     f"{sum(r.learned(min_gain) for r in runs)}/{len(runs)} | |")
    return "\n".join(lines)


def plot(runs: list[LearnRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (val_ax, reward_ax) = plt.subplots(1, 2, figsize=(11, 4))
    styles = ["-", "--", ":", "-."]
    threads = sorted({r.threads for r in runs})
    for i, r in enumerate(runs):
        if r.error:
            continue
        color = f"C{threads.index(r.threads)}"
        style = styles[sorted({x.seed for x in runs}).index(r.seed) % len(styles)]
        label = f"seed {r.seed}, threads {r.threads}"
        val_ax.plot(list(r.val_curve), list(r.val_curve.values()), style, color=color, marker="o", label=label)
        reward_ax.plot(list(r.reward_curve), list(r.reward_curve.values()), style, color=color, label=label)
    val_ax.set(title="held-out greedy accuracy", xlabel="RL step", ylabel="val/score_mean", ylim=(-0.02, 1.02))
    reward_ax.set(title="mean sampled reward", xlabel="RL step", ylabel="reward/score/mean", ylim=(-0.02, 1.02))
    val_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlf-bench learn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2], help="trainer.seed of each run")
    parser.add_argument("--threads", nargs="+", default=["1", "2"],
                        help="OMP_NUM_THREADS of each run, or 'auto' (unset: rlf-train chooses)")
    parser.add_argument("--min-gain", type=float, default=0.4, help="held-out accuracy a run must gain")
    parser.add_argument("--out", default="outputs/bench-learn", help="folder for the runs and the report")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. trainer.total_steps=20")
    args = parser.parse_args(argv)
    bad = [t for t in args.threads if t != "auto" and not (t.isdigit() and int(t) >= 1)]
    if bad:
        parser.error(f"--threads takes positive integers or 'auto', not {bad}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = [LearnRun(seed, threads) for threads in args.threads for seed in args.seeds]
    runs: list[LearnRun] = []
    for i, run in enumerate(plan):
        done_s = sum(r.seconds for r in runs)
        eta = f", ETA {done_s / len(runs) * (len(plan) - i) / 60:.0f} min" if runs else ""
        print(f"rlf-bench learn: run {i + 1}/{len(plan)}: seed {run.seed}, threads {run.threads}{eta}", flush=True)
        runs.append(_train(run, out / f"seed{run.seed}-threads{run.threads}", args.overrides))
        r = runs[-1]
        print(f"rlf-bench learn: seed {r.seed} threads {r.threads}: " + (r.error or
              f"held-out {r.val_before:.2f} -> {r.val_after:.2f}, reward {r.reward_first:.2f} -> {r.reward_last:.2f} "
              f"({r.seconds / 60:.1f} min)"), flush=True)

    report = table(runs, args.min_gain)
    command = shlex.join(["rlf-bench", "learn", *argv])
    (out / "learn.md").write_text(f"`{command}`\n\n{report}\n")
    (out / "learn.json").write_text(json.dumps({"command": command, "min_gain": args.min_gain,
                                                "environment": environment(),
                                                "runs": [asdict(r) | {"gain": r.gain, "learned": r.learned(args.min_gain)}
                                                         for r in runs]}, indent=2))
    plot(runs, out / "learn.png")
    print(report)
    print(f"rlf-bench learn: {out / 'learn.md'}, {out / 'learn.json'}, {out / 'learn.png'}")
    return 0 if all(r.learned(args.min_gain) for r in runs) else 1
