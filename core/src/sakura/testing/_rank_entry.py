"""How :func:`sakura.testing.launch_ranks` starts one rank:
``python -m sakura.testing._rank_entry SCRIPT RANK WORLD_SIZE INIT_FILE OUT_DIR *ARGS``.

The script runs as ``__main__`` with the ``sys.argv`` and ``sys.path[0]`` that
``python SCRIPT ...`` would give it.  When it returns, the rank ends the way a normal exit
does (non-daemon threads joined, ``atexit`` handlers run, output flushed) and then leaves with
``os._exit``, skipping the interpreter's finalization and C++ static destructors.

Why: torch's gloo threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) outlive
``destroy_process_group()`` whenever anything still refers to the group (a DDP module, an FSDP
mesh), so they are still running while a normally exiting interpreter tears itself down, and a
rank that had finished its work could abort there ("terminate called without an active
exception", SIGABRT) while its peers were still connected.  What a test checks is written by
the script before it returns; nothing a rank owes its test happens during finalization.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading
import traceback


def _exit_status(code: object) -> int:
    """The exit status ``SystemExit(code)`` gives, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """What a normal exit does before finalization: join non-daemon threads, run ``atexit``."""
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m sakura.testing._rank_entry SCRIPT [ARGS...]", file=sys.stderr)
        os._exit(2)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        _finish()
    except BaseException:
        traceback.print_exc()
        status = status or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
