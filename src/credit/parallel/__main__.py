"""Command line: ``python -m credit.parallel {demo,bench} ...`` (also ``credit-parallel``)."""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": "a multi-rank training run on a layout where torch's clip fails, with parity checks",
    "bench": "timings, collective counts and memory of the collectives against their baselines",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        print(
            "usage: credit-parallel {demo,bench} [options]   (--help after a command for its options)"
        )
        for name, summary in COMMANDS.items():
            print(f"  {name:6} {summary}")
        return 0 if args and args[0] in ("-h", "--help") else 2
    if args[0] == "demo":
        from credit.parallel.demo import main as command
    else:
        from credit.parallel.bench import main as command
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
