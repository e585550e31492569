"""Hang-proofing (docs/rewards.md): adversarial answers score -1 within the per-item limit, from any
thread; a hung item never stalls its batch; workers are killed, replaced and never leaked."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stapo.rewards import MathVerifier

pytestmark = pytest.mark.timeout(180)  # a hang here must fail, not stall CI
TIMEOUT_S = 1.0
MARGIN_S = 1.5  # 2 busy cores: process kill + replacement start, not the item itself
# sympy's simplify runs for minutes on this (found empirically); numerically it IS equal.
HANGING = (r"((x+1)(y+1)(z+1)(w+1))^{30}", r"((xy+x+y+1)(zw+z+w+1))^{30}")


def boxed(ans: str) -> str:
    return f"Reasoning... \\boxed{{{ans}}}"


ADVERSARIAL = [
    boxed("9^9^9"),
    boxed("2**30**5"),
    boxed("5^{5^{5^{5^5}}}"),
    boxed("10^{10^{10}}"),
    boxed("\\sqrt{" * 3000 + "2" + "}" * 3000),               # thousands of nested radicals
    boxed("(" * 5000 + "1" + ")" * 5000),                    # deeply nested parentheses
    boxed("9" * 100_000),                                    # a 100,000-digit integer
    "x" * 50_000 + boxed("3"),                               # 50 kB response, wrong answer
    "\\boxed{" * 20_000,                                     # 140 kB of unclosed boxes
    "$" * 50_000,                                            # regex stress
    "Answer: " + "\\frac{1}{" * 5000,                        # unbalanced fractions
    boxed("\ud800\udfff invalid surrogates \udcff"),         # lone UTF-16 surrogates
    boxed("1000000!"),
    boxed("x^{999999999}"),
    boxed(HANGING[0]),                                       # reaches sympy, killed at the limit
    None,
    "",
]
GROUND_TRUTH = [HANGING[1] if HANGING[0] in str(a) else "3" for a in ADVERSARIAL]
GROUND_TRUTH[7] = "4"  # the 50 kB response boxes 3; the truth is 4


def worker_children() -> list[int]:
    """Live verifier workers whose parent is this process."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"stapo.rewards._worker" in cmdline and " Z " not in stat:
            pids.append(int(entry.name))
    return pids


@pytest.fixture()
def verifier():
    v = MathVerifier(timeout_s=TIMEOUT_S, num_workers=2)
    v.pool.warmup()  # worker start-up is not part of the per-item limit
    yield v
    v.close()
    assert worker_children() == []


def _score_each(v: MathVerifier) -> list[tuple[float, float]]:
    out = []
    for response, gt in zip(ADVERSARIAL, GROUND_TRUTH):
        start = time.monotonic()
        score = v.score([response], [gt])[0]
        out.append((score, time.monotonic() - start))
    return out


def _check(results: list[tuple[float, float]]) -> None:
    for i, (score, elapsed) in enumerate(results):
        assert score == -1.0, f"adversarial #{i} scored {score}"
        assert elapsed <= TIMEOUT_S + MARGIN_S, f"adversarial #{i} took {elapsed:.2f} s"


def test_adversarial_inputs_score_minus_one_within_the_limit_main_thread(verifier):
    _check(_score_each(verifier))


def test_adversarial_inputs_score_minus_one_within_the_limit_worker_thread(verifier):
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(results=_score_each(verifier)))
    thread.start()
    thread.join(timeout=len(ADVERSARIAL) * (TIMEOUT_S + MARGIN_S) + 10)
    assert not thread.is_alive()
    _check(box["results"])


def test_batch_scores_good_items_despite_pathological_ones():
    good = [(boxed("\\frac{1}{2}"), "0.5", 1.0), (boxed("2x+2"), "2(x+1)", 1.0),
            (boxed("7"), "8", -1.0), (boxed("\\sqrt{8}"), "2\\sqrt{2}", 1.0)]
    # items are dispatched in order: the two hung ones go last, to the two workers at once
    responses = [*[g[0] for g in good], *ADVERSARIAL[:6], boxed(HANGING[0]), boxed(HANGING[0])]
    answers = [*[g[1] for g in good], *GROUND_TRUTH[:6], HANGING[1], HANGING[1]]
    limit = 2.5  # long enough that serial (>= 5 s) and concurrent (~2.5 s) are told apart
    with MathVerifier(timeout_s=limit, num_workers=2) as verifier:
        verifier.pool.warmup()
        start = time.monotonic()
        scores = verifier.score(responses, answers)
        elapsed = time.monotonic() - start
    assert scores[:4] == [g[2] for g in good]
    assert all(s == -1.0 for s in scores[4:])
    assert elapsed < limit + MARGIN_S, f"batch took {elapsed:.2f} s"  # one limit, not two
    assert worker_children() == []


def test_killed_worker_is_replaced_and_pool_keeps_working(verifier):
    before = set(verifier.pool.pids())
    assert verifier.score([boxed(HANGING[0])], [HANGING[1]]) == [-1.0]
    assert verifier.score([boxed("x^2-1")], ["(x-1)(x+1)"]) == [1.0]
    assert set(verifier.pool.pids()) != before  # the hung worker was killed and replaced
    assert len(worker_children()) <= 2


def _address_space_mb(pid: int) -> int:
    """VmSize of `pid` in MB: what RLIMIT_AS (the worker's memory cap) counts."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError(f"no VmSize for pid {pid}")


def test_memory_cap_kills_the_item_not_the_batch():
    # A true identity whose check needs fresh memory (expansion of a 50th power).
    item = (boxed("((x+1)(y+1))^{50}"), "(xy+x+y+1)^{50}")
    # Measure on THIS machine, in an uncapped warm worker: its address space at rest and the
    # most the item maps on top of it (memory a warm worker already holds is reused first, so
    # a fixed cap means different things on different machines and allocators).
    with MathVerifier(timeout_s=60.0, memory_mb=0, num_workers=1) as free:
        free.pool.warmup()
        (pid,) = free.pool.pids()
        baseline = peak = _address_space_mb(pid)
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _address_space_mb(pid))
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            assert free.score([item[0]], [item[1]]) == [1.0]  # uncapped: correct
        finally:
            done.set()
            watcher.join()
    need = peak - baseline
    if need < 4:
        pytest.skip(f"the item mapped only {need} MB beyond the worker's {baseline} MB here: too "
                    "little fresh memory to exercise the cap on this machine")
    # Cap halfway through the item's need: the worker starts (the cap is set after warm-up),
    # then its item fails to allocate, the worker exits, the item scores -1, cheap items score.
    with MathVerifier(timeout_s=60.0, memory_mb=baseline + need // 2, num_workers=1) as v:
        start = time.monotonic()
        scores = v.score([item[0], boxed("34")], [item[1], "34"])
        assert v.pool.pids() == []  # the worker died and nothing was left pending to replace it
    assert scores == [-1.0, 1.0]
    assert time.monotonic() - start < 30.0  # died of memory, long before the 60 s time limit


def test_closed_verifier_refuses_symbolic_work_and_context_manager_cleans_up():
    with MathVerifier(timeout_s=TIMEOUT_S, num_workers=1) as v:
        assert v.score([boxed("2x+2")], ["2(x+1)"]) == [1.0]
        assert len(worker_children()) == 1
    assert worker_children() == []
    with pytest.raises(RuntimeError, match="closed"):
        v.score([boxed("2x+2")], ["2(x+1)"])


def test_workers_die_with_a_sigkilled_parent(tmp_path):
    script = (
        "import sys, time\n"
        "from stapo.rewards import MathVerifier\n"
        "v = MathVerifier(timeout_s=5, num_workers=2)\n"
        "v.score(['\\\\boxed{2x+2}', '\\\\boxed{x^2}'], ['2(x+1)', 'x*x'])\n"
        "print(' '.join(map(str, v.pool.pids())), flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids, "the child never started its workers"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.1)
        alive = [p for p in pids if Path(f"/proc/{p}").exists()
                 and " Z " not in Path(f"/proc/{p}/stat").read_text()]
        assert alive == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_forked_child_gets_its_own_workers_and_leaves_the_parents_alone(verifier):
    parent_workers = set(verifier.pool.pids())
    pid = os.fork()
    if pid == 0:  # child: inherited workers are not its own; it starts fresh ones
        ok = False
        try:
            ok = verifier.score([boxed("2x+2")], ["2(x+1)"]) == [1.0]
            ok = ok and not (set(verifier.pool.pids()) & parent_workers)
            verifier.close()
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:  # never leave a stuck child behind
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("forked child did not finish within 60 s")
    assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0
    assert set(verifier.pool.pids()) == parent_workers
    assert verifier.score([boxed("x^2-1")], ["(x-1)(x+1)"]) == [1.0]


def test_workers_do_not_inherit_the_rollout_servers_secret(monkeypatch):
    """A reward worker runs code chosen by the run (sympy on policy output, a user's reward function): it gets no
    ``STAPO_SERVER_TOKEN``, the credential that lets a process change what the rollout servers serve."""
    monkeypatch.setenv("STAPO_SERVER_TOKEN", "lane-secret-not-for-workers")
    with MathVerifier(timeout_s=30.0, num_workers=1) as verifier:
        verifier.pool.warmup()
        (pid,) = verifier.pool.pids()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not any(entry.startswith(b"STAPO_SERVER_TOKEN=") for entry in environ)
    assert any(entry.startswith(b"PYTHONPATH=") for entry in environ)  # the environment itself was read
