"""One reward worker process: ``python -m stapo.rewards._worker --memory-mb N [--function SPEC [--batched]]``.

JSON lines: ``"ready"``, then ``[task_id, value]`` for each ``[task_id, payload]``. It caps its address space and
exits on MemoryError, at stdin's end and when its parent disappears (docs/rewards.md, "Hang-proofing").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time


def _watch_parent(parent_pid: int, period_s: float = 0.5) -> None:
    while True:
        time.sleep(period_s)
        if os.getppid() != parent_pid:
            os._exit(0)


def _limit_memory(memory_mb: int) -> None:
    if memory_mb <= 0:
        return
    import resource

    limit = memory_mb * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--memory-mb", type=int, default=1024)
    parser.add_argument("--function", default=None)
    parser.add_argument("--batched", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    if args.function is not None:
        _serve_function(args.function, args.batched, args.memory_mb)
        return

    from stapo.rewards.symbolic import symbolic_verdict

    symbolic_verdict("x+1", "1+x")  # import and warm sympy before the first timed item
    # an exception (RecursionError etc.) is a mismatch; the worker keeps serving
    _serve(sys.stdout, args.memory_mb, lambda pair: bool(symbolic_verdict(*pair)), lambda exc: [False])


def _serve_function(spec: str, batched: bool, memory_mb: int) -> None:
    """Serve calls of a user reward function (see ``user_function.py``)."""
    out = os.fdopen(os.dup(1), "w")  # the protocol channel; fd 1 itself now points at stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from stapo.rewards.user_function import call_function, load_function

    try:
        fn = load_function(spec)
    except BaseException as exc:  # noqa: BLE001 - ImportError, SyntaxError, SystemExit, ...
        out.write(json.dumps(["error", f"{type(exc).__name__}: {exc}"]) + "\n")
        out.flush()
        os._exit(2)
    # a user error scores failure_value; the worker keeps serving
    _serve(out, memory_mb, lambda payload: call_function(fn, batched, payload),
           lambda exc: [None, f"{type(exc).__name__}: {str(exc)[:500]}"])


def _serve(out, memory_mb: int, call, failed) -> None:
    """Say ready, then answer each ``[task_id, payload]`` line with ``[task_id, call(payload)]``, or
    ``[task_id, *failed(exc)]`` when the call raised; a MemoryError ends the worker (it is replaced)."""
    _limit_memory(memory_mb)
    out.write('"ready"\n')
    out.flush()
    for line in sys.stdin:
        task_id, payload = json.loads(line)
        try:
            reply = [task_id, call(payload)]
        except MemoryError:
            os._exit(3)
        except BaseException as exc:  # noqa: BLE001 - see failed
            reply = [task_id, *failed(exc)]
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
