"""Runs the tests' scripts as forks of one process that has imported vLLM (conftest.py's `Zygote`):
each vLLM process pays 11-13 CPU-seconds importing vLLM, torch and transformers before it does
anything, and a script forked from here starts with them imported. Everything after the import is
the script's own: it runs as `python SCRIPT ARGS...` would run it (`__main__`, its argv, its
environment, its directory first on sys.path), in a session of its own (its process group, vLLM's
engine and worker processes included, is what a timeout kills), its output in files.

Nothing here may run a torch operation before forking: GNU OpenMP's thread pool, once started, does
not survive a fork (the child's first parallel region would wait forever on threads it does not
have). Importing vLLM starts none.

Requests, one JSON line each on standard input: {"run": SCRIPT, "args": [...], "env": {...},
"cwd": DIR, "stdout": PATH, "stderr": PATH}. Answers, one JSON line each on standard output (the
zygote's own; what a library prints there goes to its standard error): {"started": PID} at once,
then {"exited": PID, "code": CODE} when the script ends (CODE: its exit status, or minus the signal
that ended it). The zygote ends at the end of its input, and ignores SIGINT (the tests' conftest
ends it and what it started).
Usage: python zygote.py"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import sys

ANSWERS = None  # the answers' own descriptor (serve)


def serve() -> dict | None:
    """Answers requests until the end of input (returns None), or, in a forked child, returns the
    request that child is to run."""
    global ANSWERS
    # The answers get a descriptor of their own, and standard output is standard error from here
    # on: nothing a library prints can be taken for an answer. Forked children close it.
    ANSWERS = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch  # noqa: F401  (the imports every script makes, once; none runs an operation)
    import transformers  # noqa: F401
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    import engines  # noqa: F401

    running: set[int] = set()
    pending = b""
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.2)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        data = os.read(stdin, 65536)
        if not data:
            return None
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if not line.strip():
                continue
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            ANSWERS.flush()
            pid = os.fork()
            if pid == 0:
                return request
            running.add(pid)
            answer({"started": pid})


def answer(message: dict) -> None:
    ANSWERS.write(json.dumps(message) + "\n")
    ANSWERS.flush()


def become(request: dict) -> None:
    """In the forked child: becomes `python SCRIPT ARGS...` with the request's environment and
    output files, and runs the script (its exit is the interpreter's, atexit handlers included)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ANSWERS.close()  # the zygote's end is seen by its reader even while scripts run
    os.chdir(request["cwd"])
    script = request["run"]
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    same = request["stderr"] == request["stdout"]  # one file: one descriptor, one offset
    err = os.dup(out) if same else os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python SCRIPT` puts first
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    request = serve()
    if request is not None:
        become(request)
