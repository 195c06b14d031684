"""Worker processes that score one sample at a time each: a sample that hangs or kills its process costs only itself."""
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


def _serve(spec: RewardFnSpec, conn: Connection) -> None:
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
    deadline: float = 0.0


class ScoringProcesses:
    """`num_processes` worker processes; each sample gets `timeout_s` of one worker's time."""

    def __init__(self, spec: RewardFnSpec, num_processes: int, timeout_s: float) -> None:
        self.spec, self.num_processes, self.timeout_s = spec, num_processes, timeout_s
        self._workers: list[_Worker] = []
        # The server imports the scorers once, so a replacement worker starts in milliseconds.
        _CONTEXT.set_forkserver_preload([__name__])

    def score(self, samples: list[RewardSample]) -> list[SampleScore]:
        """Scores in input order; a timed-out or crashed sample scores 0 with its error."""
        while len(self._workers) < self.num_processes:
            self._workers.append(self._start())
        results: list[SampleScore | None] = [None] * len(samples)
        pending = deque(range(len(samples)))
        while pending or any(w.job is not None for w in self._workers):
            for worker in self._workers:
                if worker.ready and worker.job is None and pending:
                    worker.job, worker.deadline = pending.popleft(), time.monotonic() + self.timeout_s
                    worker.conn.send((worker.job, samples[worker.job]))
            self._collect(results)
        return results

    def close(self) -> None:
        for worker in self._workers:
            self._stop(worker, graceful=True)
        self._workers = []

    def _collect(self, results: list[SampleScore | None]) -> None:
        busy_deadlines = [w.deadline for w in self._workers if w.job is not None]
        timeout = max(0.0, min(busy_deadlines) - time.monotonic()) if busy_deadlines else None
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
