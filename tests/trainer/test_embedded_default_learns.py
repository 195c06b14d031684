"""The embedded default (`rlf-train` with no arguments but an output folder) learns through RL.

Its warm-start demonstrations call the calculator on 3 prompts in 10 and answer straight away on
the others, so the warm-started policy calls the tool in about one sample in five and, too small
to do arithmetic itself, is mostly wrong without it. GRPO has to discover that the tool call
pays: held-out accuracy, the mean reward and the share of samples calling the tool all rise.
The run is the real default (~3 minutes here); the margins are well below those measured over
6 seeds and 3 thread settings (`rlf-bench learn`: held-out gains 0.60-0.82, reward gains 0.19-0.37),
so that another machine's float rounding cannot flip the verdict. The asynchronous run takes its
reward from a tiny judge taught at run time (docs/rewards.md's command), not from the rule.
"""
import subprocess
from pathlib import Path

import pytest

from rlf_train_cli import BIN, env_for, records

# docs/rewards.md's command teaching a judge on the embedded default's task: a warm-start alone
# (no RL step) on judge prompts over right and wrong responses, validated by the replies' agreement
# with the rule's labels; the judge is its checkpoint's hf/ folder.
TEACH_JUDGE = ["trainer.task=calculator_judge", "trainer.total_steps=0", "tools.enable=false",
               "reward.scorer=judge_reply", "trainer.sft_steps=400", "trainer.sft_lr=1e-3",
               "trainer.sft_lr_decay_style=cosine", "trainer.val_prompts=128"]
# The run it judges: its only reward (reward.scorer stays the rule, which scores validation only).
JUDGED_BY = ["reward.model.kind=generative", "reward.model.template=Answer {response} Reference {ground_truth}",
             "reward.model.max_tokens=16", "reward.model.max_prompt_tokens=256"]


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


# Both runs compute the same 400-step warm-start: they share it through trainer.sft_cache (one
# worker runs the group, one folder of its own; the first run stores, the second loads the same
# bits, as tests/trainer/test_rlf_train.py's killed run checks), which saves ~4 CPU-minutes.
pytestmark = pytest.mark.xdist_group("embedded_default")


def _rlf_train(tmp_path, out: Path, *overrides) -> subprocess.CompletedProcess:
    """`rlf-train` as the README's first command runs it: no thread variables (rlf-train chooses
    and says so), and no device discipline (the suite's other rlf-train runs have it)."""
    env = {k: v for k, v in env_for(tmp_path).items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RLF_DEVICE_DISCIPLINE")}
    warm_starts = f"trainer.sft_cache={tmp_path.parent / 'embedded-default-warm-starts'}"
    run = subprocess.run([str(BIN / "rlf-train"), f"trainer.output_dir={out}", *overrides, warm_starts],
                         capture_output=True, text=True, env=env, timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"metrics: {out / 'metrics.jsonl'}" in run.stdout  # where its outputs went
    return run


def _learns(tmp_path, *overrides):
    """Run the default (with `overrides`) as the README's first command does; its metrics once it learned."""
    out = tmp_path / "default"
    run = _rlf_train(tmp_path, out, *overrides)
    assert "rlf-train: OMP_NUM_THREADS=" in run.stdout  # the threads it chose
    logged = records(out)
    steps = [r for r in logged if r["step"] > 0]
    assert len(steps) == 30
    first, last = steps[:10], steps[-10:]
    val = {r["step"]: r["val/score_mean"] for r in logged if "val/score_mean" in r}
    report = (f"val {val}; reward {_mean(first, 'reward/score/mean'):.3f} -> {_mean(last, 'reward/score/mean'):.3f}; "
              f"turns {_mean(first, 'rollout/turns_mean'):.3f} -> {_mean(last, 'rollout/turns_mean'):.3f}")
    assert val[30] >= val[0] + 0.3, report
    assert _mean(last, "reward/score/mean") >= _mean(first, "reward/score/mean") + 0.07, report
    assert _mean(last, "rollout/turns_mean") > _mean(first, "rollout/turns_mean") + 0.05, report  # more tool calls
    return steps


def test_embedded_default_learns_to_use_the_tool(tmp_path):
    # measured (seed 1234, threads unset = 1 here, 2026-12-06): val 0.03 -> 0.91, reward 0.57 -> 0.88, turns 1.65 -> 1.98
    steps = _learns(tmp_path)
    # vLLM sampled from the policy being trained: its log-probs of the multi-turn samples (tool
    # observations in between, temperature 0.7) equal the trainer's after every sync (measured max 3.2e-5)
    assert max(r["rollout/logprob_gap_max"] for r in steps) <= 1e-3


def _taught_judge(tmp_path) -> tuple[Path, float]:
    """The judge docs/rewards.md teaches, and its agreement with the rule on held-out responses."""
    out = tmp_path / "judge"
    run = _rlf_train(tmp_path, out, *TEACH_JUDGE)
    judge = out / "checkpoints" / "step_000000" / "hf"
    assert f"the warm-started model: {judge}" in run.stdout
    return judge, records(out)[0]["val/score_mean"]


def _agreement_with_rule(run_dir: Path) -> tuple[float, float]:
    """The share of a run's stored trajectories whose judge score equals the rule's (gsm8k) on the
    response text the judge read (responses of the policy, never seen by the judge while taught),
    and the share a constant judge would reach (the larger of the rule's 1s and 0s)."""
    from transformers import AutoTokenizer

    from rlfactory_megatron.envs.storage import RolloutStore
    from rlfactory_megatron.rewards import get_scorer

    tokenizer, rule = AutoTokenizer.from_pretrained(run_dir / "checkpoints" / "step_000030" / "hf"), get_scorer("gsm8k")
    agree, right = [], []
    with RolloutStore(run_dir / "cache" / "rollouts", readonly=True) as store:
        for step in store.steps():
            for r in store.read_step(step):
                text = tokenizer.decode([t for t, m in zip(r.response_ids.tolist(), r.loss_mask.tolist()) if m])
                right.append(rule(text, r.metadata["ground_truth"]))
                agree.append(right[-1] == r.metadata["model_score"])
    accuracy = sum(right) / len(right)
    return sum(agree) / len(agree), max(accuracy, 1 - accuracy)


def test_embedded_default_learns_asynchronously_one_step_off_policy_from_a_taught_judge(tmp_path):
    # The engine (a Ray actor of its own) generates the next batch while the actor trains this
    # one, with the default token IS correction; measured with the rule as the reward: val 0.03 ->
    # 0.88, reward 0.52 -> 0.89 (first and last 10 steps). Here its reward is a tiny judge's alone
    # (placement own, one engine), taught first by docs/rewards.md's command; validation stays the rule's.
    judge, held_out_agreement = _taught_judge(tmp_path)
    steps = _learns(tmp_path, "rollout.mode=disaggregated", "rollout.num_engines=1", "trainer.max_staleness=1",
                    f"reward.model.path={judge}", *JUDGED_BY)
    assert [r["rollout/staleness_max"] for r in steps] == [0.0] + [1.0] * 29
    assert steps[0]["rollout/logprob_gap_max"] <= 1e-3  # the first batch: generated by the weights it trains
    assert all(r["rollout_correction/is_weight_max"] <= 2.0 for r in steps)
    # The judge's score was the reward, and no rule ran on training samples.
    assert all(r["reward/score/mean"] == r["reward/model/score/mean"] and "reward/rule/score/mean" not in r
               for r in steps)
    # The tiny judge is far from the rule's equal (it learns the answer line's form and length
    # sooner than comparing digits; measured by hand: 0.77 on held-out judge prompts, 0.62 on
    # the policy's responses), yet it knows more than a constant reply, which is enough to learn from.
    agreement, constant = _agreement_with_rule(tmp_path / "default")
    assert held_out_agreement >= 0.6 and agreement > constant, (held_out_agreement, agreement, constant)
