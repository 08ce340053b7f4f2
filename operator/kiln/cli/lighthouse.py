"""`kiln-lighthouse [torchft_lighthouse's flags]`: torchft's lighthouse, without torch.

The lighthouse is a Rust server inside torchft's extension module, but torchft's own console script
(`torchft_lighthouse`) reaches it through `import torchft`, whose package imports torch: 3 s on a quiet
machine, 20–40 s on a loaded node, ~620 MB resident, all before the server listens, while every replica
group waits for it. This loads the extension module from torchft's package directory by file, so the
package's `__init__` (and torch) never runs: ~14 MB resident, listening in milliseconds.

A console script, not `python -m`: the Rust side parses the process's own arguments past the interpreter,
and `-m kiln.cli.lighthouse` would be read as two of them.

With `--secret_file` (the operator's per-run Secret, mounted), the lighthouse listens on 127.0.0.1 only and
`--bind` is served by kiln's tunnel, which admits a connection once it proved it holds the run's secret
(kiln.trainer.membership.auth); the flags are then read here, the same ones and that one.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import signal
import sys
import threading
from pathlib import Path
from types import ModuleType

EXTENSION = "torchft._torchft"


def load_extension() -> ModuleType:
    """torchft's compiled extension, loaded by file (its parent package is found, not imported)."""
    package = importlib.util.find_spec("torchft")
    if package is None or not package.submodule_search_locations:
        raise SystemExit("kiln lighthouse: torchft is not installed (pip install 'kiln[train]')")
    for directory in package.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(directory) / f"_torchft{suffix}"
            if path.is_file():
                loader = importlib.machinery.ExtensionFileLoader(EXTENSION, str(path))
                module = importlib.util.module_from_spec(importlib.util.spec_from_loader(EXTENSION, loader))
                loader.exec_module(module)
                return module
    raise SystemExit(f"kiln lighthouse: no {EXTENSION} extension in {package.submodule_search_locations}")


def main() -> int:
    if not any(arg.split("=", 1)[0] == "--secret_file" for arg in sys.argv[1:]):
        return load_extension().lighthouse_main()
    return serve_with_secret(sys.argv[1:])


def serve_with_secret(argv: list[str]) -> int:
    """torchft's lighthouse on 127.0.0.1, reached only through the tunnel on --bind; until SIGTERM or SIGINT."""
    from kiln.trainer.membership.auth import Tunnel, host_port, secret_file

    parser = argparse.ArgumentParser(prog="kiln-lighthouse")
    parser.add_argument("--secret_file", required=True, help="the run's secret, hex (read at each handshake)")
    parser.add_argument("--bind", default="[::]:29510")
    parser.add_argument("--min_replicas", type=int, required=True)
    parser.add_argument("--join_timeout_ms", type=int, default=60000)
    parser.add_argument("--quorum_tick_ms", type=int, default=100)
    parser.add_argument("--heartbeat_timeout_ms", type=int, default=5000)
    args = parser.parse_args(argv)
    server = load_extension().LighthouseServer(
        bind="127.0.0.1:0", min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    host, port = host_port(args.bind)
    upstream = ("127.0.0.1", host_port(server.address())[1])
    try:  # [::] or 0.0.0.0: every interface, both address families
        tunnel = Tunnel("server", secret_file(args.secret_file), upstream,
                        host=None if host in ("", "::", "0.0.0.0") else host, port=port)
    except ValueError as err:
        raise SystemExit(f"kiln lighthouse: {err}") from None
    print(f"kiln lighthouse: serving {args.bind} to holders of the run's secret only", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    tunnel.close()
    server.shutdown()
    return 0
