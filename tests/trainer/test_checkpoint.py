"""Checkpoints: ZeRO-3 round trip on 2 ranks (weights, AdamW moments, lr, RNG), atomicity under
a killed save, keep-last pruning, and HF export that reloads with identical logits."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from _dist_utils import run_ranks, tiny_qwen3
from stapo.distributed.rng_state import capture_rng_state, restore_rng_state
from stapo.run_dir import complete_checkpoints, latest_checkpoint
from stapo.trainer.checkpoint import CheckpointManager

IDS = torch.arange(2, 14).reshape(2, 6)  # (2, 6): one sequence per rank


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "one": 1, "two": 2, "three": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def _train_step(engine, rank, shift):
    from stapo.distributed.accumulation import GradientAccumulation

    ids = (IDS[rank : rank + 1] + shift) % 64
    accumulation = GradientAccumulation(engine, 1)
    accumulation.backward(engine(input_ids=ids, labels=ids).loss)
    return accumulation.step()


def _roundtrip_worker(out_dir, **_):
    from stapo.trainer.checkpoint import export_hf
    from stapo.distributed.process_group import init_distributed
    from stapo.distributed.deepspeed_engine import build_engine, current_lr
    from stapo.sync.buckets import iter_weight_buckets

    def weights(engine):
        return {n: t for b in iter_weight_buckets(engine) for n, t in b}

    def make_engine(seed):
        return build_engine(tiny_qwen3(seed=seed), lr=1e-2, warmup_steps=3, grad_accum_steps=1,
                            bf16=False)

    rank = init_distributed().rank
    manager = CheckpointManager(out_dir, keep_last=2)
    engine = make_engine(seed=0)
    _train_step(engine, rank, shift=0)
    client = {"sampler": {"epoch": 0, "index": 4}, "config": {"lr": 1e-2}, "metrics": "m.jsonl"}
    torch.manual_seed(100 + rank)
    saved = manager.save(engine, step=1, client_state=client)
    draws = (torch.rand(3), random.random(), np.random.rand())  # after the save
    _train_step(engine, rank, shift=1)  # the uninterrupted run's step 2
    expected = {"weights": weights(engine), "lr": current_lr(engine)}

    torch.manual_seed(7)  # scramble RNG; the resumed engine starts from other weights
    resumed = make_engine(seed=5)
    loaded = manager.load(resumed)
    resumed_draws = (torch.rand(3), random.random(), np.random.rand())
    lr_after_load = current_lr(resumed)
    _train_step(resumed, rank, shift=1)
    got = {"weights": weights(resumed), "lr": current_lr(resumed)}

    for step in (2, 3):
        manager.save(resumed, step=step, client_state={"step": step})
    with torch.no_grad():
        logits = resumed(input_ids=IDS).logits.clone()
    export_hf(resumed, _tokenizer() if rank == 0 else None, Path(out_dir) / "hf")
    return {"saved": saved, "client": client, "loaded": loaded, "draws": draws,
            "resumed_draws": resumed_draws, "lr_after_load": lr_after_load, "expected": expected,
            "got": got, "logits": logits}


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ckpt")
    results = run_ranks(_roundtrip_worker, 2, out_dir, timeout=240)
    return out_dir / "ranks__roundtrip_worker", results


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_continues_exactly_like_an_uninterrupted_run(roundtrip):
    _, results = roundtrip
    for r in results:
        assert r["loaded"] == r["client"]
        assert r["lr_after_load"] == pytest.approx(2 / 3 * 1e-2)  # step index 1 of a 3-step warm-up
        assert r["got"]["lr"] == r["expected"]["lr"]
        for name, w in r["expected"]["weights"].items():
            assert torch.equal(r["got"]["weights"][name], w), name  # same weights AND Adam moments
        for a, b in zip(r["draws"], r["resumed_draws"]):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))  # RNG of each rank restored
    assert not torch.equal(results[0]["draws"][0], results[1]["draws"][0])  # ranks differ


@pytest.mark.distributed
@pytest.mark.slow
def test_layout_pruning_and_latest(roundtrip):
    out_dir, results = roundtrip
    root = out_dir / "checkpoints"
    assert [p.name for p in complete_checkpoints(out_dir)] == ["step_2", "step_3"]  # keep_last=2
    assert (root / "latest").read_text() == "step_3"
    assert latest_checkpoint(out_dir) == root / "step_3"
    shards = sorted(p.name for p in (root / "step_3" / "zero").glob("*optim_states.pt"))
    assert len(shards) == 2  # one ZeRO optimizer shard per rank
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert results[0]["saved"] == root / "step_1"


@pytest.mark.distributed
@pytest.mark.slow
def test_export_reloads_with_identical_logits(roundtrip):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir, results = roundtrip
    model = AutoModelForCausalLM.from_pretrained(out_dir / "hf", attn_implementation="eager")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks ran single-threaded: same kernels, bitwise-equal sums
    try:
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
    finally:
        torch.set_num_threads(threads)
    for name, w in results[0]["got"]["weights"].items():
        assert torch.equal(model.get_parameter(name), w), name
    torch.testing.assert_close(logits, results[0]["logits"], rtol=0, atol=0)
    tok = AutoTokenizer.from_pretrained(out_dir / "hf")
    assert tok("one three")["input_ids"] == [1, 3]


class _FakeEngine:
    """Stands in for DeepSpeed: writes a shard; optionally hangs mid-save (to be killed)."""

    def __init__(self, hang: bool = False):
        self.hang = hang

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        shard = Path(save_dir) / tag
        shard.mkdir(parents=True)
        (shard / "partial.pt").write_bytes(b"x")
        while self.hang:
            time.sleep(0.05)
        (shard / "rank0.pt").write_bytes(b"y")

    def load_checkpoint(self, load_dir, tag, **_):
        assert (Path(load_dir) / tag / "rank0.pt").is_file()
        return load_dir, {}


def test_killed_save_leaves_latest_on_previous_checkpoint(tmp_path):
    CheckpointManager(tmp_path).save(_FakeEngine(), step=1, client_state={"step": 1})
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoint import _FakeEngine
        from stapo.trainer.checkpoint import CheckpointManager
        CheckpointManager({str(tmp_path)!r}).save(_FakeEngine(hang=True), step=2, client_state={{}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    partial = tmp_path / "checkpoints" / ".tmp-step_2" / "zero" / "partial.pt"
    try:
        deadline = time.monotonic() + 60
        while not partial.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert partial.exists(), "the save subprocess never reached the shard write"
    finally:
        proc.kill()
        proc.wait()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_1"]  # partial is ignored
    manager = CheckpointManager(tmp_path)
    assert manager.load(_FakeEngine(), restore_rng=False) == {"step": 1}
    manager.save(_FakeEngine(), step=2, client_state={"step": 2})  # cleans the stale temp dir
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1", "step_2"]


def test_latest_file_never_names_an_incomplete_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1)
    manager.save(_FakeEngine(), step=5, client_state={})
    (tmp_path / "checkpoints" / "step_9").mkdir()  # a foreign, incomplete dir
    assert latest_checkpoint(tmp_path).name == "step_5"
    (tmp_path / "checkpoints" / "latest").write_text("step_9")  # even if latest is corrupted
    assert latest_checkpoint(tmp_path).name == "step_5"
    assert latest_checkpoint(tmp_path / "nowhere") is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        CheckpointManager(tmp_path / "nowhere").load(_FakeEngine())


def test_keep_last_prunes_oldest_and_resave_replaces(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 3):
        manager.save(_FakeEngine(), step=step, client_state={"step": step})
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_2", "step_3"]
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        CheckpointManager(tmp_path, keep_last=0)


def test_rng_capture_restore_roundtrip():
    state = capture_rng_state()
    first = (random.random(), np.random.rand(), torch.rand(2))
    restore_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert first[:2] == again[:2]
    assert torch.equal(first[2], again[2])
