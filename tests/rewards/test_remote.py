"""The remote reward endpoint against a real local HTTP server: both protocols, the judge's
template and parser, retries with backoff, the concurrency cap, on_error for every fault, the
combination with the rule, and the settings refused at load."""
import json
import re
import sys
import time
from pathlib import Path

import pytest

from rlfactory_megatron.config import ConfigError, load_config
from rlfactory_megatron.rewards import CombineSpec, RemoteRewardSpec, RewardResult, RewardSample
from rlfactory_megatron.rewards.combine import combined
from rlfactory_megatron.rewards.judge import JudgePrompt, ReplyNotParsed, reply_parser
from rlfactory_megatron.rewards.remote import RemoteReward

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer" / "faults"))
from rlf_judge import LocalJudge, chat_completion, faulty_answer  # noqa: E402

TAG = r"<score>\s*([-+]?[0-9]*\.?[0-9]+)\s*</score>"


def spec(url: str, protocol: str = "score", **kw) -> RemoteRewardSpec:
    fields = dict(url=url, protocol=protocol, served_model=None, api_key_env=None, timeout_s=2.0, max_retries=2,
                  backoff_s=0.05, max_concurrency=8, template=None, parser=TAG, max_tokens=64, temperature=0.0,
                  on_error=-1.0)
    return RemoteRewardSpec(**{**fields, **kw})


SAMPLES = [RewardSample("qa", f"answer {i}", str(i), prompt=f"question {i}",
                        tool_calls=[{"name": "search", "arguments": {"q": "x"}, "observation": "found x"}] if i == 0 else [])
           for i in range(4)]


def test_score_protocol_posts_prompt_response_label_and_reads_the_score():
    with LocalJudge(lambda body: (200, json.dumps({"score": len(body["response"]) + int(body["label"])}), 0.0)) as judge:
        out = RemoteReward(spec(judge.url)).score(SAMPLES)
    assert [o.score for o in out] == [8.0 + i for i in range(4)]
    assert all(o.error is None and o.retries == 0 and o.reply is None for o in out)
    assert sorted(b["prompt"] for *_, b in judge.requests) == [f"question {i}" for i in range(4)]
    assert {tuple(sorted(b)) for *_, b in judge.requests} == {("label", "prompt", "response")}


def test_chat_protocol_renders_the_template_and_parses_the_reply(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("Q: {prompt}\nA: {response}\nRef: {ground_truth}\nCalls: {tool_calls}")
    with LocalJudge(lambda body: (200, chat_completion(f"fine <score>0.5</score> no, <score>{len(body['messages'])}"
                                                       "</score>"), 0.0)) as judge:
        out = RemoteReward(spec(judge.url, "chat", template=str(template), served_model="judge-7b",
                                max_tokens=32, temperature=0.3)).score(SAMPLES[:2])
    assert [o.score for o in out] == [1.0, 1.0]  # the last match
    assert out[0].reply.startswith("fine <score>0.5")
    bodies = sorted((b for *_, b in judge.requests), key=lambda b: b["messages"][0]["content"])
    assert bodies[0]["model"] == "judge-7b" and bodies[0]["max_tokens"] == 32 and bodies[0]["temperature"] == 0.3
    assert bodies[0]["messages"] == [{"role": "user", "content": 'Q: question 0\nA: answer 0\nRef: 0\n'
                                                                 'Calls: search({"q": "x"}) -> found x'}]
    assert bodies[1]["messages"][0]["content"].endswith("Calls: (none)")


def test_faults_cost_their_samples_on_error_and_retries_are_counted():
    """Timeouts, 500, garbage and unparsed replies (each sample's fault fixed by its text, plus one
    transient 503): every sample comes back; the failed ones with on_error and the reason, the
    others with the judge's score; retries counted, a parse failure not retried."""
    seen: dict[str, int] = {}

    def answer(body):
        text = body["messages"][0]["content"]
        i = int(re.search(r"r(\d+)", text)[1])
        seen[text] = seen.get(text, 0) + 1
        kind = ("hang", "500", "garbage", "unparsed", "ok", "flaky")[i % 6]
        if fault := faulty_answer(kind, 1.0):
            return fault
        if kind == "flaky" and seen[text] == 1:
            return 503, "busy", 0.0
        return 200, chat_completion(f"<score>{i}</score>"), 0.0

    samples = [RewardSample("qa", f"r{i}", "1", prompt="q") for i in range(12)]
    with LocalJudge(answer) as judge:
        out = RemoteReward(spec(judge.url, "chat", timeout_s=0.5, max_retries=1, backoff_s=0.01)).score(samples)
    reasons = [o.error for o in out]
    for i in (0, 6):
        assert reasons[i] == "timed out after 0.5s (after 2 attempts)" and out[i].retries == 1
    for i in (1, 7):
        assert reasons[i].startswith("HTTP 500") and reasons[i].endswith("(after 2 attempts)")
    for i in (2, 8):
        assert "the body is not JSON" in reasons[i]
    for i in (3, 9):
        assert out[i].parse_failed and out[i].reply == "I cannot decide." and out[i].retries == 0
    assert all(out[i].score == -1.0 for i in range(12) if i % 6 < 4)
    assert [(out[i].score, out[i].error, out[i].retries) for i in (4, 5, 10, 11)] == [
        (4.0, None, 0), (5.0, None, 1), (10.0, None, 0), (11.0, None, 1)]
    assert all(not o.parse_failed for i, o in enumerate(out) if i % 6 != 3)
    assert len(judge.requests) == 12 + sum(o.retries for o in out) == 12 + 8


def test_retries_back_off_and_a_4xx_is_not_retried():
    with LocalJudge(lambda body: (503, "busy", 0.0)) as judge:
        out = RemoteReward(spec(judge.url, max_retries=2, backoff_s=0.2)).score(SAMPLES[:1])
    times = [t for t, *_ in judge.requests]
    assert len(times) == 3 and out[0].retries == 2 and "HTTP 503" in out[0].error and "after 3 attempts" in out[0].error
    assert times[1] - times[0] >= 0.2 and times[2] - times[1] >= 0.4  # 0.2 s, then doubled
    with LocalJudge(lambda body: (422, "bad request", 0.0)) as judge:
        out = RemoteReward(spec(judge.url)).score(SAMPLES[:1])
    assert len(judge.requests) == 1 and out[0].retries == 0 and out[0].error.startswith("HTTP 422")


def test_requests_in_flight_never_exceed_max_concurrency():
    with LocalJudge(lambda body: (200, json.dumps({"score": 1}), 0.1)) as judge:
        out = RemoteReward(spec(judge.url, max_concurrency=3)).score(SAMPLES * 3)
    assert all(o.score == 1.0 for o in out) and judge.max_in_flight == 3


def test_an_api_key_goes_as_a_bearer_token(monkeypatch):
    monkeypatch.setenv("RLF_TEST_JUDGE_KEY", "s3cret")
    with LocalJudge(lambda body: (200, json.dumps({"score": 1}), 0.0)) as judge:
        RemoteReward(spec(judge.url, api_key_env="RLF_TEST_JUDGE_KEY")).score(SAMPLES[:1])
    assert judge.requests[0][2]["Authorization"] == "Bearer s3cret"


def test_parsers_regex_and_function_from_a_file(tmp_path):
    parse = reply_parser(r"Score: (\d+)")
    assert parse("Score: 3 ... Score: 7") == 7.0
    with pytest.raises(ReplyNotParsed):
        parse("no score")
    with pytest.raises(ReplyNotParsed):
        reply_parser(TAG)("<score>nan</score> <score>.</score>")
    fn = tmp_path / "parse.py"
    fn.write_text("def read(reply):\n    return {'yes': 1.0, 'no': 0.0}[reply.strip().lower()]\n")
    assert reply_parser(f"{fn}:read")(" Yes ") == 1.0
    assert JudgePrompt.from_config(None).template.count("{response}") == 1
    long_template = "Grade {response}. " + "Be strict. " * 500  # a string longer than a path can be
    assert JudgePrompt.from_config(long_template).template == long_template


def test_combine_weighted_function_and_model_alone(tmp_path):
    from rlfactory_megatron.rewards.remote import ModelScore

    samples = SAMPLES[:2]
    rule = RewardResult([1.0, 0.0], [3, 4], [{"overlong": 0.0}, {"overlong": 1.0}], [None, "boom"], [None, "raised"])
    model = [ModelScore(0.5, reply="<score>0.5</score>", latency_s=0.2, retries=1),
             ModelScore(-1.0, error="HTTP 500", latency_s=0.4, retries=2)]
    weighted = combined(samples, rule, model, CombineSpec(rule_weight=0.5, model_weight=2.0).load())
    assert weighted.scores == [1.5, -2.0] and weighted.errors == [None, "boom"]
    assert weighted.extras[0]["model/reply"] == "<score>0.5</score>" and weighted.extras[1]["model/error"] == "HTTP 500"
    metrics = weighted.metrics()
    assert metrics["reward/model/failed/sum"] == 1.0 and metrics["reward/model/retries/sum"] == 3.0
    assert metrics["reward/model/latency_s/max"] == 0.4 and metrics["reward/rule/score/mean"] == 0.5
    assert combined(samples, None, model, CombineSpec().load()).scores == [0.5, -1.0]
    fn = tmp_path / "mix.py"
    fn.write_text("def combine(rule_score, model_score, data_source, solution_str, ground_truth, extra_info):\n"
                  "    return max(rule_score, model_score) if solution_str != 'answer 1' else 1 / 0\n")
    mixed = combined(samples, rule, model, CombineSpec(function_path=str(fn)).load())
    assert mixed.scores == [1.0, 0.0] and "ZeroDivisionError" in mixed.errors[1]
    assert not CombineSpec(model_weight=1.0).uses_rule and CombineSpec(rule_weight=1.0).uses_rule


@pytest.mark.parametrize("overrides, message", [
    (["reward.remote.url=localhost:8000"], "reward.remote.url: 'localhost:8000' is no http(s) URL"),
    (["reward.remote.url=http://h/s", "reward.remote.protocol=grpc"], "reward.remote.protocol='grpc' is not allowed"),
    (["reward.remote.url=http://h/c", "reward.remote.protocol=chat", "reward.model.template=Q {prompt}"],
     "reward.model.template: has no {response}"),
    (["reward.remote.url=http://h/c", "reward.remote.protocol=chat", "reward.model.template=Answer {response} {answer}"],
     "reward.model.template: unknown field(s) ['answer']"),
    (["reward.remote.url=http://h/c", "reward.remote.protocol=chat", "reward.model.parser=score"],
     "reward.model.parser: the regex 'score' has no group"),
    (["reward.remote.url=http://h/c", "reward.remote.protocol=chat", "reward.model.parser=/no/such.py:parse"],
     "reward.model.parser: no file at /no/such.py"),
    (["reward.remote.url=http://h/c", "reward.combine.function_path=/no/mix.py"],
     "reward.combine.function_path: no file at /no/mix.py"),
    (["reward.remote.url=http://h/c", "reward.combine.function_path=/no/mix.py", "reward.combine.rule_weight=1"],
     "reward.combine: give weights"),
    (["reward.combine.model_weight=1"], "reward.combine: mixes a model score with the rule, but no model reward"),
    (["reward.model.template=Answer {response}"], "reward.model.template: is set, but no model reward reads it"),
    (["reward.remote.url=http://h/s", "reward.model.template=Answer {response}"], "only the chat protocol sends a prompt"),
    (["reward.remote.url=http://h/s", "reward.remote.max_concurrency=0"], "reward.remote.max_concurrency"),
    (["reward.remote.url=http://h/s", "reward.model.on_error=nan"], "reward.model.on_error: must be a finite number"),
])
def test_bad_settings_are_refused_at_load_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=overrides)
    assert message in str(exc.value)


def test_the_model_alone_needs_no_scorer_for_the_data_source():
    """An open-ended task's data source has no rule: with the endpoint alone the rule is never loaded."""
    cfg = load_config(overrides=["reward.remote.url=http://h/s", "reward.scorer=no_such_scorer"])
    assert cfg.reward.remote.url == "http://h/s"
    with pytest.raises(ConfigError, match="reward.scorer: unknown 'no_such_scorer'"):
        load_config(overrides=["reward.remote.url=http://h/s", "reward.scorer=no_such_scorer",
                               "reward.combine.rule_weight=1"])
