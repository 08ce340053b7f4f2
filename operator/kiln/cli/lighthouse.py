"""`kiln-lighthouse [torchft_lighthouse's flags]`: torchft's lighthouse, without torch.

The lighthouse is a Rust server inside torchft's extension module, but torchft's own console script
(`torchft_lighthouse`) reaches it through `import torchft`, whose package imports torch: 3 s on a quiet
machine, 20–40 s on a loaded node, ~620 MB resident, all before the server listens, while every replica
group waits for it. This loads the extension module from torchft's package directory by file, so the
package's `__init__` (and torch) never runs: ~14 MB resident, listening in milliseconds.

A console script, not `python -m`: the Rust side parses the process's own arguments past the interpreter,
and `-m kiln.cli.lighthouse` would be read as two of them.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
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
    return load_extension().lighthouse_main()
