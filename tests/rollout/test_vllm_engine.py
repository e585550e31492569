"""VLLMEngine: tests of the pure parts (output conversion, executor plan, the seed scheme, CPU settings,
weight-bucket packing, lazy import). The engine against the real vLLM is tested in the vLLM lane
(tests/vllm_cpu: vLLM's CPU build in CI, the same tests on a GPU)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from stapo.rollout import Generation, SamplingParams, VLLMEngine
from stapo.rollout.trajectory import prompt_seeds
from stapo.distributed.process_group import DistInfo
from stapo.rollout.vllm_engine import (EXTERNAL_LAUNCHER, ExecutorPlan, plan_executor, segment_from_vllm,
                                       unlink_cpu_shm_names)
from stapo.serve.launcher import CPU_KV_CACHE_BYTES, cpu_engine_kwargs
from stapo.sync.bucket_format import pack_bucket, unpack_bucket


def _group(rank: int, world_size: int, local_rank: int) -> DistInfo:
    return DistInfo(rank, world_size, local_rank, torch.device("cpu"))


def completion(index, token_ids, logprobs, reason="stop", text=""):
    entries = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(token_ids, logprobs, strict=True)]
    return SimpleNamespace(index=index, token_ids=token_ids, logprobs=entries, finish_reason=reason, text=text)


# ----------------------------------------------------------------------------- CPU: pure parts
def test_a_vllm_completion_becomes_a_segment():
    segment = segment_from_vllm(completion(0, [5, 6, 2], [-1.0, -2.0, -0.125], text="a"), version=7)
    assert segment.tokens == [5, 6, 2] and segment.logprobs == [-1.0, -2.0, -0.125]
    assert segment.finish == "stop" and segment.text == "a" and segment.version == 7
    assert segment_from_vllm(completion(0, [8, 9], [-0.375, -0.25], "length")).finish == "length"
    plain = SimpleNamespace(index=0, token_ids=[4], logprobs=[{4: -0.25}], finish_reason="length", text="x")
    assert segment_from_vllm(plain).logprobs == [-0.25]  # plain float log-probs too


def test_a_vllm_completion_without_logprobs_is_refused():
    with pytest.raises(ValueError, match="logprobs=0"):
        segment_from_vllm(SimpleNamespace(index=0, token_ids=[5], logprobs=None, finish_reason="stop", text=""))
    with pytest.raises(RuntimeError, match="'abort'"):
        segment_from_vllm(completion(0, [5], [-1.0], reason="abort"))


TORCHRUN_ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}


def test_plain_process_with_a_group_gets_the_launcher_variables_derived_from_it():
    # `stapo train` in one process: a 1-rank tcp:// group, only LOCAL_RANK=0 set (issue #12's
    # KeyError: 'RANK'); vLLM's external launcher reads RANK and LOCAL_RANK
    plan = plan_executor(1, {"LOCAL_RANK": "0"}, _group(0, 1, 0), spare_port=4321)
    assert plan == ExecutorPlan(EXTERNAL_LAUNCHER, {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                                    "MASTER_PORT": "4321"})
    # no LOCAL_RANK at all: the device index the trainer chose
    assert plan_executor(1, {}, _group(0, 1, 3)).env["LOCAL_RANK"] == "3"


def test_launched_process_gets_nothing_added():
    for launcher in ("torchrun", "deepspeed", "accelerate"):  # all export the same five variables
        plan = plan_executor(1, TORCHRUN_ENV, _group(1, 2, 1))
        assert plan == ExecutorPlan(EXTERNAL_LAUNCHER, {}), launcher
    # tensor parallel inside a launched group is the external launcher too
    assert plan_executor(2, TORCHRUN_ENV, _group(1, 2, 1)).backend == EXTERNAL_LAUNCHER


def test_partial_environment_is_completed_and_contradictions_are_refused():
    # MPI-style launch: ranks known to the group, MASTER_* set, RANK/WORLD_SIZE not exported
    plan = plan_executor(1, {"MASTER_ADDR": "h", "MASTER_PORT": "1"}, _group(2, 4, 0))
    assert plan.env == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}
    with pytest.raises(ValueError, match="RANK=1 in the environment"):
        plan_executor(1, TORCHRUN_ENV, _group(0, 2, 0))
    with pytest.raises(ValueError, match="must divide"):
        plan_executor(2, TORCHRUN_ENV | {"WORLD_SIZE": "3"}, _group(1, 3, 1))


def test_no_group_standalone_or_launched():
    assert plan_executor(1, {}, None) == ExecutorPlan(None, {})  # evaluation: vLLM's own executor
    assert plan_executor(4, {"LOCAL_RANK": "0"}, None) == ExecutorPlan(None, {})  # vLLM spawns TP workers
    assert plan_executor(1, TORCHRUN_ENV, None) == ExecutorPlan(EXTERNAL_LAUNCHER, {})  # vLLM joins env://
    with pytest.raises(ValueError, match=r"\['LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'\]"):
        plan_executor(1, {"RANK": "0", "WORLD_SIZE": "1"}, None)


def test_every_request_carries_its_own_seed():
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5, seed=11, stop_token_ids=(2,))
    seeds = [t.seed for t in Generation([[1], [2], [3]], 4, sp).trajectories]
    firsts = seeds[::4]
    assert len(set(firsts)) == 3 and all(0 <= s < 2**31 - 1 for s in firsts)
    assert firsts == prompt_seeds(11, 3)  # derived reproducibly from sp.seed and the prompt's index
    assert seeds == [s + k for s in firsts for k in range(4)]  # vLLM's rule: sample k of a seed-s request is s + k
    assert prompt_seeds(11, 5)[:3] == firsts  # a prompt's seed does not depend on the batch size
    assert set(prompt_seeds(12, 3)).isdisjoint(firsts)  # another step / rank / round: other streams
    assert [t.seed for t in Generation([[1]], 2, SamplingParams(seed=None)).trajectories] == [None, None]


def test_cpu_engine_settings():
    # vLLM's CPU build: a fixed KV cache (its gpu_memory_utilization is a fraction of RAM) unless
    # VLLM_CPU_KVCACHE_SPACE is set; whole-prompt prefill (seeded requests + chunked prefill crash there)
    assert cpu_engine_kwargs(256, {}) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096,
                                          "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
    assert cpu_engine_kwargs(8192, {"VLLM_CPU_KVCACHE_SPACE": "4"}) == {"enable_chunked_prefill": False,
                                                                        "max_num_batched_tokens": 8192}


def test_the_cpu_shared_memory_names_of_this_ranks_groups_are_unlinked(tmp_path, monkeypatch):
    """vLLM's CPU TP segments under the external launcher: ident "//" (from env://), so "-tp:0-[0-1]-cpushm_R";
    a name of a group this rank is not in, another ident's, and anything else stay."""
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")
    names = ["-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1", "-tp:1-[2-3]-cpushm_0", "4711-tp:0-[0-1]-cpushm_0",
             "psm_0c0482e0", "-tp:0-[0-1]-cpushm"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert unlink_cpu_shm_names(1, str(tmp_path)) == names[:2]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    assert unlink_cpu_shm_names(1, str(tmp_path)) == []  # the group's other rank got there first: fine
    assert unlink_cpu_shm_names(0, str(tmp_path / "no-such-dir")) == []


def test_weight_bucket_round_trips_through_msgpack_native_values():
    gen = torch.Generator().manual_seed(0)
    bucket = [("model.embed_tokens.weight", torch.randn(5, 3, generator=gen).to(torch.bfloat16)),
              ("model.norm.weight", torch.randn(3, generator=gen)),  # fp32 after 30 bf16 bytes: aligned
              ("lm_head.weight", torch.randn(4, 6, generator=gen).half().t()),  # non-contiguous view
              ("scalar", torch.tensor(2.5, dtype=torch.float64))]
    packed = pack_bucket(bucket)
    assert set(packed) == {"names", "dtypes", "shapes", "offsets", "data"} and isinstance(packed["data"], bytes)
    assert packed["dtypes"] == ["bfloat16", "float32", "float16", "float64"]
    assert packed["shapes"] == [[5, 3], [3], [6, 4], []]
    # 30 bytes of bf16 -> next tensor at 32; 12 bytes fp32 -> 44 -> 48; 48 bytes fp16 -> 96
    assert packed["offsets"] == [0, 32, 48, 96] and len(packed["data"]) == 104
    native = (str, int, list, bytes)
    assert all(isinstance(x, native) for v in packed.values() for x in (v if isinstance(v, list) else [v]))
    out = unpack_bucket(packed)
    assert [n for n, _ in out] == [n for n, _ in bucket]
    for (_, want), (_, got) in zip(bucket, out):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert unpack_bucket(pack_bucket([])) == []


def test_unpack_bucket_errors_name_the_problem():
    packed = pack_bucket([("w", torch.ones(4))])
    with pytest.raises(ValueError, match="outside"):
        unpack_bucket({**packed, "data": packed["data"][:8]})
    with pytest.raises(ValueError, match="unknown dtype 'float99'"):
        unpack_bucket({**packed, "dtypes": ["float99"]})
    with pytest.raises(ValueError, match=r"lacks \['offsets'\]"):
        unpack_bucket({k: v for k, v in packed.items() if k != "offsets"})
    with pytest.raises(TypeError, match="'w' is a list"):
        pack_bucket([("w", [1.0])])


def test_importing_stapo_rollout_never_imports_vllm():
    code = ("import sys; sys.modules['vllm'] = None\n"  # any `import vllm` now raises ImportError
            "import stapo.rollout, stapo.rollout.vllm_engine\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_missing_vllm_gives_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"stapo\[vllm\]"):
        VLLMEngine("unused")
