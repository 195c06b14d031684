"""The Ray reward pool on a real local Ray: same rewards as in-process, and misbehaving reward code costs one sample."""
import re
import time

import pytest

from rlfactory_megatron.rewards import RewardConfigError, RewardFnSpec, RewardSample, build_reward_manager
from rlfactory_megatron.rewards.pool import RewardPool, pack_samples, unpack_samples

# Bounds on wall time: run alone, after the parallel part of the suite (scripts/test.sh).
pytestmark = pytest.mark.serial

TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def custom_pool(ray_session, reward_fn_file):
    pool = RewardPool(
        function=RewardFnSpec(path=str(reward_fn_file), kwargs={"bonus": 0.5}),
        num_workers=2,
        sample_timeout_s=TIMEOUT_S,
        num_cpus_per_worker=0.5,
        poll_s=0.1,
    )
    # Warm: the workers' start-up is not what the timing tests measure, whichever of them runs first.
    pool.submit([RewardSample("d", "a", "a") for _ in range(4)]).result()
    yield pool
    pool.shutdown()


def _mixed_batch(n: int) -> list[RewardSample]:
    samples = []
    for i in range(n):
        if i % 2:  # every third of these is wrong
            response = f"so\n#### {i if i % 3 else i + 1}"
            samples.append(RewardSample("openai/gsm8k", response, str(i), response_length=i % 7 + 1))
        else:
            response = f"\\boxed{{\\frac{{{i}}}{{2}}}}"
            samples.append(RewardSample("lighteval/MATH", response, str(i / 2), response_length=3))
    return samples


def test_pool_matches_in_process_scoring(ray_session):
    samples = _mixed_batch(40)
    options = {"max_response_length": 8, "overlong_buffer_len": 4}
    pool = RewardPool("dapo", manager_options=options, num_workers=2, num_cpus_per_worker=0.5)
    expected = build_reward_manager("dapo", **options)(samples)
    try:
        future = pool.submit(samples)
        result = future.result()
    finally:
        pool.shutdown()
    assert future.done()
    assert result.scores == expected.scores
    assert result.extras == expected.extras
    assert result.metrics() == expected.metrics()
    assert 0 < sum(s == 1.0 for s in result.scores) < len(samples)  # the batch has right and wrong answers


def test_samples_travel_as_columns_in_pieces_ray_sends_inline():
    samples = [
        RewardSample("openai/gsm8k", "x" * 1000 + f"#### {i}", str(i), response_length=i, extra_info={"i": [i, None]})
        for i in range(300)
    ] + [RewardSample("d", "", 3.5), RewardSample("d", "r", {"answers": ("a", "b")}, extra_info={"nested": {"k": 1.0}})]
    pieces = pack_samples(samples)
    assert len(pieces) > 1 and all(len(piece) <= 64 * 1024 for piece in pieces)  # Ray's inline limit is 100 KiB
    assert unpack_samples(pieces) == samples
    assert unpack_samples(pack_samples([])) == []


def test_a_batch_of_several_hundred_kib_scores_as_in_process(ray_session):
    samples = [
        RewardSample("openai/gsm8k", "Let me think step by step. " * 40 + f"#### {i if i % 3 else i + 1:,}", str(i), i % 50)
        for i in range(900)
    ]
    expected = build_reward_manager("naive")(samples)
    pool = RewardPool(num_workers=2, num_cpus_per_worker=0.5)
    try:
        result = pool.submit(samples).result()
    finally:
        pool.shutdown()
    assert result == expected
    assert 0 < sum(result.scores) < len(samples)


def test_submit_returns_before_scoring_finishes(custom_pool):
    samples = [RewardSample("d", "a", "a") for _ in range(8)]
    started = time.monotonic()
    futures = [custom_pool.submit(samples), custom_pool.submit(samples[:3])]
    assert time.monotonic() - started < 0.5
    assert [f.result().scores for f in futures] == [[1.5] * 8, [1.5] * 3]


@pytest.mark.parametrize(
    "misbehaviour,error",
    [
        ("raise", "RuntimeError: reward code failed"),
        ("exit", r"worker process died \(exit code 3\)"),  # its scoring process, not the actor
        ("sleep", r"timed out after 1\.5s"),
        ("spin", r"timed out after 1\.5s"),  # a Python loop that never returns
    ],
    ids=["raise", "exit", "sleep", "spin"],
)
def test_misbehaving_sample_costs_only_itself(custom_pool, misbehaviour, error):
    responses = ["a", "b", "a", misbehaviour, "a", "a", "b", "a"]
    started = time.monotonic()
    result = custom_pool.submit([RewardSample("d", r, "a") for r in responses]).result()
    elapsed = time.monotonic() - started
    assert result.scores == [1.5, 0.5, 1.5, 0.0, 1.5, 1.5, 0.5, 1.5]
    assert re.search(error, result.errors[3])
    assert result.errors[:3] + result.errors[4:] == [None] * 7
    # The timeout at most; the rest is scored meanwhile (a spare process takes the queue).
    assert elapsed < TIMEOUT_S + 3.0
    assert custom_pool.submit([RewardSample("d", "a", "a")]).result().scores == [1.5]  # the pool recovered


def test_many_hanging_samples_cost_one_timeout_not_one_each(custom_pool):
    # Each hang runs out its timeout concurrently with the others and with the honest samples,
    # so a step waits ~timeout longer than its slowest honest sample, however many hang.
    responses = ["sleep" if i % 4 == 1 else "a" for i in range(24)] + ["exit", "spin"]
    started = time.monotonic()
    result = custom_pool.submit([RewardSample("d", r, "a") for r in responses]).result()
    elapsed = time.monotonic() - started
    assert [s for s, r in zip(result.scores, responses) if r == "a"] == [1.5] * responses.count("a")
    kinds = dict(zip(responses, result.error_kinds))
    assert kinds == {"a": None, "sleep": "timeout", "exit": "crashed", "spin": "timeout"}
    assert elapsed < 2 * TIMEOUT_S + 3.0, elapsed  # 7 hangs one after another would be 10.5 s


def test_a_crash_costs_nothing_to_another_batch_in_flight(custom_pool):
    crashing = custom_pool.submit([RewardSample("d", r, "a") for r in ["a", "exit", "a", "b"]])
    innocent = custom_pool.submit([RewardSample("d", "a", "a") for _ in range(6)])
    assert innocent.result().errors == [None] * 6
    result = crashing.result()
    assert result.scores == [1.5, 0.0, 1.5, 0.5]
    assert result.error_kinds[1] == "crashed" and result.errors.count(None) == 3


def test_a_batched_call_that_kills_its_actor_costs_only_its_culprit(ray_session, tmp_path):
    # A batched function runs in the actor itself: the pool finds the culprit by splitting the batch.
    path = tmp_path / "batched.py"
    path.write_text("import os\n"
                    "def score(data_sources, solution_strs, ground_truths, extra_infos):\n"
                    "    if 'exit' in solution_strs:\n"
                    "        os._exit(3)\n"
                    "    return [float(s == t) for s, t in zip(solution_strs, ground_truths)]\n")
    pool = RewardPool("batch", RewardFnSpec(path=str(path), name="score"), num_workers=2, sample_timeout_s=TIMEOUT_S,
                      num_cpus_per_worker=0.5, poll_s=0.1)
    try:
        result = pool.submit([RewardSample("d", r, "a") for r in ["a", "b", "exit", "a"]]).result()
    finally:
        pool.shutdown()
    assert result.scores == [1.0, 0.0, 0.0, 1.0]
    assert re.search(r"reward worker (died|unresponsive)", result.errors[2]) and result.errors.count(None) == 3


def test_reward_code_holding_the_gil_costs_only_itself(ray_session, tmp_path):
    path = tmp_path / "regex_reward.py"
    # Catastrophic backtracking: the regex engine never releases the GIL; it runs in a scoring
    # process of its own, killed at its timeout.
    path.write_text(
        "import re\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'regex':\n"
        "        re.match(r'(a+)+$', 'a' * 64 + 'b')\n"
        "    return float(solution_str == ground_truth)\n"
    )
    pool = RewardPool(
        function=RewardFnSpec(path=str(path)), num_workers=2, sample_timeout_s=1.0, num_cpus_per_worker=0.5, poll_s=0.1
    )
    try:
        result = pool.submit([RewardSample("d", r, "a") for r in ["a", "regex", "a", "b"]]).result()
    finally:
        pool.shutdown()
    assert result.scores == [1.0, 0.0, 1.0, 0.0]
    assert "timed out after 1s" in result.errors[1] and result.errors.count(None) == 3


def test_pool_checks_config_before_starting_actors(ray_session, tmp_path):
    with pytest.raises(RewardConfigError, match="no file at"):
        RewardPool(function=RewardFnSpec(path=str(tmp_path / "missing.py")))
    with pytest.raises(RewardConfigError, match="reward.manager: unknown"):
        RewardPool("fastest")
