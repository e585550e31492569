"""``python -m stapo.cli``: the ``stapo`` command (what launchers run: ``deepspeed -m stapo.cli train ...``)."""

import sys

from stapo.cli import main

sys.exit(main())
