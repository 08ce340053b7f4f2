"""`python -m tests.rig build|up|down|status|env`."""

from __future__ import annotations

import argparse

from tests.rig import build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.rig", description=__doc__)
    parser.add_argument("command", choices=["build", "up", "down", "status", "env"])
    args = parser.parse_args(argv)
    if args.command == "build":
        build.build()
        return 0
    from tests.rig import cluster

    if args.command == "up":
        rig, _ = cluster.up()
        print(rig.exports())
    elif args.command == "down":
        cluster.down()
    elif args.command == "status":
        return cluster.print_status()
    elif args.command == "env":
        rig = cluster.running()
        if rig is None:
            print("# no healthy rig running; start one with: python -m tests.rig up")
            return 1
        print(rig.exports())
    return 0
