"""`rlf-bench e2e` runs both sides end to end (smallest settings here; the figures come from the full run)."""
import json
import os
import subprocess

import pytest

from console_scripts import BIN


@pytest.mark.slow  # starts vLLM, Ray and a megatron actor; still part of the normal suite
def test_bench_e2e_reports_both_sides_on_the_longtail_workload_and_async(tmp_path):
    """--workload longtail teaches the model its answer lengths, then runs both sides on it; each
    side reports real vs computed tokens (TRL's padded batch computes at least the real ones).
    --async in the same command (one benchmark process for both: each start costs ~10 CPU-s)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RLF_CACHE_HOME=str(tmp_path / "cache"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RAY_ADDRESS"):
        env.pop(var, None)
    out = tmp_path / "e2e.json"
    args = ["e2e", "--workload", "longtail", "--longtail-sft-steps", "3", "--longtail-mean", "8",
            "--prompts", "2", "--n", "2", "--max-tokens", "24", "--warmup", "0", "--steps", "1",
            "--target", "0", "--async", "--async-target", "0", "--out", str(out)]
    run = subprocess.run([str(BIN / "rlf-bench"), *args], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["workload"] == "longtail" and report["settings"]["max_tokens"] == 24
    for side in ("ours", "trl"):
        assert report[side]["tokens_per_s"] > 0 and report[side]["completion_tokens_per_s"] > 0, report[side]
        assert 0 < report[side]["completion_tokens_per_step"] <= 2 * 2 * 24
    shares = report["ours"]["phase_shares"]
    assert set(shares) == {"generate", "logprob", "reward_wait", "update", "sync", "other"}
    assert abs(sum(shares.values()) - 1.0) < 1e-6 and shares["generate"] > 0 and shares["update"] > 0
    assert report["ratio_tokens_per_s"] == report["ours"]["tokens_per_s"] / report["trl"]["tokens_per_s"]
    assert "tokens/s (prompt+completion)" in run.stdout and "ratio ours/TRL" in run.stdout
    assert "command: OMP_NUM_THREADS=1 rlf-bench e2e --workload longtail" in run.stdout
    # --async: ours on a disaggregated engine, synchronously and one step off-policy.
    runs = report["async"]
    for name in ("synchronous", "asynchronous"):
        assert runs[name]["tokens_per_s"] > 0 and runs[name]["phase_shares"]["update"] > 0
    assert runs["ratio_tokens_per_s"] == runs["asynchronous"]["tokens_per_s"] / runs["synchronous"]["tokens_per_s"]
    assert 0 <= runs["generation_hidden"] <= 1 and "ratio asynchronous/synchronous" in run.stdout
    taught = list((tmp_path / "cache" / "longtail").glob("*/config.json"))
    assert len(taught) == 1, "the taught model is kept in the cache for the next run"
    for side in ("ours", "trl"):
        assert 0 < report[side]["longest_completion_max"] <= 24
        for phase in ("generate", "update"):
            counts = report[side][f"{phase}_tokens"]
            assert 0 < counts["real_per_step"] <= counts["computed_per_step"], (side, phase, counts)
    # Continuous batching computes the real tokens only; our update's packing pads to a multiple of 8 at most.
    assert report["ours"]["generate_tokens"]["real_share"] == 1.0
    assert report["ours"]["update_tokens"]["computed_per_step"] <= report["ours"]["update_tokens"]["real_per_step"] + 8
    assert "real /" in run.stdout and "--workload longtail" in run.stdout


@pytest.mark.slow
def test_bench_e2e_tools_workload(tmp_path):
    """--workload tools teaches the model calculator calls, then runs TRL's GRPOTrainer(tools=...)
    and ours per sample and in lock-step: both sides call the tool, and ours reports the
    per-sample/lock-step ratio."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RLF_CACHE_HOME=str(tmp_path / "cache"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RAY_ADDRESS"):
        env.pop(var, None)
    out = tmp_path / "e2e.json"
    args = ["e2e", "--workload", "tools", "--teach-steps", "60", "--turn-mean", "2", "--prompts", "2", "--n", "2",
            "--max-tokens", "64", "--warmup", "0", "--steps", "1", "--target", "0", "--lockstep-target", "0",
            "--out", str(out)]
    run = subprocess.run([str(BIN / "rlf-bench"), *args], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["workload"] == "tools" and report["settings"]["max_turns"] == 4
    assert len(list((tmp_path / "cache" / "tools").glob("*/config.json"))) == 1
    lockstep = report["lockstep"]["ours_lockstep"]
    for side in (report["ours"], report["trl"], lockstep):
        assert side["tool_calls_per_sample"] > 0, "the taught model calls the calculator on both sides"
        assert 0 < side["longest_completion_max"] <= 64
    assert report["lockstep"]["ratio_tokens_per_s"] == report["ours"]["tokens_per_s"] / lockstep["tokens_per_s"]
    assert "ratio per-sample/lock-step" in run.stdout and "tool calls per sample" in run.stdout


def test_thread_settings_compare_each_run_at_its_best_setting():
    from rlfactory_megatron.bench.e2e import combine_thread_settings

    def report(ours, trl, lockstep):
        return {"ours": {"tokens_per_s": ours}, "trl": {"tokens_per_s": trl},
                "lockstep": {"ours_lockstep": {"tokens_per_s": lockstep}}}

    combined = combine_thread_settings({"1": report(400.0, 500.0, 300.0), "2": report(350.0, 800.0, 320.0)},
                                       {"target": 0.85, "lockstep_target": 1.5, "async_target": 1.6})
    assert combined["best"]["ours"] == {"omp_num_threads": "1", "tokens_per_s": 400.0}
    assert combined["best"]["TRL"] == {"omp_num_threads": "2", "tokens_per_s": 800.0}
    by_ratio = {t["ratio"]: t for t in combined["targets"]}
    assert set(by_ratio) == {"ours/TRL", "per-sample/lock-step"}  # no --async runs, no async target
    assert by_ratio["ours/TRL"]["value"] == 0.5 and not by_ratio["ours/TRL"]["met"]
    assert by_ratio["ours/TRL"]["at"] == {"ours": "1", "TRL": "2"}
    assert by_ratio["per-sample/lock-step"]["value"] == 1.25 and by_ratio["per-sample/lock-step"]["at"]["lock-step"] == "2"
    assert combined["per_setting"]["2"] == {"ours": 350.0, "TRL": 800.0, "lock-step": 320.0}


@pytest.mark.slow
def test_bench_e2e_threads_runs_each_setting_in_its_own_process_and_ours_on_two_ranks(tmp_path):
    env = dict(os.environ, RLF_CACHE_HOME=str(tmp_path / "cache"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RAY_ADDRESS", "OMP_NUM_THREADS"):
        env.pop(var, None)
    out = tmp_path / "e2e.json"
    args = ["e2e", "--threads", "1,2", "--ranks", "2", "--prompts", "2", "--n", "2", "--max-tokens", "8",
            "--warmup", "0", "--steps", "1", "--target", "0", "--out", str(out)]
    run = subprocess.run([str(BIN / "rlf-bench"), *args], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    combined = json.loads(out.read_text())
    for threads in ("1", "2"):  # each child ran at its own setting, and reported it
        assert combined["reports"][threads]["settings"]["omp_num_threads"] == threads
        assert combined["reports"][threads]["ours"]["threads"] == int(threads)
        assert combined["reports"][threads]["settings"]["ours_ranks"] == 2
        assert combined["per_setting"][threads]["ours"] > 0 and combined["per_setting"][threads]["TRL"] > 0
    (target,) = combined["targets"]
    assert target["ratio"] == "ours/TRL" and target["target"] == 0 and target["met"]
    assert "at each side's best setting" in run.stdout and "OMP_NUM_THREADS=2 (2/2" in run.stdout
    assert "2 processes x 1 torch threads" in run.stdout and "2 processes x 2 torch threads" in run.stdout
