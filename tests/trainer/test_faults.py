"""Faults through the real `rlf-train`: a calculator tool, a reward function and a remote judge
that fail at random in every way (raise, hang, block, 4 MB output, exit the worker, lone
surrogates; NaN, inf, a string, hang, exit; a judge that times out, answers 500, garbage or no
score) cost their samples, never the run or the weights."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlf_train_cli import BIN, env_for, records

# Not in pytest.ini's pythonpath: the folder's sitecustomize.py is for the runs that are handed it.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "faults"))
from rlf_judge import FaultyChatJudge, LocalJudge  # noqa: E402

FAULTS = Path(__file__).parent / "faults"
STEPS = 3


def test_a_run_with_faulty_tools_and_rewards_trains_to_the_end(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class: rlf_faulty.FaultyCalculator\n")
    hung = tmp_path / "hung"
    hung.mkdir()
    # Ray's tool and reward workers import rlf_faulty by name; its hung scorers say how many others hang beside them.
    env = dict(env_for(tmp_path), PYTHONPATH=str(FAULTS), RLF_TEST_HUNG_DIR=str(hung))
    # A real warm-start (the tiny policy then calls the calculator), three RL steps of 8 x 8 samples (each fault kind, at 1 in 9 to 1 in 12, is met ~16-20 times).
    # The reward: the faulty rule plus a local chat judge that fails a share of its requests.
    judge = FaultyChatJudge(hang_s=3.0)
    with LocalJudge(judge) as server:
        args = [f"trainer.output_dir={tmp_path / 'run'}", f"trainer.total_steps={STEPS}", f"tools.config_path={tools}",
                f"reward.custom_function_path={FAULTS / 'rlf_faulty.py'}", "reward.timeout_s=2", "tools.call_timeout_s=2",
                f"reward.remote.url={server.url}", "reward.remote.protocol=chat", "reward.remote.timeout_s=1",
                "reward.remote.max_retries=1", "reward.remote.backoff_s=0.1", "reward.remote.max_concurrency=64",
                "reward.model.on_error=-1", "reward.combine.rule_weight=1", "reward.combine.model_weight=1",
                "trainer.sft_steps=60", "trainer.sft_batch_size=16", "trainer.val_every=0", "trainer.save_every=0"]
        out = subprocess.run([str(BIN / "rlf-train"), *args], capture_output=True, text=True, env=env, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in records(tmp_path / "run") if r["step"] > 0]  # (step 0: the warm-start's loss)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:  # a non-finite weight would have stopped the run at its sync; the numbers stay finite
        for key in ("actor/pg_loss", "actor/entropy_old", "actor/grad_norm", "reward/score/mean"):
            assert math.isfinite(r[key]), (r["step"], key, r[key])
        assert r["actor/skipped_steps"] == 0  # no NaN reached the loss
        assert r["reward/errors"] == sum(r[f"reward/errors/{k}"] for k in ("raised", "invalid", "timeout", "crashed"))
    # Hung samples run out their timeout concurrently, each in a scoring process of its own: some
    # hung scorer found another alive beside it (one after another, none ever would). A count of
    # live processes, not a wall-time bound, which a loaded host would break.
    seen = [int(f.read_text()) for f in hung.glob("*.seen")]
    assert len(seen) >= 2 and max(seen) >= 1, seen
    total = {key: sum(r[key] for r in steps) for key in steps[0] if key.startswith(("reward/errors/", "tools/errors/"))}
    for kind in ("raised", "invalid", "timeout", "crashed"):  # NaN, inf and the string are 'invalid'
        assert total[f"reward/errors/{kind}"] > 0, total
    assert sum(r["rollout/tool_calls_per_sample"] for r in steps) > 0
    # Which kinds a failed call reports depends on what else its actor was doing: a call that blocks
    # the actor's event loop times out every call then in flight, one that exits the actor fails
    # them all as actor_died. Every failure is counted under one kind.
    kinds = [k for k in total if k.startswith("tools/errors/")]
    assert sum(total[k] for k in kinds) == sum(r["tools/errors"] for r in steps) > 0, total
    assert total["tools/errors/timeout"] + total["tools/errors/actor_died"] > 0, total
    # The judge: its faults cost their samples reward.model.on_error, counted; retried requests counted.
    model = {key: sum(r[f"reward/model/{key}/sum"] for r in steps) for key in ("failed", "parse_failed", "retries")}
    assert 0 < model["parse_failed"] < model["failed"] < STEPS * 64 and model["retries"] > 0, model
    # Every request the judge saw was counted, as a sample's first ask or as a retry (an attempt that
    # timed out before a loaded server read it is counted but not seen; the unit tests count exactly).
    assert len(server.requests) <= STEPS * 64 + model["retries"], (len(server.requests), model)
    assert all(r["reward/model/latency_s/max"] > 0 for r in steps)

    # What the agent did, readable: the cache's trajectories decoded with the run's tokenizer,
    # tool calls (the faulty ones' odd output included) and rewards.
    show = subprocess.run([str(BIN / "rlf-cache"), "show", str(tmp_path / "run"), "--step", str(STEPS)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert show.returncode == 0, show.stderr[-2000:]
    assert show.stdout.count(f"=== step {STEPS} sample ") == 64 and "<|im_start|>user" in show.stdout
    assert "--- policy (" in show.stdout and "| reward " in show.stdout
    called = [r for r in steps if r["rollout/tool_calls_per_sample"] > 0][-1]["step"]
    shown = subprocess.run([str(BIN / "rlf-cache"), "show", str(tmp_path / "run"), "--step", str(called)],
                           capture_output=True, text=True, env=env, timeout=120).stdout
    assert "--- tool call (turn 0): calculator(" in shown
    # One sample by its number (issue 61 item 8: `--sample 3` was refused, 00003 needed); stats and
    # verify take the run's output folder as show does (they said "no shard files").
    one = subprocess.run([str(BIN / "rlf-cache"), "show", str(tmp_path / "run"), "--step", str(STEPS), "--sample", "3"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert one.returncode == 0 and one.stdout.count("=== step ") == 1 and f"=== step {STEPS} sample 00003" in one.stdout
    for command in ("stats", "verify"):
        done = subprocess.run([str(BIN / "rlf-cache"), command, str(tmp_path / "run")], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 0, (command, done.stderr[-2000:])
        assert "shard-00000-of-00001.h5" in done.stdout or "shard(s) checked, 0 problem(s)" in done.stdout, done.stdout
    out = tmp_path / "step.jsonl"
    subprocess.run([str(BIN / "rlf-cache"), "export", str(tmp_path / "run"), "--step", str(STEPS), "--out", str(out), "--text"],
                   check=True, capture_output=True, env=env, timeout=120)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 64 and all("<|im_start|>user" in row["prompt_text"] for row in rows)
    # Each sample's reward is its rule score plus its model score: the judge's score for the reply
    # the judge sent it (numbered), or on_error (-1) with the reason when the judge failed it.
    for row in rows:
        meta = row["metadata"]
        assert row["reward"] == pytest.approx(meta["rule_score"] + meta["model_score"]), meta
        if meta.get("model_error"):
            assert meta["model_score"] == -1.0, meta
        else:
            assert judge.scored[int(meta["model_reply"].split()[0][1:])] == meta["model_score"], meta
    assert {bool(row["metadata"].get("model_error")) for row in rows} == {True, False}
    assert "--- judge reply\n#" in show.stdout and "model score " in show.stdout
    assert all(row["turns_text"][0]["role"] == "assistant" for row in rows)
