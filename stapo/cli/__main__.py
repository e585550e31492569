"""``python -m stapo.cli``: the ``stapo`` command (what launchers run: ``deepspeed -m stapo.cli train ...``)."""

from stapo.cli import run

run()
