"""`stapo.registry.lazy_attributes`: the packages' names resolve on first use, and only then import their module."""

from __future__ import annotations

import subprocess
import sys


def test_package_names_import_their_module_on_first_use():
    code = ("import sys, stapo, stapo.trainer, stapo.inspect\n"
            "before = [m for m in ('deepspeed', 'matplotlib', 'stapo.trainer.trainer') if m in sys.modules]\n"
            "assert stapo.inspect.build_token_record.__module__ == 'stapo.inspect.collect'\n"
            "assert 'matplotlib' not in sys.modules\n"
            "assert stapo.STAPOConfig.__module__ == 'stapo.config'\n"
            "try:\n    stapo.inspect.nope\nexcept AttributeError as err:\n    print(before, err)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] module 'stapo.inspect' has no attribute 'nope'", out
