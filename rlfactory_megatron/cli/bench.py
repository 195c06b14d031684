"""`rlf-bench`: not implemented yet (arrives with its issue)."""
import sys


def main(argv: list[str] | None = None) -> int:
    print("rlf-bench: not implemented yet; it arrives with its own issue (see README, 'Status').", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
