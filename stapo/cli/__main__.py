"""``python -m stapo.cli``: the ``stapo`` command (what launchers run: ``deepspeed -m stapo.cli train ...``).

A finished command leaves its process group here (a gloo group left to the interpreter's teardown aborts a
finished run with status -6); `main` run in-process keeps the group for the next trainer."""

import sys

from stapo.cli import main

status = main()
if status == 0 and "torch.distributed" in sys.modules:  # a command that never loaded torch has no group
    from stapo.distributed.process_group import close_distributed

    close_distributed()
sys.exit(status)
