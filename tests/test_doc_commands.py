"""Every command line the docs show runs: a new doc line that does not run fails here.

Sources: README.md and docs/*.md (code blocks and inline code) and the comments of
examples/recipes/*.yaml. How each kind of line runs (in this process, offline, on CPU):

* ``stapo train ...`` and launcher lines (``deepspeed`` / ``torchrun`` / ``accelerate launch``
  ``-m stapo.cli train ...``): with ``--dry-run``; a launcher's ranks become ``--world-size``.
* ``stapo masks ...`` and ``--help`` lines: as written.
* ``stapo serve MODEL ...`` prints the vLLM server's command line (``--dry-run``), starting nothing, with
  ``STAPO_SERVER_TOKEN`` set as the server examples set it first;
* ``stapo inspect ...``, ``stapo health ...`` and ``stapo status ...`` run and ``stapo eval ...`` dry-runs against one tiny training run;
  placeholders (``RUN_DIR``, ``MODEL``, ``my.jsonl``, ...) become that run and its files (PLACEHOLDERS).
* ``python examples/X.py ARGS``: dry — the script's config (EXAMPLES: how it reads its arguments)
  through ``stapo train --dry-run``; training them takes minutes.
* ``python bench/X.py ARGS``: checked — the script exists and its source declares every option shown; the
  ``--smoke`` runs themselves are tests/test_bench_*.py (checked here to exist).

A synopsis's optional parts (``[key=value ...]``) are dropped; a bare command name in prose
(``stapo eval``) is a name, not a command line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from stapo.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RECIPES = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))
STARTS = ("stapo ", "python examples/", "python bench/", "deepspeed ", "torchrun ", "accelerate launch ")
TINY = "examples/recipes/tiny_cpu.yaml"

# How each example script reads its arguments, as `stapo train` arguments (a new script needs a line).
EXAMPLES = {
    "examples/train.py": lambda args: args,  # [RECIPE] [key=value ...]: a first argument is the recipe, as in `stapo train`
    "examples/custom_mask.py": lambda args: ["--import", "examples/custom_mask.py",
                                             "trainer.output_dir=outputs/custom_mask", *args],
}


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    text: str  # the line as the docs show it

    @property
    def argv(self) -> list[str]:
        return shlex.split(re.sub(r"\s\[[^\]]*\]", "", self.text), comments=True)


def _candidates(text: str) -> list[str]:
    """Command lines in one line of docs: a `&&` chain's parts, `$ ` prompts and `(or: ...)` removed."""
    text = text.strip().removeprefix("$ ").removeprefix("(or: ")
    if text.endswith(")") and text.count("(") < text.count(")"):
        text = text[:-1]
    parts = [p.strip() for p in text.split("&&")]
    return [p for p in parts if p.startswith(STARTS) and not re.match(r"stapo \w+:", p)]  # not `stapo eval: error:`


def _markdown_commands(page: Path) -> list[DocCommand]:
    found, fenced, lines = [], False, page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line, number = lines[i], i + 1
        while line.rstrip().endswith("\\") and i + 1 < len(lines):  # shell continuation
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            pieces = [line]
        else:
            pieces = re.findall(r"`([^`\n]+)`", line)
        where = f"{page.relative_to(ROOT)}:{number}"
        found += [DocCommand(where, c) for piece in pieces for c in _candidates(piece)]
    return found


def _recipe_commands(recipe: Path) -> list[DocCommand]:
    found = []
    for number, line in enumerate(recipe.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("#"):
            found += [DocCommand(f"{recipe.relative_to(ROOT)}:{number}", c) for c in _candidates(line[1:])]
    return found


def doc_commands() -> list[DocCommand]:
    commands = [c for page in PAGES for c in _markdown_commands(page)]
    commands += [c for recipe in RECIPES for c in _recipe_commands(recipe)]
    names = (["stapo", "eval"], ["stapo", "inspect"], ["stapo", "serve"], ["stapo", "status"],
             ["stapo", "health"])
    return [c for c in commands if c.argv not in names]  # a command named in prose


COMMANDS = doc_commands()


# ---- the tiny run that `inspect` and `eval` lines point at --------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One step of the built-in recipe at smoke size, with token records and an exported model."""
    root = tmp_path_factory.mktemp("doc_run")
    run = root / "run"
    overrides = ["tiny.warm_start_steps=0", "trainer.total_steps=1", "trainer.train_batch_size=4",
                 "trainer.mini_batch_size=4", "rollout.group_size=2", "rollout.max_response_length=8",
                 "data.num_builtin_problems=16", "data.eval_size=4", "inspect.record_every=1",
                 "trainer.save_every=0", "logging.plot=false", "logging.tensorboard=false",
                 "logging.progress=false", f"trainer.output_dir={run}"]
    assert main(["train", *overrides]) == 0  # in this process, like the trainer tests (a 1-rank group)
    data = root / "problems.jsonl"  # both field spellings the eval docs use
    data.write_text('{"problem": "Compute 1+2.", "question": "Compute 1+2.", "answer": "3"}\n')
    return {"run": run, "model": run / "final", "data": data, "out": root / "out"}


def _placeholders(run: dict) -> dict[str, str]:
    """Doc placeholder -> what it stands for here."""
    return {
        "MODEL": str(run["model"]), "MODEL_DIR": str(run["model"]), "runs/stapo/final": str(run["model"]),
        "warm": str(run["model"]), "outputs/tiny_tir/final": str(run["model"]), "tir_eval.jsonl": str(run["data"]),
        "RUN_DIR": str(run["run"]), "outputs/tiny_stapo": str(run["run"]), "DIR": str(run["out"]),
        "my.jsonl": str(run["data"]), "arith_easy.jsonl": str(run["data"]),
        "math500=MATH-500-test.parquet": f"math500={run['data']}",
        "my_rewards.py:score": "examples/reward_function.py:boxed_with_level",
        "file.py:fn": "examples/reward_function.py:boxed_with_level", "NAME": "math500",
    }


def _launcher_world_size(argv: list[str]) -> tuple[int, list[str]]:
    """``(ranks, stapo arguments)`` of a deepspeed / torchrun / accelerate launch line."""
    module = next(i for i, a in enumerate(argv) if a == "stapo.cli")
    options = dict(zip(argv, argv[1:]))
    per_node = options.get("--num_gpus") or options.get("--nproc_per_node") or options.get("--num_processes")
    nodes = options.get("--num_nodes") or options.get("--nnodes") or "1"
    assert per_node, f"no rank count in {' '.join(argv)}"
    return int(per_node) * int(nodes), argv[module + 1:]


def _stapo_argv(argv: list[str]) -> list[str]:
    """The ``stapo`` arguments a doc line runs with here."""
    world = None
    if argv[0] in ("deepspeed", "torchrun", "accelerate"):
        world, argv = _launcher_world_size(argv)
    elif argv[0] == "python":
        script = argv[1]
        assert script in EXAMPLES, f"{script}: add to EXAMPLES how it reads its arguments"
        argv = ["train", *EXAMPLES[script](argv[2:])]
    else:
        argv = argv[1:]
    if argv[:1] == ["train"] and "--help" not in argv:
        argv = [*argv, "--dry-run"] + (["--world-size", str(world)] if world else [])
    if argv[:1] in (["eval"], ["serve"]) and "--help" not in argv:  # serve: print vLLM's command, start nothing
        argv = [*argv, "--dry-run"]
    return argv


def _bench_check(argv: list[str]) -> None:
    script = ROOT / argv[1]
    assert script.is_file(), f"no such script: {argv[1]}"
    source = script.read_text(encoding="utf-8")
    for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
        assert f'"{flag}"' in source or f"'{flag}'" in source, f"{argv[1]} declares no option {flag}"
    if "--smoke" in argv:
        runs = [t for t in (ROOT / "tests").rglob("test_bench_*.py") if script.name in t.read_text(encoding="utf-8")]
        assert runs, f"no tests/**/test_bench_*.py runs {argv[1]} --smoke"


def test_the_docs_show_commands_of_every_kind():
    kinds = {c.argv[0] if c.argv[0] != "python" else c.argv[1].split("/")[0] for c in COMMANDS}
    assert {"stapo", "deepspeed", "torchrun", "accelerate", "examples", "bench"} <= kinds, kinds
    assert len(COMMANDS) > 60
    shown = {c.text for c in COMMANDS}
    for line in ("stapo train mask.name=none", "stapo train mask.name=entropy_top",
                 "stapo train --import examples/custom_mask.py mask.name=low_confidence_positive"):
        assert any(t.startswith(line) for t in shown), line  # the three: they must stay checked


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.where} {c.text[:60]}")
def test_doc_command_runs(command, request, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("STAPO_SERVER_TOKEN", "docs-secret")  # the server examples export it first
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = command.argv
    if argv[0] == "python" and argv[1].startswith("bench/"):
        _bench_check(argv)
        return
    stapo = _stapo_argv(argv)
    if stapo[:1] in (["inspect"], ["eval"], ["status"], ["health"]):  # also under a launcher (`torchrun ... -m stapo.cli eval MODEL`)
        table = _placeholders(request.getfixturevalue("tiny_run"))
    else:
        table = {"CONFIG": TINY, "CONFIG.yaml": TINY}
    synopsis = ("key=value", "...")  # `stapo train CONFIG key=value ...`
    stapo = [table.get(a, a) for a in stapo if a not in synopsis]
    if tuple(stapo) in _PASSED:  # several pages show the same line: run it once
        return
    try:
        code = main(stapo)
    except SystemExit as exc:  # --help, or argparse rejecting the line
        code = exc.code
    err = capsys.readouterr().err
    assert code == 0, f"{command.where}: `{command.text}` ran as `stapo {' '.join(stapo)}`: {err[-2000:]}"
    _PASSED.add(tuple(stapo))


_PASSED: set[tuple[str, ...]] = set()
