"""The Ray reward pool: reward managers (and the remote reward endpoint, its requests beside the
rule's scoring) in CPU Ray actors; `submit(samples)` returns a future.

A sample whose reward function raises, hangs or kills its process scores 0 with an error.
Per-sample managers score in worker processes inside the actor (`RewardManager.isolate`), so a
hang costs `sample_timeout_s` at most, concurrently with the rest; the pool supervises the
actors themselves (a batched call that hangs, an actor that dies): the other samples are
(re)scored and the dead or stuck actor replaced.
"""
import dataclasses
import itertools
import pickle
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ray
from ray import cloudpickle
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from rlfactory_megatron.rewards.combine import CombineSpec, combined
from rlfactory_megatron.rewards.custom import RewardFnSpec
from rlfactory_megatron.rewards.managers import build_reward_manager, check_reward_config
from rlfactory_megatron.rewards.records import RewardResult, RewardSample
from rlfactory_megatron.rewards.remote import RemoteReward, RemoteRewardSpec
from rlfactory_megatron.rewards.scoring import failed

_SAMPLE_FIELDS = [f.name for f in dataclasses.fields(RewardSample)]
# Ray sends a task argument of up to 100 KiB (its max_direct_call_object_size default) inside the
# task message; a bigger one takes a detour through the object store that costs milliseconds.
_INLINE_BYTES = 64 * 1024


def pack_samples(samples: list[RewardSample]) -> list[bytes]:
    """`samples` as one pickled blob of columns, cut into pieces that Ray sends inline.

    Columns pickle ~6x faster than as many dataclasses, and a batch's text easily passes 100 KiB.
    """
    columns = [[getattr(sample, name) for sample in samples] for name in _SAMPLE_FIELDS]
    blob = cloudpickle.dumps(columns, protocol=pickle.HIGHEST_PROTOCOL)
    return [blob[i : i + _INLINE_BYTES] for i in range(0, len(blob), _INLINE_BYTES)]


def unpack_samples(pieces: tuple[bytes, ...] | list[bytes]) -> list[RewardSample]:
    """The samples `pack_samples` cut into `pieces`."""
    return [RewardSample(*row) for row in zip(*pickle.loads(b"".join(pieces)))]


class RewardWorker:
    """Ray actor body: the rule (one reward manager) and the model reward (the remote endpoint),
    combined; plus `ready`/`progress` answered from a second thread."""

    def __init__(self, manager: str, function: RewardFnSpec, options: dict, sample_timeout_s: float,
                 remote: RemoteRewardSpec | None = None, combine: CombineSpec | None = None) -> None:
        combine = combine or CombineSpec()
        self.manager = None
        if remote is None or combine.uses_rule:
            self.manager = build_reward_manager(manager, function, **options)
            # Each sample in a process of its own: a hang or an exit costs that sample and the
            # process (milliseconds to replace), not this actor, and hung samples overlap.
            self.manager.isolate(sample_timeout_s)
        self.remote = RemoteReward(remote) if remote is not None else None
        self.combine = combine.load()
        # The endpoint's requests run in this thread while the rule scores: a step waits for the
        # slower of the two, not their sum.
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="model-reward") if self.remote else None
        self._job: int | None = None
        self._unit: tuple[list[int], float, float | None] | None = None

    def score(self, job: int, *packed: bytes) -> RewardResult:
        """Scores the samples `pack_samples` packed; `job` names the call for `progress`."""
        self._job, self._unit = job, None
        try:
            samples = unpack_samples(packed)
            model = self._model_thread.submit(self.remote.score, samples) if self.remote is not None else None
            rule = self.manager(samples, on_start=self._started) if self.manager is not None else None
            if model is None:
                return rule
            # The endpoint's own timeouts and retries bound this part; the pool allows their worst case.
            self._started(list(range(len(samples))), self.remote.spec.budget_s(len(samples)))
            return combined(samples, rule, model.result(), self.combine)
        finally:
            self._job = None

    def _started(self, indices: list[int], allowed_s: float | None = None) -> None:
        self._unit = (indices, time.monotonic(), allowed_s)

    @ray.method(concurrency_group="control")
    def ready(self) -> None:
        """Answers once the actor is built."""

    @ray.method(concurrency_group="control")
    def progress(self) -> tuple[int, list[int], float, float | None] | None:
        """(job, sample indices in that job being scored, seconds on them so far, seconds they are
        allowed or None: the pool's per-sample timeout), or None when idle/unknown."""
        if self._job is None or self._unit is None:
            return None
        indices, started, allowed_s = self._unit
        return self._job, indices, time.monotonic() - started, allowed_s

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
        if self._model_thread is not None:
            self._model_thread.shutdown(cancel_futures=True)


@dataclass(eq=False)
class _Job:
    seq: int
    worker: ActorHandle
    indices: Sequence[int]  # positions in the future's batch: a range, or a list once requeued
    ref: ray.ObjectRef


@dataclass
class RewardFuture:
    """Rewards being computed for one submitted batch; `result()` waits for them.

    When a worker is lost, which of its jobs was to blame is unknown (a threaded actor may
    run jobs out of order), so its jobs are queued to run again *alone* on a worker: a job
    that takes down a worker it had to itself is the culprit, and is split down to the sample.
    """

    pool: "RewardPool"
    samples: list[RewardSample]
    jobs: list[_Job]
    queued: list[Sequence[int]] = field(default_factory=list)  # sample positions waiting for an idle worker
    # The outcome columns, filled in as jobs finish.
    scores: list[float] = field(init=False)
    extras: list[dict] = field(init=False)
    errors: list[str | None] = field(init=False)
    error_kinds: list[str | None] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.samples)
        self.scores, self.extras, self.errors, self.error_kinds = [0.0] * n, [{}] * n, [None] * n, [None] * n

    def done(self) -> bool:
        """True when every job has finished (failures included) and `result()` would not wait on workers."""
        refs = [job.ref for job in self.jobs]
        return not self.queued and (not refs or len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs))

    def result(self) -> RewardResult:
        """Wait for all rewards; supervise workers meanwhile (a stuck sample is killed after its timeout)."""
        asked: dict[ActorHandle, tuple[ray.ObjectRef, float]] = {}  # progress requests in flight
        while self.jobs or self.queued:
            for worker in self.pool._idle_workers():
                if self.queued:
                    self.jobs.append(self.pool._dispatch(self.samples, self.queued.pop(0), worker))
            if not self.jobs:
                time.sleep(self.pool.poll_s)  # every worker is busy with other futures' jobs
                continue
            refs = [job.ref for job in self.jobs]
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=self.pool.poll_s)[0])
            for job in [job for job in self.jobs if job.ref in ready]:
                if job in self.jobs:  # handling an earlier failure may have requeued it
                    self._finish(job)
            if self.jobs:
                self._check_progress(asked)
        lengths = [sample.response_length for sample in self.samples]
        return RewardResult(self.scores[:], lengths, self.extras[:], self.errors[:], self.error_kinds[:])

    def _finish(self, job: _Job) -> None:
        try:
            result = ray.get(job.ref)
        except RayActorError as exc:
            self._worker_lost(job.worker, f"reward worker died ({type(exc).__name__}): reward code crashed or exited",
                              "crashed")
            return
        except RayError as exc:  # the manager itself failed on this job; the worker lives on
            self._drop(job)
            self._split_or_fail(job.indices, f"reward manager failed: {type(exc).__name__}: {exc}", "raised")
            return
        self._drop(job)
        kinds = result.error_kinds or [None if e is None else "raised" for e in result.errors]
        self._store(job.indices, result.scores, result.extras, result.errors, kinds)

    def _store(self, indices: Sequence[int], scores: list[float], extras: list[dict], errors: list[str | None],
               kinds: list[str | None]) -> None:
        if isinstance(indices, range):  # a first split of the batch: one slice per column
            span = slice(indices.start, indices.stop)
            self.scores[span], self.extras[span], self.errors[span], self.error_kinds[span] = scores, extras, errors, kinds
            return
        for local, index in enumerate(indices):
            self.scores[index], self.extras[index], self.errors[index] = scores[local], extras[local], errors[local]
            self.error_kinds[index] = kinds[local]

    def _check_progress(self, asked: dict[ActorHandle, tuple[ray.ObjectRef, float]]) -> None:
        # A worker still starting up (new process, imports) is not silent, just not there yet.
        workers = self.pool._started(list(dict.fromkeys(job.worker for job in self.jobs)))
        if not workers:
            return
        for worker in workers:
            if worker not in asked:  # a slow answer is still an answer: ask again only after it
                asked[worker] = (worker.progress.remote(), time.monotonic())
        refs = [asked[worker][0] for worker in workers]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=self.pool.poll_s)[0])
        now = time.monotonic()
        for worker in workers:
            ref, sent = asked[worker]
            if ref not in ready:
                # No answer even from the control thread: the reward code holds the GIL (or the
                # process is gone). Give it the timeout, then treat it as lost.
                if now - sent > self.pool.sample_timeout_s:
                    self._worker_lost(worker, f"reward worker unresponsive for {self.pool.sample_timeout_s:g}s",
                                      "timeout")
                continue
            del asked[worker]
            try:
                report = ray.get(ref)
            except RayError:
                continue  # died; its jobs' refs report it
            job = next((j for j in self.jobs if report and j.seq == report[0]), None)
            # A safety net with slack: per-sample managers time their samples out themselves,
            # in processes that may start later than this job did.
            if job is None:
                continue
            allowed = report[3] if report[3] is not None else self.pool.sample_timeout_s * (len(report[1]) + 1)
            if report[2] > allowed + 5.0:
                self._worker_stuck(job, report[1])

    def _worker_stuck(self, job: _Job, unit: list[int]) -> None:
        """The worker itself reported `unit` (positions in `job`) past its timeout: the culprit is known."""
        others = [j for j in self.jobs if j.worker is job.worker and j is not job]
        self.pool._kill(job.worker)
        for other in others:
            self._drop(other)
            self.queued.append(other.indices)
        self._drop(job)
        stuck = [job.indices[i] for i in unit]
        rest = [i for i in job.indices if i not in stuck]
        if rest:
            self.queued.append(rest)
        self._split_or_fail(stuck, f"timed out after {self.pool.sample_timeout_s:g}s per sample", "timeout")

    def _worker_lost(self, worker: ActorHandle, reason: str, kind: str) -> None:
        """The worker died or wedged: a job that had it to itself is the culprit; others run again alone."""
        ours = [job for job in self.jobs if job.worker is worker]
        alone = worker not in self.pool._killed and len(ours) == 1 and self.pool._load(worker) == 1
        self.pool._kill(worker)
        for job in ours:
            self._drop(job)
            if alone:
                self._split_or_fail(job.indices, reason, kind)
            else:
                self.queued.append(job.indices)

    def _split_or_fail(self, indices: Sequence[int], reason: str, kind: str) -> None:
        """A single sample fails with `reason`; several are queued one by one to find the culprit."""
        if len(indices) == 1:
            outcome = failed(indices[0], reason, kind)
            self._store(indices, [outcome.score], [outcome.extra], [outcome.error], [outcome.error_kind])
        else:
            self.queued.extend([index] for index in indices)

    def _drop(self, job: _Job) -> None:
        self.jobs.remove(job)
        self.pool._release(job)


class RewardPool:
    """`num_workers` CPU Ray actors, each running the `manager` reward manager on `function`
    and/or the `remote` endpoint, their scores mixed as `combine` says.

    The configuration is checked here, in the caller, before any actor starts. A sample
    whose scoring unit runs past `sample_timeout_s` (per sample in it) or takes its worker
    down scores a plain 0 (no manager post-processing such as DAPO's penalty). A worker
    that has not answered `ready` after `start_timeout_s` is supervised like a started one.
    """

    def __init__(
        self,
        manager: str = "naive",
        function: RewardFnSpec | None = None,
        manager_options: dict | None = None,
        num_workers: int = 2,
        sample_timeout_s: float = 60.0,
        num_cpus_per_worker: float = 1.0,
        poll_s: float = 0.2,
        start_timeout_s: float = 120.0,
        remote: RemoteRewardSpec | None = None,
        combine: CombineSpec | None = None,
    ) -> None:
        self.function, self.manager_options = function or RewardFnSpec(), manager_options or {}
        self.remote, self.combine = remote, combine or CombineSpec()
        check_reward_config(manager, self.function, self.manager_options, remote, self.combine)
        self.manager, self.sample_timeout_s, self.poll_s = manager, sample_timeout_s, poll_s
        self.start_timeout_s = start_timeout_s
        self._actor = ray.remote(num_cpus=num_cpus_per_worker, max_restarts=0, concurrency_groups={"control": 1})(
            RewardWorker
        )
        self._starting: dict[ActorHandle, tuple[ray.ObjectRef, float]] = {}  # ready request, start time
        self._inflight: dict[ActorHandle, set[int]] = {}  # job seqs per worker, all futures together
        self._killed: set[ActorHandle] = set()  # killed for one future; other futures' jobs there are collateral
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._seq = itertools.count()
        self._next_worker = itertools.cycle(range(num_workers))

    def submit(self, samples: list[RewardSample]) -> RewardFuture:
        """Start scoring `samples` (split evenly over the workers); returns at once."""
        n = len(samples)
        chunk = -(-n // len(self._workers)) or 1
        jobs = [self._dispatch(samples, range(i, min(i + chunk, n))) for i in range(0, n, chunk)]
        return RewardFuture(self, samples, jobs)

    def shutdown(self) -> None:
        for worker in self._workers:
            try:
                ray.get(worker.close.remote(), timeout=10)
            except (RayError, GetTimeoutError):
                pass  # already dead or stuck: killing it is all that is left
            ray.kill(worker, no_restart=True)
        self._workers = []

    def _start_worker(self) -> ActorHandle:
        worker = self._actor.remote(self.manager, self.function, self.manager_options, self.sample_timeout_s,
                                    self.remote, self.combine)
        self._starting[worker] = (worker.ready.remote(), time.monotonic())
        return worker

    def _started(self, workers: list[ActorHandle]) -> list[ActorHandle]:
        """Those of `workers` that finished starting (or died trying, or have had `start_timeout_s`)."""
        starting = [w for w in workers if w in self._starting]
        refs = [self._starting[w][0] for w in starting]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        now = time.monotonic()
        for worker in starting:
            if self._starting[worker][0] in ready or now - self._starting[worker][1] > self.start_timeout_s:
                del self._starting[worker]
        return [w for w in workers if w not in self._starting]

    def _idle_workers(self) -> list[ActorHandle]:
        return [w for w in self._workers if not self._inflight.get(w)]

    def _load(self, worker: ActorHandle) -> int:
        return len(self._inflight.get(worker, ()))

    def _dispatch(self, samples: list[RewardSample], indices: Sequence[int], worker: ActorHandle | None = None) -> _Job:
        worker = worker or self._workers[next(self._next_worker)]
        seq = next(self._seq)
        self._inflight.setdefault(worker, set()).add(seq)
        return _Job(seq, worker, indices, worker.score.remote(seq, *pack_samples([samples[i] for i in indices])))

    def _release(self, job: _Job) -> None:
        jobs = self._inflight.get(job.worker, set())
        jobs.discard(job.seq)
        if not jobs and job.worker not in self._workers:  # a replaced worker with nothing left to report
            self._inflight.pop(job.worker, None)
            self._killed.discard(job.worker)

    def _kill(self, worker: ActorHandle) -> None:
        """Kill `worker` and swap in a fresh actor, unless another future already did."""
        if worker in self._workers:
            ray.kill(worker, no_restart=True)
            self._killed.add(worker)
            self._starting.pop(worker, None)
            self._workers[self._workers.index(worker)] = self._start_worker()
