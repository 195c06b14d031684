"""Worker processes that score one sample at a time each: a sample that hangs or kills its
process costs only itself, and a slow one does not hold back the rest (a spare starts)."""
import multiprocessing
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from rlfactory_megatron.rewards.custom import RewardFnSpec, load_reward_fn
from rlfactory_megatron.rewards.records import RewardSample, SampleScore
from rlfactory_megatron.rewards.scoring import failed, score_one

# forkserver, not fork: the parent may be a Ray worker or trainer with threads, which fork can
# deadlock.
_CONTEXT = multiprocessing.get_context("forkserver")
_READY = "ready"
# The server imports these once, so a replacement or spare process starts in ~0.1 s (the math
# scorers' math_verify / sympy take seconds to import). Not the user's reward file: forked
# from one import, every worker would share its module state (a seeded RNG, an open client).
_PRELOAD = [__name__, "rlfactory_megatron.rewards.scorers", "math_verify"]


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent (the scoring actor) dies, so a sample
    stuck in user code does not outlive an actor the pool killed."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere: the parent kills its processes on close


def _serve(spec: RewardFnSpec, conn: Connection) -> None:
    _die_with_parent()
    fn = load_reward_fn(spec)
    conn.send(_READY)
    try:
        while (job := conn.recv()) is not None:
            index, sample = job
            conn.send((index, score_one(fn, sample, index)))
    except EOFError:
        return  # the parent is gone (killed Ray actor): nothing left to score for


@dataclass
class _Worker:
    process: multiprocessing.Process
    conn: Connection
    ready: bool = False
    job: int | None = None  # index of the sample being scored
    started: float = 0.0  # when it got `job`
    deadline: float = 0.0


class ScoringProcesses:
    """`num_processes` worker processes; each sample gets `timeout_s` of one worker's time.

    A sample that has run `slow_after_s` without answering (hung, or just slow) lets one spare
    process start, up to `max_spares` at once, so the samples queued behind it keep being scored:
    a call returns about `timeout_s` after its slowest honest sample, however many samples hang.
    Spares stop when the call returns.
    """

    def __init__(self, spec: RewardFnSpec, num_processes: int, timeout_s: float, max_spares: int = 8,
                 slow_after_s: float | None = None) -> None:
        self.spec, self.num_processes, self.timeout_s = spec, num_processes, timeout_s
        self.max_spares = max_spares
        self.slow_after_s = min(0.25, timeout_s / 8) if slow_after_s is None else slow_after_s
        self._workers: list[_Worker] = []
        _CONTEXT.set_forkserver_preload(_PRELOAD)
        # Started now, so they are ready (imports done) by the first call.
        self._workers = [self._start() for _ in range(num_processes)]

    def score(self, samples: list[RewardSample]) -> list[SampleScore]:
        """Scores in input order; a timed-out or crashed sample scores 0 with its error."""
        while len(self._workers) < self.num_processes:
            self._workers.append(self._start())
        results: list[SampleScore | None] = [None] * len(samples)
        pending = deque(range(len(samples)))
        while pending or any(w.job is not None for w in self._workers):
            if pending:
                self._add_spare()
            for worker in self._workers:
                if worker.ready and worker.job is None and pending:
                    worker.job, worker.started = pending.popleft(), time.monotonic()
                    worker.deadline = worker.started + self.timeout_s
                    worker.conn.send((worker.job, samples[worker.job]))
            self._collect(results, waiting=bool(pending))
        for worker in self._workers[self.num_processes:]:
            self._stop(worker, graceful=True)
        del self._workers[self.num_processes:]
        return results

    def close(self) -> None:
        for worker in self._workers:
            self._stop(worker, graceful=True)
        self._workers = []

    def _add_spare(self) -> None:
        """One more process while samples wait, every worker is busy or starting, and some busy
        worker's sample is slow."""
        if any(w.job is None for w in self._workers):
            return  # an idle or still-starting worker takes the next sample
        now = time.monotonic()
        slow = sum(now - w.started >= self.slow_after_s for w in self._workers)
        spares = len(self._workers) - self.num_processes
        if slow > 0 and spares < min(slow, self.max_spares):
            self._workers.append(self._start())

    def _collect(self, results: list[SampleScore | None], waiting: bool) -> None:
        now = time.monotonic()
        wake = [w.deadline for w in self._workers if w.job is not None]
        if waiting:  # also when a busy sample turns slow: a spare may start then
            wake += [w.started + self.slow_after_s for w in self._workers
                     if w.job is not None and w.started + self.slow_after_s > now]
        timeout = max(0.0, min(wake) - now) if wake else None
        ready = set(wait([w.conn for w in self._workers] + [w.process.sentinel for w in self._workers], timeout))
        for i, worker in enumerate(self._workers):
            if worker.conn in ready:
                try:
                    message = worker.conn.recv()
                except (EOFError, OSError):
                    message = None  # died; the sentinel branch below reports it
                if message == _READY:
                    worker.ready = True
                elif message is not None:
                    index, outcome = message
                    results[index], worker.job = outcome, None
            if not worker.process.is_alive() or (worker.job is not None and time.monotonic() > worker.deadline):
                self._workers[i] = self._replace(worker, results)

    def _replace(self, worker: _Worker, results: list[SampleScore | None]) -> _Worker:
        if worker.job is None and not worker.ready:
            raise RuntimeError(
                f"reward worker process exited with code {worker.process.exitcode} before it was ready; "
                f"check the {self.spec.config_prefix}.custom_function_* settings"
            )
        if worker.job is not None:
            if worker.process.is_alive():
                reason, kind = f"timed out after {self.timeout_s:g}s", "timeout"
            else:
                reason, kind = f"worker process died (exit code {worker.process.exitcode})", "crashed"
            results[worker.job] = failed(worker.job, reason, kind)
        self._stop(worker, graceful=False)
        return self._start()

    def _start(self) -> _Worker:
        parent_conn, child_conn = _CONTEXT.Pipe()
        process = _CONTEXT.Process(target=_serve, args=(self.spec, child_conn), daemon=True)
        process.start()
        child_conn.close()
        return _Worker(process=process, conn=parent_conn)

    @staticmethod
    def _stop(worker: _Worker, graceful: bool) -> None:
        if graceful and worker.process.is_alive():
            try:
                worker.conn.send(None)
            except OSError:
                pass
            worker.process.join(timeout=2)
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()
        worker.conn.close()
