"""`rlf-bench sweep`: a grid of benchmark runs, each point recorded with its environment.

From a YAML file:

    rlf-bench sweep --config sweep.yaml [--out DIR]

    # sweep.yaml
    out: outputs/sweep                # default for --out
    points:
      - suite: weight-sync
        args: [--hidden, "256", --layers, "4", --repeats, "1"]
        grid: {bucket-mb: [8, 32, 128]}             # one point per combination of the grid's values
      - suite: logprob
        grid: {tokens: [1024, 4096, 16384], vocab: [32768]}

or one suite from the command line (arguments after `--` go to every point):

    rlf-bench sweep weight-sync --grid bucket-mb=8,32,128 -- --hidden 256 --layers 4

Each point runs `rlf-bench SUITE ... --json FILE` in a process of its own, one at a time, with
progress and an ETA. Written to DIR: `points/<n>-<suite>.json` per point (suite, parameters,
the command, exit status, seconds, the suite's figures, and the environment: package versions,
devices, world layout, git commit), `sweep.md` (a table: one row per point, its headline
figures) and a PNG per curve where a suite's figure follows a swept parameter (sync time vs
bucket size, log-prob peak memory vs tokens, generation tokens/s vs engines). Exit 1 if a point
failed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlfactory_megatron.bench.environment import environment

# The suites whose figures come back as JSON (`--json FILE`).
SWEEPABLE = ("actor", "weight-sync", "rollout", "tools", "logprob", "e2e")


@dataclass
class Point:
    suite: str
    params: dict[str, str]
    args: list[str]
    index: int = 0
    returncode: int | None = None
    seconds: float = 0.0
    figures: Any = None
    output_tail: str = ""
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def argv(self) -> list[str]:
        return [self.suite, *self.args, *(x for k, v in self.params.items() for x in (k, v))]

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.params.items()) or "(defaults)"


def grid_points(suite: str, grid: dict[str, list], args: list[str]) -> list[Point]:
    """One point per combination; a grid key is one of the suite's options (`bucket-mb` or `--bucket-mb`)."""
    keys = ["--" + str(k).lstrip("-") for k in grid]
    values = [[str(v) for v in (vs if isinstance(vs, list) else [vs])] for vs in grid.values()]
    return [Point(suite, dict(zip(keys, combo)), [str(a) for a in args]) for combo in itertools.product(*values)]


def load_plan(path: str) -> tuple[list[Point], str | None]:
    import yaml

    spec = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(spec.get("points"), list) or not spec["points"]:
        raise ValueError(f"{path}: needs a 'points:' list of {{suite, args, grid}} entries")
    points = []
    for entry in spec["points"]:
        unknown = set(entry) - {"suite", "args", "grid"}
        if "suite" not in entry or unknown:
            raise ValueError(f"{path}: each point needs 'suite' (and may have 'args', 'grid'); got {sorted(entry)}")
        points += grid_points(entry["suite"], entry.get("grid") or {}, entry.get("args") or [])
    return points, spec.get("out")


def run_point(point: Point, out: Path) -> Point:
    figures_path = out / "points" / f"{point.index:03d}-{point.suite}.figures.json"
    command = [sys.executable, "-m", "rlfactory_megatron.cli.bench", *point.argv, "--json", str(figures_path)]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    point.seconds = round(time.monotonic() - start, 2)
    point.returncode = done.returncode
    point.output_tail = (done.stdout + done.stderr)[-4000:]
    if figures_path.exists():
        point.figures = json.loads(figures_path.read_text())
        figures_path.unlink()
    return point


# ---------------------------------------------------------------- what the table and the plots show
def _numbers(value: Any, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a figures tree, by dotted path."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, (int, float)):
        return {prefix: value}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _numbers(item, f"{prefix}.{key}" if prefix else key).items()}
    if isinstance(value, list) and len(value) <= 16:
        return {k: v for i, item in enumerate(value) for k, v in _numbers(item, f"{prefix}[{i}]").items()}
    return {}


HEADLINES: dict[str, tuple[str, ...]] = {
    # suite -> figure paths shown in the table (others: the first numeric ones)
    "weight-sync": ("params_M", "sync_vs_memcpy_throughput", "speedup_vs_disk"),
    "rollout": ("one_engine.tokens_per_s", "two_engines.tokens_per_s", "scaling_efficiency",
                "two_engines.imbalance", "sync_one_engine_s", "sync_two_engines_s"),
    "e2e": ("ours.tokens_per_s", "trl.tokens_per_s", "ratio_tokens_per_s"),
}


def headline(point: Point) -> str:
    numbers = _numbers(point.figures)
    keys = [k for k in HEADLINES.get(point.suite, ()) if k in numbers] or list(numbers)[:6]
    return ", ".join(f"{k} {numbers[k]:g}" for k in keys)


def table(points: list[Point]) -> str:
    lines = ["| # | suite | parameters | status | seconds | figures |", "| --- | --- | --- | --- | --- | --- |"]
    for p in points:
        status = "ok" if p.returncode == 0 else f"exit {p.returncode}"
        lines.append(f"| {p.index} | {p.suite} | {p.label} | {status} | {p.seconds:g} | {headline(p)} |")
    return "\n".join(lines)


Curve = tuple[str, list[float], list[float]]  # label, x, y


def _weight_sync_curves(points: list[Point]) -> list[Curve]:
    xs, ys = [], []
    for p in points:
        for key, value in (p.figures or {}).items():
            if key.startswith("sync_") and key.endswith("MB") and isinstance(value, dict):
                xs.append(float(key[5:-2]))
                ys.append(value["seconds"])
    pairs = sorted(zip(xs, ys))
    return [("sync", [x for x, _ in pairs], [y for _, y in pairs])] if len(pairs) >= 2 else []


def _logprob_curves(points: list[Point]) -> list[Curve]:
    curves: dict[str, dict[float, float]] = {}
    for p in points:
        for case in p.figures or []:
            for path in ("fused", "naive"):
                if path in case:
                    curves.setdefault(f"{path} V={case['V']}", {})[float(case["T"])] = case[path]["peak_mib"]
    return [(label, sorted(c), [c[t] for t in sorted(c)]) for label, c in curves.items() if len(c) >= 2]


def _rollout_curves(points: list[Point]) -> list[Curve]:
    return [(p.label, [1.0, 2.0], [p.figures["one_engine"]["tokens_per_s"], p.figures["two_engines"]["tokens_per_s"]])
            for p in points if isinstance(p.figures, dict) and "two_engines" in p.figures]


# suite -> (title, x label, y label, curves from the suite's points)
CURVES: dict[str, tuple[str, str, str, Callable[[list[Point]], list[Curve]]]] = {
    "weight-sync": ("weight sync time vs bucket size", "bucket MB", "seconds", _weight_sync_curves),
    "logprob": ("log-prob peak memory vs tokens", "tokens", "peak extra MiB", _logprob_curves),
    "rollout": ("generation throughput vs engines", "engines", "tokens/s", _rollout_curves),
}


def plot(points: list[Point], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for suite, (title, x_label, y_label, curves_of) in CURVES.items():
        curves = curves_of([p for p in points if p.suite == suite and p.returncode == 0])
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, xs, ys in curves:
            ax.plot(xs, ys, marker="o", label=label)
        if suite in ("weight-sync", "logprob"):
            ax.set_xscale("log", base=2)
        ax.set(title=title, xlabel=x_label, ylabel=y_label)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{suite}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlf-bench sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", nargs="?", help="one suite from the command line (else --config)")
    parser.add_argument("--config", help="YAML file with a 'points:' list")
    parser.add_argument("--grid", action="append", default=[], metavar="OPTION=V1,V2",
                        help="a swept option of the suite (repeatable)")
    parser.add_argument("--out", help="output folder (default: the YAML's 'out', else outputs/sweep)")
    own, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    try:
        if args.config:
            if args.suite or args.grid:
                parser.error("give --config or a suite with --grid, not both")
            points, yaml_out = load_plan(args.config)
        elif args.suite:
            grid = {}
            for item in args.grid:
                key, sep, values = item.partition("=")
                if not sep:
                    parser.error(f"--grid takes OPTION=V1,V2 (an option of the suite), not {item!r}")
                grid[key] = values.split(",")
            points, yaml_out = grid_points(args.suite, grid, rest), None
        else:
            parser.error("give --config FILE or a suite")
    except ValueError as exc:
        print(f"rlf-bench sweep: error: {exc}", file=sys.stderr)
        return 2
    unknown = sorted({p.suite for p in points if p.suite not in SWEEPABLE})
    if unknown:
        print(f"rlf-bench sweep: error: cannot sweep {', '.join(unknown)}; choose among {', '.join(SWEEPABLE)} "
              f"(the suites that write their figures with --json)", file=sys.stderr)
        return 2

    out = Path(args.out or yaml_out or "outputs/sweep")
    (out / "points").mkdir(parents=True, exist_ok=True)
    env = environment()
    started = time.monotonic()
    for i, point in enumerate(points):
        point.index = i
        point.environment = env
        elapsed = time.monotonic() - started
        eta = f", ETA {elapsed / i * (len(points) - i):.0f}s" if i else ""
        print(f"rlf-bench sweep: point {i + 1}/{len(points)}: {point.suite} {point.label}{eta}", flush=True)
        run_point(point, out)
        (out / "points" / f"{i:03d}-{point.suite}.json").write_text(json.dumps(
            asdict(point) | {"command": shlex.join(["rlf-bench", *point.argv])}, indent=2))
        status = "ok" if point.returncode == 0 else f"FAILED (exit {point.returncode}): {point.output_tail[-300:]}"
        print(f"rlf-bench sweep:   {status} in {point.seconds:g}s; {headline(point)}", flush=True)

    report = table(points)
    commit = env["git"].get("commit", "?")[:12]
    (out / "sweep.md").write_text(f"`{shlex.join(['rlf-bench', 'sweep', *argv])}` at {commit} on {env['host']} "
                                  f"({env['devices'].get('cpus')} CPUs{', ' + str(len(env['devices']['gpus'])) + ' GPUs' if 'gpus' in env['devices'] else ''})\n\n{report}\n")
    plots = plot(points, out)
    print(report)
    print(f"rlf-bench sweep: {out / 'sweep.md'}, {out / 'points'}/" + "".join(f", {p}" for p in plots))
    return 0 if all(p.returncode == 0 for p in points) else 1
