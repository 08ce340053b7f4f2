"""`python -m tests.rig build|up|down|status|env [--node] [--kueue]`."""

from __future__ import annotations

import argparse

from tests.rig import build, versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.rig", description=__doc__)
    parser.add_argument("command", choices=["build", "up", "down", "status", "env"])
    parser.add_argument("--node", action="store_true",
                        help="build: the real node's components; up: also start the real node; "
                             "down: stop only the real node")
    parser.add_argument("--kueue", action="store_true", help="up: also start Kueue (tests/rig/kueue.py)")
    args = parser.parse_args(argv)
    if args.command == "build":
        if args.node:
            build.build_node()
        else:  # the control plane, then Kueue (which the tests that use it start)
            build.build()
            build.build(versions.KUEUE_BUILD_ORDER)
        return 0
    from tests.rig import cluster

    if args.command == "up":
        rig = cluster.up_node()[0] if args.node else cluster.up()[0]
        if args.kueue:
            from tests.rig import kueue

            kueue.up(rig)
        print(rig.exports())
    elif args.command == "down":
        if args.node:
            from tests.rig import node

            node.down(cluster.running())
        else:
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
