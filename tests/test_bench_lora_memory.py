"""Smoke test of bench/lora_memory.py: both variants run through the real engine and the table is
measured (LoRA's optimizer state is a fraction of full fine-tuning's, its trainable set the adapters)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "lora_memory.py"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_lora_memory_smoke_measures_both_variants():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=390)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| variant")]
    assert [r[0] for r in rows] == ["full", "lora r16"]
    full, lora = ({"params": int(r[1].replace(",", "")), "trainable": int(r[2].replace(",", ""))} for r in rows)
    assert full["trainable"] == full["params"] == 22_752
    # LoRA trains r x (in + out) per projection: q 32+32, k 32+16, v 32+16, o 32+32, gate/up 32+64,
    # down 64+32 -> 16 x 512 = 8192 per layer, 2 layers
    assert lora["trainable"] == 16_384 and lora["params"] == full["params"] + lora["trainable"]
    # the measured optimizer state holds two Adam moments per TRAINABLE parameter, in both variants
    ratio = next(line for line in proc.stdout.splitlines() if line.startswith("LoRA / full (optimizer state)"))
    assert float(ratio.split(":")[1]) == pytest.approx(16_384 / 22_752, abs=1e-4)
