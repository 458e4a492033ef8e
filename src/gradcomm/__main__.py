"""Command line: ``gradcomm demo`` (a short distributed training run on local ranks)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradcomm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small model on local ranks and print its loss")
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--hook", default=None, help="communication hook name (default: plain averaging)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        if args.world_size < 1 or args.steps < 1:
            parser.error("--world-size and --steps must be at least 1")
        run_demo(args.world_size, args.steps, args.hook)
    return 0


if __name__ == "__main__":
    sys.exit(main())
