"""Reward managers (registry): how a batch of samples becomes rewards — per sample, in one
batched call, in worker processes with a timeout, or with DAPO's overlong penalty."""
import inspect
from collections.abc import Callable

from rlfactory_megatron.registry import Registry
from rlfactory_megatron.rewards.combine import CombineSpec
from rlfactory_megatron.rewards.custom import RewardConfigError, RewardFnSpec, load_reward_fn
from rlfactory_megatron.rewards.process_workers import ScoringProcesses
from rlfactory_megatron.rewards.records import RewardResult, RewardSample
from rlfactory_megatron.rewards.remote import RemoteRewardSpec, check_remote
from rlfactory_megatron.rewards.scoring import score_batch, score_one
from rlfactory_megatron.rewards.served_judge import JudgeSpec

# Called with the sample indices a manager is about to score, so a supervisor (the Ray
# reward pool) can tell which sample is stuck when a call does not come back.
ProgressHook = Callable[[list[int]], None]


def _no_progress(indices: list[int]) -> None:
    return None


class RewardManager:
    """Turns a batch of samples into a RewardResult; `close()` frees what it holds."""

    batched = False  # its reward function takes whole batches (lists), not one sample

    def __call__(self, samples: list[RewardSample], on_start: ProgressHook = _no_progress) -> RewardResult:
        raise NotImplementedError

    def isolate(self, timeout_s: float, num_processes: int = 2) -> None:
        """Score samples in worker processes killed past `timeout_s` each, where the manager can
        (per-sample managers); one batched call stays where it is (its caller supervises it)."""
        return None

    def close(self) -> None:
        return None


class NaiveRewardManager(RewardManager):
    """One reward-function call per sample: in this process, or, once `isolate`d, in worker
    processes where a sample that hangs or exits costs only itself."""

    def __init__(self, function: RewardFnSpec) -> None:
        self.fn = load_reward_fn(function)
        self.function = function
        self.processes: ScoringProcesses | None = None

    def isolate(self, timeout_s: float, num_processes: int = 2) -> None:
        """Score each sample in one of `num_processes` worker processes (plus spares while a
        sample is slow), killed past `timeout_s`."""
        self.close()
        self.processes = ScoringProcesses(self.function, num_processes, timeout_s)

    def __call__(self, samples: list[RewardSample], on_start: ProgressHook = _no_progress) -> RewardResult:
        if self.processes is not None:  # the processes keep their own time: the supervisor gets the whole call
            on_start(list(range(len(samples))))
            return RewardResult.from_scores(samples, self.processes.score(samples))
        outcomes = []
        for index, sample in enumerate(samples):
            on_start([index])
            outcomes.append(score_one(self.fn, sample, index))
        return RewardResult.from_scores(samples, outcomes)

    def close(self) -> None:
        if self.processes is not None:
            self.processes.close()
            self.processes = None


class BatchRewardManager(RewardManager):
    """One call of a batched reward function for the whole batch (for functions that vectorize or call a service)."""

    batched = True

    def __init__(self, function: RewardFnSpec) -> None:
        self.fn = load_reward_fn(function, batched=True)

    def __call__(self, samples: list[RewardSample], on_start: ProgressHook = _no_progress) -> RewardResult:
        on_start(list(range(len(samples))))
        return RewardResult.from_scores(samples, score_batch(self.fn, samples))


class PrimeRewardManager(NaiveRewardManager):
    """Per-sample calls spread over `num_processes` worker processes; a sample past `timeout_s`
    or crashing its process scores 0."""

    def __init__(self, function: RewardFnSpec, num_processes: int = 4, timeout_s: float = 300.0) -> None:
        if num_processes < 1 or timeout_s <= 0:
            raise RewardConfigError(
                "reward.manager_options: prime needs num_processes >= 1 and timeout_s > 0, "
                f"got num_processes={num_processes}, timeout_s={timeout_s}"
            )
        super().__init__(function)  # loads the function: fail here, at start-up, not in every process
        # num_processes is a cap (a rate-limited judge behind the function): no spares.
        self.processes = ScoringProcesses(function, num_processes, timeout_s, max_spares=0)

    def isolate(self, timeout_s: float, num_processes: int = 2) -> None:
        return None  # its own processes and timeout (reward.manager_options) hold


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong penalty: 0 up to `max_length - buffer` tokens, then linear to `-factor` at `max_length`."""
    exceeded = length - (max_length - buffer)
    return min(-exceeded / buffer * factor, 0.0)


class DapoRewardManager(NaiveRewardManager):
    """Per-sample scores plus DAPO's overlong penalty for responses in the last `overlong_buffer_len` tokens."""

    def __init__(
        self,
        function: RewardFnSpec,
        max_response_length: int,
        overlong_buffer_len: int,
        overlong_penalty_factor: float = 1.0,
    ) -> None:
        if not 0 < overlong_buffer_len <= max_response_length:
            raise RewardConfigError(
                "reward.manager_options.overlong_buffer_len: must be in (0, max_response_length="
                f"{max_response_length}], got {overlong_buffer_len}"
            )
        if overlong_penalty_factor < 0:
            raise RewardConfigError(
                f"reward.manager_options.overlong_penalty_factor: must be >= 0, got {overlong_penalty_factor}"
            )
        super().__init__(function)
        self.max_response_length = max_response_length
        self.buffer = overlong_buffer_len
        self.factor = overlong_penalty_factor

    def __call__(self, samples: list[RewardSample], on_start: ProgressHook = _no_progress) -> RewardResult:
        result = super().__call__(samples, on_start)
        for i, length in enumerate(result.response_lengths):
            penalty = overlong_penalty(length, self.max_response_length, self.buffer, self.factor)
            result.scores[i] += penalty
            result.extras[i] = {**result.extras[i], "overlong_reward": penalty, "overlong": float(penalty < 0)}
        return result


REWARD_MANAGERS: Registry[type[RewardManager]] = Registry("reward manager")
for _name, _cls in (("naive", NaiveRewardManager), ("batch", BatchRewardManager), ("prime", PrimeRewardManager),
                    ("dapo", DapoRewardManager)):
    REWARD_MANAGERS.register(_name, _cls)


def build_reward_manager(name: str, function: RewardFnSpec | None = None, **options: object) -> RewardManager:
    """The manager registered as `name` (config `reward.manager`) with `options` (`reward.manager_options`)."""
    cls = _checked_manager(name, function or RewardFnSpec(), options)
    return cls(function or RewardFnSpec(), **options)


def check_reward_config(name: str, function: RewardFnSpec, options: dict, remote: RemoteRewardSpec | None = None,
                        combine: CombineSpec | None = None, judge: JudgeSpec | None = None) -> None:
    """Everything about the reward settings that can be known without scoring: the manager and
    its options, the scorer, the custom function (imported) and its signature, when the rule is
    computed; the model reward's settings (the remote endpoint's or the served judge's: template,
    parser, engines) and the combination. Starts nothing."""
    combine = combine or CombineSpec()
    if remote is not None and judge is not None:
        raise RewardConfigError("reward.model.kind: a run has one model reward, and reward.remote.url is set too; "
                                "set reward.model.kind=null (the remote judge) or reward.remote.url=null (ours)")
    combine.check(has_model=remote is not None or judge is not None)
    if remote is not None:
        check_remote(remote)
    if judge is not None:
        judge.check()
    if (remote is None and judge is None) or combine.uses_rule:
        cls = _checked_manager(name, function, options)
        load_reward_fn(function, batched=cls.batched)


def _checked_manager(name: str, function: RewardFnSpec, options: dict) -> type:
    if name not in REWARD_MANAGERS:
        raise RewardConfigError(f"reward.manager: unknown {name!r}; choose one of {', '.join(REWARD_MANAGERS)}")
    cls = REWARD_MANAGERS.get(name)
    try:
        inspect.signature(cls).bind(function, **options)
    except TypeError as exc:
        raise RewardConfigError(
            f"reward.manager_options: {exc} for the {name!r} manager, which takes {inspect.signature(cls)}"
        ) from None
    return cls
