"""Command line: ``python -m credit.parallel demo ...`` (also ``credit-parallel demo``)."""

from __future__ import annotations

import sys

USAGE = (
    "usage: credit-parallel demo [options]   (demo --help for its options)\n"
    "  demo   a multi-rank training run on a layout where torch's clip fails, with parity checks"
)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "demo":
        print(USAGE)
        return 0 if args and args[0] in ("-h", "--help") else 2
    from credit.parallel.demo import main as demo

    return demo(args[1:])


if __name__ == "__main__":
    sys.exit(main())
