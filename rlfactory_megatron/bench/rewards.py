"""`rlf-bench rewards`: samples/s of the Ray reward pool vs in-process scoring, and the share of
reward time hidden behind a concurrent compute phase (the trainer's log-prob pass)."""
import argparse
import functools
import os
import random
import statistics
import time
from collections.abc import Callable

import ray

from rlfactory_megatron.rewards import RewardSample, build_reward_manager
from rlfactory_megatron.rewards.pool import RewardPool


def gsm8k_batch(n: int, rng: random.Random) -> list[RewardSample]:
    """GSM8K-like responses: a chain of thought then `#### n` (a third of them wrong, some with commas)."""
    samples = []
    for i in range(n):
        answer = rng.randint(-500, 5000)
        given = answer if i % 3 else answer + 1
        response = "Let me think step by step. " * rng.randint(4, 16) + f"#### {given:,}"
        samples.append(RewardSample("openai/gsm8k", response, str(answer), response_length=len(response) // 4))
    return samples


def math_batch(n: int, rng: random.Random) -> list[RewardSample]:
    """MATH-like responses boxing a fraction in one of four forms (same, decimal, \\dfrac, wrong)."""
    samples = []
    for i in range(n):
        a, b = rng.randint(1, 50), rng.randint(2, 9)
        given = [f"\\frac{{{a}}}{{{b}}}", f"{a / b:.6f}", f"\\dfrac{{{a}}}{{{b}}}", f"\\frac{{{a + 1}}}{{{b}}}"][i % 4]
        response = "We simplify the expression. " * rng.randint(4, 16) + f"So the answer is $\\boxed{{{given}}}$."
        truth = f"\\frac{{{a}}}{{{b}}}"
        samples.append(RewardSample("lighteval/MATH", response, truth, response_length=len(response) // 4))
    return samples


BATCHES: dict[str, Callable[[int, random.Random], list[RewardSample]]] = {"gsm8k": gsm8k_batch, "math": math_batch}


def _elapsed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _pool_score(pool: RewardPool, samples: list[RewardSample]) -> None:
    pool.submit(samples).result()


def _hidden_fraction(pool: RewardPool, samples: list[RewardSample], repeats: int) -> tuple[float, float, float]:
    """(reward seconds alone, seconds of submit + compute + result(), share of reward time hidden).

    The compute phase stands for the trainer's GPU log-prob pass: the trainer process waits
    on the device and the CPUs are free. It lasts as long as the rewards alone, so a
    perfect overlap hides 100%.
    """
    alone = statistics.median(_elapsed(functools.partial(_pool_score, pool, samples)) for _ in range(repeats))
    totals = []
    for _ in range(repeats):
        start = time.perf_counter()
        future = pool.submit(samples)
        time.sleep(alone)
        future.result()
        totals.append(time.perf_counter() - start)
    total = statistics.median(totals)
    return alone, total, min(1.0, max(0.0, (2 * alone - total) / alone))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlf-bench rewards", description=__doc__)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2, help="reward actors in the pool")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement")
    parser.add_argument("--scorers", default="gsm8k,math", help=f"comma list of {', '.join(BATCHES)}")
    parser.add_argument("--overlap-scorer", default="math", choices=sorted(BATCHES))
    parser.add_argument(
        "--cpus", type=int, default=os.cpu_count(), help="CPUs for a local Ray (ignored with RAY_ADDRESS)"
    )
    args = parser.parse_args(argv)
    scorers = [s.strip() for s in args.scorers.split(",") if s.strip()]
    unknown = [s for s in scorers if s not in BATCHES]
    if unknown or not scorers:
        parser.error(f"--scorers: unknown {unknown}; choose from {', '.join(BATCHES)}")
    if args.workers < 1 or args.batch_size < 1 or args.repeats < 1:
        parser.error("--workers, --batch-size and --repeats must be >= 1")

    if not ray.is_initialized():
        if "RAY_ADDRESS" in os.environ:
            ray.init(log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    rng = random.Random(0)
    batches = {name: BATCHES[name](args.batch_size, rng) for name in set(scorers) | {args.overlap_scorer}}
    overlap_batch = batches[args.overlap_scorer]
    warmup = overlap_batch[:32] + batches[scorers[0]][:32]
    manager = build_reward_manager("naive")
    manager(warmup)  # scorer imports and caches are not what we measure
    local_times: dict[str, list[float]] = {name: [] for name in scorers}

    cpus = ray.cluster_resources().get("CPU", 1.0)
    sizes = sorted({1, args.workers})
    pool_times: dict[tuple[str, int], float] = {}
    overlap = (0.0, 0.0, 0.0)  # set beside the --workers pool below
    # One pool at a time: both sizes together would ask Ray for more CPUs than it has.
    for n in sizes:
        pool = RewardPool(num_workers=n, num_cpus_per_worker=min(1.0, cpus / n))
        pool.submit(warmup).result()  # actor start-up and imports
        for name in scorers:
            batch, pool_runs = batches[name], []
            # Alternate in-process and pool runs so that load from other processes hits both alike.
            for _ in range(args.repeats):
                local_times[name].append(_elapsed(functools.partial(manager, batch)))
                pool_runs.append(_elapsed(functools.partial(_pool_score, pool, batch)))
            pool_times[name, n] = min(pool_runs)
        if n == args.workers:
            overlap = _hidden_fraction(pool, overlap_batch, args.repeats)
        pool.shutdown()

    _report(args, scorers, sizes, cpus, {name: min(t) for name, t in local_times.items()}, pool_times, overlap)
    return 0


def _report(
    args: argparse.Namespace,
    scorers: list[str],
    sizes: list[int],
    cpus: float,
    local: dict[str, float],
    pool_times: dict[tuple[str, int], float],
    overlap: tuple[float, float, float],
) -> None:
    print(f"rlf-bench rewards: batch {args.batch_size}, best of {args.repeats}, {cpus:g} Ray CPUs "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print(f"{'scorer':<8}{'in-process':>14}" + "".join(f"{f'pool x{n} worker(s)':>28}" for n in sizes))
    for name in scorers:
        row = f"{name:<8}{args.batch_size / local[name]:>10.0f} s/s"
        for n in sizes:
            t = pool_times[name, n]
            row += f"{args.batch_size / t:>12.0f} s/s ({(t / local[name] - 1) * 100:+7.1f}%)"
        print(row + f"   [in-process {local[name] * 1e3:.1f} ms/batch]")
    print("(+x%: pool time over in-process time for the same batch; negative: the pool is faster)")
    alone, total, hidden = overlap
    print(
        f"overlap ({args.overlap_scorer}, pool x{args.workers}): rewards alone {alone:.2f} s; "
        f"submit + {alone:.2f} s GPU-like compute + result() {total:.2f} s (serial {2 * alone:.2f} s)"
        f" -> {hidden * 100:.0f}% of reward time hidden"
    )
