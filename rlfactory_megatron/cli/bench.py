"""`rlf-bench NAME [options]`: dispatches to rlfactory_megatron.bench.<name>.main(argv)."""
import importlib
import sys

from rlfactory_megatron.bench import BENCHMARKS


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: rlf-bench NAME [options]\n\nbenchmarks:")
        for name, what in BENCHMARKS.items():
            print(f"  {name:<12} {what}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"rlf-bench: unknown benchmark '{name}'; choose one of: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"rlfactory_megatron.bench.{name.replace('-', '_')}")
    except ModuleNotFoundError as exc:
        if exc.name != f"rlfactory_megatron.bench.{name.replace('-', '_')}":
            raise
        print(f"rlf-bench {name}: not implemented yet; it arrives with its own issue.", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
