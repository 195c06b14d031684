"""An engine on every inference group: a 2-rank run generates on 2 engines, each writes its own
rollout shard, every engine serves the actor's weights after each sync, and a run's samples do
not depend on how many engines generate them, colocated or disaggregated behind a router; nor
on a context-parallel group splitting every sequence over 2 ranks (killed and resumed)."""

from rlf_train_cli import (
    assert_same_metrics, kill_after_checkpoint, records, rlf_train, stored_trajectories, torchrun_train)

# mini_batch_size=2: several optimizer steps per RL step, so the trainer computes old log-probs
# and the engines' log-probs are compared with them (rollout/logprob_gap_max) at every step.
RUN = ("trainer.total_steps=3", "trainer.save_every=0", "actor.mini_batch_size=2", "trainer.val_every=3")
# Per engine or DP rank, or (computed_tokens) each DP rank's micro-batches padded to their own longest.
LAYOUT_KEYS = ("rollout/engine_", "rollout/num_engines", "train/dp_", "/computed_tokens")


def _stored_advantages(run_dir) -> dict:
    from rlfactory_megatron.envs.storage import RolloutStore

    with RolloutStore(run_dir / "cache" / "rollouts", readonly=True) as store:
        return {(step, r.sample_id): r.advantages.tolist() for step in store.steps() for r in store.read_step(step)}


def _assert_every_engine_generated(run_records, engines: int):
    for record in run_records[1:]:
        assert record["rollout/num_engines"] == engines
        for engine in range(engines):
            assert record[f"rollout/engine_{engine}_generated_tokens"] > 0
            assert record[f"rollout/engine_{engine}_requests"] >= 2
            assert record[f"rollout/engine_{engine}_weight_version"] == record["step"] - 1
        assert record["rollout/engine_imbalance"] >= 1.0
        assert record["rollout/logprob_gap_max"] <= 1e-4  # every engine serves the actor's weights


def test_two_engines_colocated_disaggregated_or_context_parallel_make_the_samples_one_engine_makes(tmp_path):
    # 1 engine on 1 rank; 2 colocated engines on 2 ranks; 2 disaggregated engines for 2 ranks (for
    # 1 rank: the engine-kill test below); 2 colocated engines on a context-parallel group of 2
    # ranks (one DP rank), killed after its step-2 checkpoint and resumed.
    one = rlf_train(tmp_path, "one", *RUN)
    assert one.returncode == 0, one.stderr[-3000:]
    kill_after_checkpoint(tmp_path, "cp", "step_000002", *RUN, "trainer.save_every=2", "parallel.cp=2")
    cp = rlf_train(tmp_path, "cp", *RUN, "trainer.save_every=2", "parallel.cp=2")
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert "cp=2 on 2 rank(s)" in cp.stdout and "resumed from" in cp.stdout and "step 3/3 | reward" in cp.stdout
    two = torchrun_train(tmp_path, "two", 2, *RUN)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "step 3/3 | reward" in two.stdout
    # Two engines of their own (Ray actors) behind rank 0's router, fed through one broadcast group,
    # feeding two training ranks (dp=2): rank 0 routes, each rank trains its rows.
    pool_dp = torchrun_train(tmp_path, "pool_dp", 2, *RUN, "rollout.mode=disaggregated", "rollout.num_engines=2")
    assert pool_dp.returncode == 0, pool_dp.stderr[-3000:]
    first, second = records(tmp_path / "one"), records(tmp_path / "two")
    pooled_dp, context = records(tmp_path / "pool_dp"), records(tmp_path / "cp")
    _assert_every_engine_generated(first, 1)
    _assert_every_engine_generated(second, 2)
    _assert_every_engine_generated(pooled_dp, 2)
    _assert_every_engine_generated(context, 2)
    for record in second[1:] + pooled_dp[1:]:  # each DP rank received and trained on its own part of the 4 rows
        assert record["train/dp_rows_min"] >= 1 and record["train/dp_rows_min"] + record["train/dp_rows_max"] == 4
        assert record["train/dp_token_imbalance"] >= 1.0
    assert all(r["train/dp_rows_min"] == 4 for r in first[1:] + context[1:])  # CP ranks share the rows
    # One shard per DP rank (its first rank writes what it trained); together they hold each trajectory once.
    shards = sorted(p.name for p in (tmp_path / "two" / "cache" / "rollouts").iterdir())
    assert shards == ["shard-00000-of-00002.h5", "shard-00001-of-00002.h5"]
    alone, together = stored_trajectories(tmp_path / "one"), stored_trajectories(tmp_path / "two")
    assert sorted(together) == sorted(alone) == [(s, f"{r:05d}") for s in (1, 2, 3) for r in range(4)]
    assert together == alone  # the same token ids, masks and rewards
    # Stored where trained (each DP rank's first rank writes its rows): the advantages that rank
    # computed, equal to the one-rank run's, in the shard of the DP rank that trained the row.
    assert _stored_advantages(tmp_path / "two") == _stored_advantages(tmp_path / "one")
    assert _stored_advantages(tmp_path / "pool_dp") == _stored_advantages(tmp_path / "one")
    assert stored_trajectories(tmp_path / "pool_dp") == alone
    assert stored_trajectories(tmp_path / "cp") == alone  # each trajectory once: one DP rank writes its rows
    for run in (second, pooled_dp, context):
        assert [r["step"] for r in run] == [r["step"] for r in first] == [0, 1, 2, 3]
        # DP's gradient all-reduce (and CP's split of attention and of the gradients) sums in
        # another order: rounding differs
        assert_same_metrics(run, first, ignore=LAYOUT_KEYS, rel=1e-5)


# Two engines fed by one model-parallel group (tp=2 or pp=2 by hand): tests/trainer/test_rlf_train_parallel.py.
# One TP engine across a TP group (rollout.tp=2, two per node): tests/trainer/test_multinode.py.


def test_a_disaggregated_engine_killed_mid_step_is_replaced_and_no_trajectory_changes(tmp_path):
    # A calculator whose first call kills engine 0 (a Ray actor) while the step's other samples
    # are in flight on it, and the judge's engine (on devices of its own): the samples run again
    # on engine 1, a new engine 0 gets the next sync's weights, a new judge engine takes the
    # judge's requests, and the run's trajectories and rewards are those of a run where nothing died.
    from pathlib import Path

    faults = Path(__file__).parent / "faults"
    tools = tmp_path / "tools.yaml"
    # The task's own calculator entry (its short description), the killing class in its place.
    tools.write_text("tools:\n  - class: rlf_faulty.EngineKillingCalculator\n"
                     "    description: Evaluate an arithmetic expression.\n")
    # The reward: the task's rule plus the tiny judge's score (the random tiny model writes no
    # score tags: its reply's length is its score, so that every reply counts in the reward).
    parser = tmp_path / "length_parser.py"
    parser.write_text("def parse(reply):\n    return len(reply) / 100.0\n")
    judge = ("reward.model.kind=generative", "reward.model.path=tiny://qwen3", "reward.model.placement=own",
             f"reward.model.parser={parser}:parse", "reward.model.max_tokens=16", "reward.model.max_prompt_tokens=1000",
             "reward.combine.rule_weight=1", "reward.combine.model_weight=1")
    # A longer warm-start, so that the tiny policy calls the calculator (computed once: the killed
    # run loads what the calm one stored); the killing one is the plain calculator (same name and
    # schema) apart from its first call.
    run = (*RUN, "rollout.mode=disaggregated", "rollout.num_engines=2", "trainer.sft_steps=60",
           "trainer.sft_batch_size=16", f"trainer.sft_cache={tmp_path / 'warm-starts'}", "trainer.prompts_per_step=4",
           "trainer.total_steps=2", "trainer.val_every=0",
           "tools.call_timeout_s=300", *judge)  # the killing call's actor lookup must not time out
    # Ray's tool workers import it by name; the marker file makes it kill once in the run.
    env = {"PYTHONPATH": str(faults), "RLF_TEST_KILL_ENGINE_ONCE": str(tmp_path / "engine-killed"),
           "RLF_TEST_ALSO_KILL": "rlf-judge-0-0"}
    calm = rlf_train(tmp_path, "calm", *run)  # the built-in calculator
    killed = rlf_train(tmp_path, "killed", *run, f"tools.config_path={tools}", env=env)
    assert calm.returncode == 0, calm.stderr[-3000:]
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "rollout engine 0 died" in killed.stdout and "judge engine 0 died" in killed.stdout
    assert f"reused from {tmp_path / 'warm-starts'}" in killed.stdout  # the calm run's warm-start
    steps = records(tmp_path / "killed")[1:]
    assert sum(r["rollout/tool_calls_per_sample"] for r in steps) > 0
    assert stored_trajectories(tmp_path / "killed") == stored_trajectories(tmp_path / "calm")
    # The judge scored every sample (its replies in the rewards compared above), none failed. How
    # much of the judging overlapped generation (the reward wait after the last trajectory against
    # the judging time) is reported, not asserted: a wall-time ratio, it moves with the load
    # (10-11% on a quiet machine, 25% under the whole suite).
    for r in records(tmp_path / "calm")[1:] + steps:
        assert r["reward/model/failed/sum"] == 0 and r["reward/model/score/mean"] > 0, r
        assert 0 <= r["reward/model/wait_s/max"] and 0 < r["reward/model/latency_s/sum"], r
    # Marked failed in its step when a request saw it die; with none in flight on it, the check
    # before the sync finds it instead. Either way a new one takes the next sync's weights.
    assert sum(r["rollout/engine_0_failed"] for r in steps) <= 1
    for r in steps:
        assert r["rollout/logprob_gap_max"] <= 1e-4  # every engine serving, the new one too
        assert r["rollout/engine_0_weight_version"] == r["rollout/engine_1_weight_version"] == r["step"] - 1


# A killed two-engine run resumes exactly: tests/trainer/test_rlf_train.py.
