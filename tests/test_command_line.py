"""The ``stapo`` command line and the recipes it runs."""

from __future__ import annotations

import subprocess
import sys
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


def test_masks_lists_builtins_and_a_user_registered_mask(tmp_path, capsys):
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


def test_help_works_for_every_command():
    for command in ([], ["train"], ["masks"], ["tools"], ["eval"], ["inspect"]):
        proc = subprocess.run([sys.executable, "-m", "stapo.cli", *command, "--help"], capture_output=True, text=True)
        assert proc.returncode == 0 and "usage: stapo" in proc.stdout, proc.stderr


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
