"""Command line: ``python -m mlx_nbdist demo`` (more commands come with the kernel)."""

from __future__ import annotations

import argparse
import sys

from .demo import run_demo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_nbdist")
    sub = p.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="run the tensor-parallel demo headless")
    demo.add_argument("-n", type=int, default=2, help="number of ranks")
    args = p.parse_args(argv)
    if args.cmd == "demo":
        return run_demo(n=args.n)
    return 2


if __name__ == "__main__":
    sys.exit(main())
