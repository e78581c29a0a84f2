"""How `python worker_finalize.py MODE` ends (tests/test_harness.py checks that the ranks
tests/launch.py's real_ranks starts end as real interpreters do): an object held by a module in
sys.modules reports, from its __del__, whether the interpreter was finalizing (only
Py_FinalizeEx clears such modules; a process ended by os._exit never calls it); a non-daemon
thread is joined first, atexit handlers run. MODE: ok, exit3 (sys.exit(3)), raise (an uncaught
exception), hang (sleeps past any timeout)."""

import atexit
import os
import sys
import threading
import time
import types

RANK = os.environ.get("RANK", "?")


def say(what: str) -> None:
    """One line in one write(2): the ranks share one stdout pipe, and under PYTHONUNBUFFERED
    print() writes the text and its newline apart, so two ranks' lines could interleave."""
    os.write(1, f"rank {RANK}: {what}\n".encode())


class Last:
    def __del__(self, write=os.write, finalizing=sys.is_finalizing):
        write(1, f"rank {RANK}: collected while finalizing: {finalizing()}\n".encode())


holder = types.ModuleType("_finalize_probe")
holder.last = Last()
sys.modules[holder.__name__] = holder
del holder

threading.Thread(target=lambda: (time.sleep(0.3), say("thread joined"))).start()
atexit.register(lambda: say("atexit ran"))

mode = sys.argv[1]
if mode == "exit3":
    sys.exit(3)
if mode == "raise":
    raise ValueError(f"rank {RANK}: boom")
if mode == "hang":
    time.sleep(600)
say("all checks passed")
