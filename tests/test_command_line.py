"""The ``stapo`` command line and the recipes it runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from stapo.cli import builtin_recipe, main
from stapo.cli.train import print_summary
from stapo.config import STAPOConfig
from stapo.losses import build_mask

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))
BUILTIN_MASKS = ("none", "stapo", "prob_only", "high_entropy_low_prob", "entropy_top")


@pytest.fixture
def mask_registry():
    """The mask registry as it was before the test (a user module registers a mask in this process)."""
    from stapo.losses.masks import MASKS

    before = dict(MASKS)
    yield
    MASKS.clear()
    MASKS.update(before)


def test_masks_lists_builtins_and_a_user_registered_mask(tmp_path, capsys, mask_registry):
    user = tmp_path / "my_masks.py"
    user.write_text(
        "import torch\n"
        "from stapo.losses import TokenMask, register_mask\n"
        "@register_mask('cli_negative_only')\n"
        "class NegativeOnly(TokenMask):\n"
        "    '''Keeps only negative-advantage tokens.'''\n"
        "    margin: float = 0.0\n"
        "    def silence(self, stats):\n"
        "        return stats.advantages_bt >= self.margin\n"
    )
    assert main(["masks", "--import", str(user)]) == 0
    out = capsys.readouterr().out
    for name in (*BUILTIN_MASKS, "cli_negative_only"):
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    assert "tau_p=0.002" in out and "margin=0.0" in out


@pytest.mark.parametrize("argv, message", [
    (["train", "does/not/exist.yaml"], "config file not found"),
    (["train", "optim.lrr=1"], "did you mean 'optim.lr'"),
    (["train", "rollout.group_size=1"], "group_size"),
    (["train", "mask.name=nonexistent"], "unknown mask 'nonexistent'"),
    (["train", "--import", "missing_masks.py"], "no such file"),
    (["inspect", "no/such/run"], "no such run directory"),
])
def test_user_mistakes_are_one_line_errors(argv, message, capsys):
    # an override without a config file: the first positional that contains '=' is an override
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_help_works_for_every_command(capsys):
    """In this process (``python -m stapo.cli --help`` itself runs in test_bad_input.py)."""
    for command in ([], ["train"], ["masks"], ["tools"], ["recipes"], ["eval"], ["status"], ["inspect"], ["serve"]):
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        out = capsys.readouterr().out
        assert done.value.code == 0 and out.startswith("usage: stapo"), (command, out)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_strictly(recipe):
    cfg = STAPOConfig.from_yaml(recipe)
    assert cfg.trainer.output_dir


def test_paper_recipes_differ_only_in_the_method():
    """Each paper recipe equals its size's JustRL recipe except mask / loss / output_dir."""
    method_keys = {("mask", "name"), ("mask", "params"), ("loss", "clip_high"), ("loss", "agg"),
                   ("trainer", "output_dir")}
    paper = [p for p in RECIPES
             if p.stem.startswith("qwen3_") and not p.stem.endswith(("_lora", "_stare", "_clip_cov", "_tir"))]
    assert len(paper) == 18  # 3 sizes x (STAPO, GRPO, JustRL, 20-Entropy, 2 ablations)
    for recipe in paper:
        base_name = "_".join(recipe.stem.split("_")[:3 if "1_7b" in recipe.stem else 2]) + "_justrl.yaml"
        base = yaml.safe_load((recipe.parent / base_name).read_text())
        this = yaml.safe_load(recipe.read_text())
        diffs = {(s, k) for s in set(base) | set(this) for k in set(base.get(s, {})) | set(this.get(s, {}))
                 if base.get(s, {}).get(k) != this.get(s, {}).get(k)}
        assert diffs <= method_keys, (recipe.name, diffs - method_keys)
        if recipe.name != base_name:  # a method recipe must change what defines the method
            assert diffs & {("mask", "name"), ("loss", "agg"), ("loss", "clip_high")}, recipe.name
            assert ("trainer", "output_dir") in diffs, f"{recipe.name} would overwrite {base_name}'s run"


@pytest.mark.parametrize("recipe", ["qwen3_1_7b_stare", "qwen3_8b_stare", "qwen3_14b_stare", "qwen3_8b_clip_cov"])
def test_weighting_recipes_are_the_stapo_recipe_with_their_mask(recipe):
    """STARE / Clip-Cov recipes: the STAPO recipe's data and schedule; their mask, STARE's dual-clip 10."""
    size = recipe.split("_", 1)[1].rsplit("_", 2 if recipe.endswith("clip_cov") else 1)[0]
    stapo = STAPOConfig.from_yaml(ROOT / "examples" / "recipes" / f"qwen3_{size}_stapo.yaml").to_dict()
    this = STAPOConfig.from_yaml(ROOT / "examples" / "recipes" / f"{recipe}.yaml").to_dict()
    diffs = {(s, k) for s in stapo for k in stapo[s] if stapo[s][k] != this[s][k]}
    method = "stare" if recipe.endswith("stare") else "clip_cov"
    assert diffs == {("mask", "name"), ("mask", "params"), ("trainer", "output_dir")} | (
        {("loss", "clip_c")} if method == "stare" else set())
    assert this["mask"]["name"] == method and this["loss"]["clip_c"] == (10.0 if method == "stare" else None)
    assert build_mask(method, **this["mask"]["params"]) == build_mask(method)  # the defaults, spelled out


@pytest.mark.parametrize("size", ["8b", "14b"])
def test_lora_recipes_are_the_stapo_recipe_on_adapters(size):
    """LoRA changes nothing in the algorithm: the LoRA recipe equals the full STAPO recipe except the
    adapters, their lr, the one-GPU memory settings and the output dir (docs/lora.md)."""
    full = STAPOConfig.from_yaml(ROOT / "examples" / "recipes" / f"qwen3_{size}_stapo.yaml").to_dict()
    lora = STAPOConfig.from_yaml(ROOT / "examples" / "recipes" / f"qwen3_{size}_stapo_lora.yaml").to_dict()
    allowed = {("model", "lora"), ("optim", "lr"), ("trainer", "zero_stage"), ("trainer", "output_dir"),
               ("trainer", "max_tokens_per_micro_batch"), ("rollout", "gpu_memory_utilization"),
               ("rollout", "offload_training_state")}  # memory settings: LoRA has no ZeRO state worth moving
    diffs = {(s, k) for s in full for k in full[s] if full[s][k] != lora[s][k]}
    assert {("model", "lora"), ("optim", "lr"), ("trainer", "output_dir")} <= diffs <= allowed
    assert lora["model"]["lora"]["enabled"] and lora["optim"]["lr"] == pytest.approx(10 * full["optim"]["lr"])


def test_the_tir_recipe_is_the_stapo_recipe_with_tools():
    """Tool-integrated reasoning changes the rollout, not the algorithm (docs/tir.md): the TIR recipe is
    the 8B STAPO recipe plus ``rollout.tools`` on the post-trained Qwen3-8B (it writes tool calls)."""
    stapo = STAPOConfig.from_yaml(ROOT / "examples" / "recipes" / "qwen3_8b_stapo.yaml").to_dict()
    tir = STAPOConfig.from_yaml(ROOT / "examples" / "recipes" / "qwen3_8b_stapo_tir.yaml").to_dict()
    diffs = {(s, k) for s in stapo for k in stapo[s] if stapo[s][k] != tir[s][k]}
    assert diffs == {("model", "path"), ("rollout", "tools"), ("trainer", "output_dir")}
    assert tir["model"]["path"] == "Qwen/Qwen3-8B" and tir["mask"]["name"] == "stapo"
    tools = tir["rollout"]["tools"]
    assert tools["enabled"] and tools["names"] == ["python"] and tools["parser"] == "qwen3" and tools["stateful"]


def test_the_built_in_recipe_is_the_tiny_example():
    assert STAPOConfig.from_yaml(builtin_recipe()) == STAPOConfig.from_yaml(ROOT / "examples" / "recipes" / "tiny_cpu.yaml")
    tir = builtin_recipe("tiny_tir.yaml")  # the TIR demo's recipe ships in the package too (docs/tir.md)
    assert tir.read_text() == (ROOT / "examples" / "recipes" / "tiny_tir.yaml").read_text()


def test_summary_lists_only_what_the_run_wrote(tmp_path, capsys):
    # logging.tensorboard, logging.plot and trainer.export_hf off: no tensorboard/, curves.png, final/
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = STAPOConfig.from_yaml(None, [f"trainer.output_dir={run}", "logging.tensorboard=false",
                                       "logging.plot=false", "trainer.export_hf=false"])
    summary = {"steps": 1, "seconds": 60.0, "accuracy_before": float("nan"), "accuracy_after": float("nan"),
               "silenced_frac_mean": 0.0, "spurious_frac_mean": 0.0}
    print_summary(cfg, summary)
    out = capsys.readouterr().out
    assert f"outputs: {run}/ (config.yaml, metrics.jsonl, checkpoints/)" in out, out


def test_version_names_stapo_and_what_it_runs_on(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("stapo ") and "torch " in out and "vllm " in out, out


def test_recipes_are_listed_and_run_by_name(capsys, tmp_path, monkeypatch):
    """``stapo recipes`` lists the built-in recipes (installed with stapo) and, in a source checkout, the
    examples; ``stapo train NAME`` runs one from any directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny_cpu", "tiny_tir", "qwen3_8b_stapo"):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    assert "tiny_tir" in out.split("examples/recipes")[0]  # built in: under the package's folder
    assert main(["train", "tiny_tir", f"trainer.output_dir={tmp_path / 'run'}", "--dry-run", "--summary"]) == 0
    assert "tools: calculator (timeout_s=" in capsys.readouterr().out
    assert main(["train", "qwen3_8b_stapo.yaml", "--dry-run", "--summary", "--world-size", "8"]) == 0


def _run_dir(root: Path, steps: int, saved: int | None, total: int = 100) -> Path:
    """A run directory as the trainer leaves it: config.yaml, metrics.jsonl, a checkpoint with meta.json."""
    run = root / "run"
    STAPOConfig.from_yaml(builtin_recipe(), [f"trainer.output_dir={run}", f"trainer.total_steps={total}"]) \
        .to_yaml((run.mkdir(parents=True), run / "config.yaml")[1])
    rows = [{"step": 0, "eval_accuracy": 0.25}] + [{"step": s, "loss": 0.1, "reward_mean": 0.5, "accuracy": 0.75}
                                                   for s in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if saved is not None:
        step = run / "checkpoints" / f"step_{saved}"
        step.mkdir(parents=True)
        (step / "client_state.pt").write_bytes(b"")
        (step / "meta.json").write_text(json.dumps({"step": saved, "world_size": 8}))
        (run / "checkpoints" / "latest").write_text(step.name)
    return run


def test_status_says_where_a_run_is_and_how_to_resume_it(tmp_path, capsys):
    run = _run_dir(tmp_path, steps=42, saved=40)
    assert main(["status", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"run: {run}  (model builtin:tiny, mask stapo, 100 steps)"
    assert lines[1].startswith("progress: step 42 of 100, logged ") and lines[1].endswith(
        "reward_mean 0.5, accuracy 0.75")
    assert lines[2] == "held-out accuracy: 0.25 at step 0 -> 0.25 at step 0"
    assert lines[3].startswith(f"last checkpoint: {run}/checkpoints/step_40 (step 40, saved ") and \
        lines[3].endswith("1 kept), 8 rank(s)")
    assert lines[4] == (f"resume (once stopped): stapo train {run}/config.yaml on 8 ranks (a launcher with the same count) "
                        "(trainer.resume=auto continues step_40)")
    finished = _run_dir(tmp_path / "done", steps=100, saved=100)
    assert main(["status", str(finished)]) == 0
    assert f"finished; to train further: stapo train {finished}/config.yaml trainer.total_steps=N (N > 100)" in \
        capsys.readouterr().out
    fresh = _run_dir(tmp_path / "fresh", steps=0, saved=None)
    assert main(["status", str(fresh)]) == 0
    assert "last checkpoint: none" in capsys.readouterr().out
    assert main(["status", str(tmp_path)]) == 2
    assert "holds no config.yaml: not the output_dir of a stapo run" in capsys.readouterr().err
