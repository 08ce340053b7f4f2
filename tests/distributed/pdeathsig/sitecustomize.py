"""Test-only, on PYTHONPATH of the processes the fault-tolerance tests start (tests.distributed.ft_helpers.
die_with_parent): each Python process started with KILN_TEST_PDEATHSIG=1 asks Linux for SIGKILL when its
parent dies (prctl PR_SET_PDEATHSIG), so a pytest that is killed leaves no torchrun, `kiln run` launcher or
trainer behind: each one dies with the process that started it, down the tree. Python imports this module
at start-up by itself (the `site` module), before any of the process's own code."""

import os

if os.environ.get("KILN_TEST_PDEATHSIG") == "1":
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:  # the parent died before the request took effect: nobody is left to wait for us
        os._exit(1)
