"""Command line: ``python -m mlx_nbdist demo | install-kernel | run``."""

from __future__ import annotations

import argparse
import sys

from .config import Backend
from .demo import run_demo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mlx-nbdist")
    sub = p.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="run the tensor-parallel demo headless")
    demo.add_argument("-n", type=int, default=2, help="number of ranks")
    kern = sub.add_parser(
        "install-kernel",
        help="install a Jupyter kernel whose cells run on every rank",
        description="Install a Jupyter kernelspec 'MLX distributed, N ranks': the session "
        "starts with the kernel and stops with it, every cell runs on every rank, "
        "%%local runs a cell in the kernel itself.",
    )
    kern.add_argument("-n", type=int, default=2, help="number of ranks (default 2)")
    kern.add_argument("--backend", choices=[b.value for b in Backend], default="ring")
    kern.add_argument("--launcher", choices=("local", "mpi"), default="")
    kern.add_argument("--name", default=None, help="kernelspec name (default mlx-nbdist-N)")
    kern.add_argument("--display-name", default=None)
    where = kern.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user only")
    where.add_argument("--prefix", default=None, help="install under PREFIX/share/jupyter")
    run = sub.add_parser(
        "run",
        help="run a script on N ranks of a new session",
        description="Start N ranks (one MLX group), run SCRIPT on every rank as one cell in "
        "this directory, print each rank's lines as they arrive behind [rank r], stop the "
        "session. Exit status: 0 when every rank finished, 1 when a rank failed (named), "
        "k when the script called sys.exit(k), "
        "2 when the session could not start. An exported notebook "
        "(%mlxdist export) runs here as under mlx.launch.",
    )
    run.add_argument("-n", type=int, default=2, help="number of ranks (default 2)")
    run.add_argument("--backend", choices=[b.value for b in Backend], default=None,
                     help="MLX backend (default ring)")
    run.add_argument("--timeout", type=float, default=None,
                     help="deadline in seconds (default: none)")
    run.add_argument("script", help="the Python file to run")
    run.add_argument("args", nargs=argparse.REMAINDER,
                     help="the script's arguments (its sys.argv[1:])")
    args = p.parse_args(argv)
    if args.cmd == "run":
        from .script import run_file

        try:
            return run_file(args.script, args.n, args.backend, timeout=args.timeout,
                            args=args.args)
        except KeyboardInterrupt:
            print("mlx_nbdist run: interrupted; the session was stopped", file=sys.stderr)
            return 130
    if args.cmd == "demo":
        return run_demo(n=args.n)
    if args.cmd == "install-kernel":
        from .errors import SetupError
        from .kernel import install, kernel_spec

        try:
            path = install(
                args.n,
                backend=args.backend,
                launcher=args.launcher,
                name=args.name,
                display_name=args.display_name,
                user=args.user,
                prefix=args.prefix,
            )
        except SetupError as e:
            print(f"install-kernel: {e}", file=sys.stderr)
            return 2
        display = args.display_name or kernel_spec(args.n, args.backend)["display_name"]
        print(f"installed kernel {display!r} in {path}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
