"""The mistakes a new user makes, as a table: what they typed -> the one line they see.

Each row runs the command line in this process (``stapo.cli.main``, seconds each) and checks that the
command exits 2 with exactly one line on stderr, the line that names the key, file or line and the fix.
Config mistakes are checked with and without ``--dry-run``: ``stapo train`` stops on them before anything
is built.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stapo.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "recipes" / "tiny_cpu.yaml")

FILES = {
    "dup_section.yaml": "model:\n  path: builtin:tiny\ntrainer:\n  total_steps: 3\ntrainer:\n  seed: 1\n",
    "dup_key.yaml": "model:\n  path: builtin:tiny\ntrainer:\n  seed: 1\n  seed: 2\n",
    "bad.yaml": "model:\n  path: builtin:tiny\ntrainer: [a\n",
    "empty.yaml": "",
    "partial.yaml": "trainer:\n  total_steps: 3\n",
    "bad_syntax.py": "def f(:\n    pass\n",
    "bad_import.py": "import os\nimport stapo_no_such_module_anywhere\n",
}

# (id, arguments after `stapo train` ({dir}: the table's files), the line the user sees)
TABLE = [
    ("yaml-section-twice", ["{dir}/dup_section.yaml"],
     "{dir}/dup_section.yaml, line 5, column 1: invalid YAML: 'trainer' is given twice (lines 3 and 5): the "
     "second would replace the first; merge them into one"),
    ("yaml-key-twice", ["{dir}/dup_key.yaml"], "{dir}/dup_key.yaml, line 5, column 3: invalid YAML: 'seed' is given "
                                                "twice (lines 4 and 5)"),
    ("yaml-syntax", ["{dir}/bad.yaml"],
     "{dir}/bad.yaml, line 4, column 1: invalid YAML: expected ',' or ']', but got '<stream end>' (while parsing a "
     "flow sequence started at line 3)"),
    ("yaml-empty", ["{dir}/empty.yaml"],
     "{dir}/empty.yaml is empty: a config file is read on top of stapo's defaults, the paper's sizes"),
    ("yaml-partial", ["{dir}/partial.yaml"], "{dir}/partial.yaml sets no model.path: a config file is read on top of "
                                             "stapo's defaults, the paper's sizes (256 prompts x 8 per step, 15k-token "
                                             "responses), not a demo's; start from a recipe (`stapo recipes` lists "
                                             "them)"),
    ("override-yaml", ["rollout.server.addresses=[a"], "override 'rollout.server.addresses=[a', line 1, column 3: invalid YAML"),
    ("mask-param-type", ["mask.params.tau_p=abc"], "mask.params.tau_p: expected a number, got 'abc'"),
    ("list-as-string", ["rollout.tools.enabled=true", "rollout.tools.names=python"],
     "rollout.tools.names: expected a list, got 'python' (write it as [python])"),
    ("preset-typo", ["data.preset=dapo_math17k"], "data.preset: unknown preset 'dapo_math17k'; known: dapo_math_17k"),
    ("preset-builtin-source", ["data.preset=dapo_math_17k"],
     "data.preset dapo_math_17k maps the columns of a dataset, but data.source is builtin:arithmetic: set "
     "data.source=BytedTsinghua-SIA/DAPO-Math-17k"),
    ("lora-params-lora-off", ["model.lora.rank=8", "model.lora.alpha=8"],
     "model.lora.rank, model.lora.alpha set with model.lora.enabled false: the adapters' settings do nothing "
     "without them; set model.lora.enabled=true"),
    ("import-syntax-error", ["--import", "{dir}/bad_syntax.py"],
     "--import {dir}/bad_syntax.py, line 1: SyntaxError: invalid syntax"),
    ("import-import-error", ["--import", "{dir}/bad_import.py"],
     "--import {dir}/bad_import.py, line 2: ModuleNotFoundError: No module named 'stapo_no_such_module_anywhere'"),
    ("recipe-name-typo", ["tiny_tirr"], "config file not found: tiny_tirr, nor a recipe of that name; did you mean "
                                        "'tiny_tir'?"),
    ("option-typo", ["--dryrun"], "unrecognized argument --dryrun; did you mean --dry-run?"),
    ("override-without-value", ["trainer.total_steps"], "an override needs a value, e.g. trainer.total_steps=VALUE"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mistakes")
    for name, text in FILES.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "train"])
@pytest.mark.parametrize("name, args, line", TABLE, ids=[row[0] for row in TABLE])
def test_a_mistake_is_one_line_naming_it_and_the_fix(name, args, line, dry_run, files, capsys, tmp_path,
                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", *(a.format(dir=files) for a in args), f"trainer.output_dir={tmp_path / 'run'}"]
    if dry_run:
        argv.append("--dry-run")
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1, err
    assert err.startswith("stapo train: error: ") and line.format(dir=files) in err, err


def test_lora_target_modules_that_name_no_module_of_the_model(tiny_model_dir, capsys, tmp_path):
    """PEFT fails only when no name matches; one wrong name among right ones would silently train fewer
    adapters. The dry run builds the model on the meta device to check (the trainer checks the loaded one)."""
    argv = ["train", TINY, f"model.path={tiny_model_dir}", "model.lora.enabled=true",
            "model.lora.target_modules=[q_proj, qkv_proj]", f"trainer.output_dir={tmp_path}", "--dry-run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.lora.target_modules: ['qkv_proj'] name no module of this model; its linear layers: " in err
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in err
    argv[4] = "model.lora.target_modules=[q_proj, v_proj]"
    assert main(argv) == 0, capsys.readouterr().err


def test_lora_target_problem_on_the_loaded_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from stapo.distributed.lora import lora_target_problem, wrap_with_lora

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert lora_target_problem(model, ["q_proj", "self_attn.v_proj"]) is None  # suffixes, as PEFT matches them
    with pytest.raises(ValueError, match=r"\['qkv'\] name no module of this model"):
        wrap_with_lora(model, rank=2, alpha=4, dropout=0.0, target_modules=["q_proj", "qkv"], seed=0)


def test_mask_params_from_the_command_line_are_typed():
    """``mask.params.tau_p=2e-3``: YAML reads ``2e-3`` as a string; it becomes the mask's float, as config fields do."""
    from stapo.config import STAPOConfig

    cfg = STAPOConfig.from_yaml(TINY, ["mask.params.tau_p=2e-3"])
    assert cfg.mask.params["tau_p"] == 0.002 and isinstance(cfg.mask.params["tau_p"], float)
