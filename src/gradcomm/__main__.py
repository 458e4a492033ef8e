"""Command line: ``gradcomm bench`` (compare hooks by training) and ``gradcomm demo`` (a short run)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from gradcomm.bench import cli as bench_cli

    parser = argparse.ArgumentParser(
        prog="gradcomm",
        description="gradcomm bench compares communication hooks by training; gradcomm demo is a short run.",
        epilog="gradcomm bench --help shows the bench's options and examples.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench",
        help="train a workload once per hook on N ranks (optionally behind shaped links) and compare them",
        description=bench_cli.DESCRIPTION,
        epilog=bench_cli.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_cli.add_arguments(bench)
    demo = commands.add_parser("demo", help="train a small model on local ranks and print its loss")
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--hook", default=None, help="communication hook name (default: plain averaging)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench_cli.run(args, argv[argv.index("bench") + 1 :] if "bench" in argv else None)
    from gradcomm.bench.demo import run_demo

    if args.world_size < 1 or args.steps < 1:
        parser.error("--world-size and --steps must be at least 1")
    run_demo(args.world_size, args.steps, args.hook)
    return 0


if __name__ == "__main__":
    sys.exit(main())
