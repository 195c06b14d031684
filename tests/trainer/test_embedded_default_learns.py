"""The embedded default (`rlf-train` with no arguments but an output folder) learns through RL.

Its warm-start demonstrations call the calculator on 3 prompts in 10 and answer straight away on
the others, so the warm-started policy calls the tool in about one sample in five and, too small
to do arithmetic itself, is mostly wrong without it. GRPO has to discover that the tool call
pays: held-out accuracy, the mean reward and the share of samples calling the tool all rise.
The run is the real default (~3 minutes here); the margins are well below those measured over
6 seeds and 3 thread settings (`rlf-bench learn`: held-out gains 0.60-0.82, reward gains 0.19-0.37),
so that another machine's float rounding cannot flip the verdict.
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from rlf_train_cli import BIN, env_for, records  # noqa: E402


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def test_embedded_default_learns_to_use_the_tool(tmp_path):
    out = tmp_path / "default"
    # As the README's first command runs it: no thread variables (rlf-train chooses and says so).
    env = {k: v for k, v in env_for(tmp_path).items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    run = subprocess.run([str(BIN / "rlf-train"), f"trainer.output_dir={out}"], capture_output=True, text=True,
                         env=env, timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"metrics: {out / 'metrics.jsonl'}" in run.stdout  # where its outputs went
    assert "rlf-train: OMP_NUM_THREADS=" in run.stdout  # the threads it chose
    logged = records(out)
    steps = [r for r in logged if r["step"] > 0]
    assert len(steps) == 30
    first, last = steps[:10], steps[-10:]
    val = {r["step"]: r["val/score_mean"] for r in logged if "val/score_mean" in r}
    report = (f"val {val}; reward {_mean(first, 'reward/score/mean'):.3f} -> {_mean(last, 'reward/score/mean'):.3f}; "
              f"turns {_mean(first, 'rollout/turns_mean'):.3f} -> {_mean(last, 'rollout/turns_mean'):.3f}")
    # measured (seed 1234, threads unset = 1 here): val 0.09 -> 0.91, reward 0.60 -> 0.97, turns 1.66 -> 1.99
    assert val[30] >= val[0] + 0.3, report
    assert _mean(last, "reward/score/mean") >= _mean(first, "reward/score/mean") + 0.07, report
    assert _mean(last, "rollout/turns_mean") > _mean(first, "rollout/turns_mean") + 0.05, report  # more tool calls
    # vLLM sampled from the policy being trained: its log-probs of the multi-turn samples (tool
    # observations in between, temperature 0.7) equal the trainer's after every sync (measured max 3.2e-5)
    assert max(r["rollout/logprob_gap_max"] for r in steps) <= 1e-3
