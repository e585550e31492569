"""Docs cannot drift: included snippets equal their files, every page is linked from the index, and the
metrics and config keys they name are ones the code logs and reads."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
INCLUDE = re.compile(r"<!-- include: (?P<path>\S+) -->\n```\w*\n(?P<body>.*?)```", re.S)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_included_snippets_match_their_files(page):
    for match in INCLUDE.finditer(page.read_text(encoding="utf-8")):
        source = ROOT / match["path"]
        assert source.is_file(), f"{page.name} includes missing {match['path']}"
        assert match["body"] == source.read_text(encoding="utf-8"), (
            f"{page.name}: the snippet of {match['path']} is stale; paste the file again")


def test_every_page_is_linked_from_the_index():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    missing = [p.name for p in DOCS if p.name != "index.md" and f"({p.name}" not in index]
    assert not missing, f"docs/index.md does not link {missing}"


# ---- names the docs use: metrics the code logs, config keys that exist -----------------------------------

PAGES = [ROOT / "README.md", *DOCS]
#: Backticked snake_case names shaped like a metric; each must be one the trainer logs, or a name the code
#: defines (a function, a field, a dict key: ``mismatch_sums``'s ``mismatch_abs_sum``, a tool's ``memory_mb``).
METRIC_SHAPED = re.compile(r"^(eval_|time_|tokens_per_s|mismatch_|mfu_|groups_|sampling_|policy_staleness|rollout_is_"
                           r"|sync_|tool_|rejected_|entropy_bonus)|_(frac|mean|max|min|std|ppl|accuracy)$")
#: Dotted names the docs use that are Python attributes (weight names, methods), not config keys.
NOT_CONFIG_KEYS = ("model.layers", "model.embed_tokens", "model.load_weights", "mask.apply", "trainer.step")


def _backticked(pages, pattern: str):
    """``(name, "page:line")`` for every match of ``pattern`` inside an inline code span of ``pages``."""
    for page in pages:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for span in re.findall(r"`([^`]+)`", line):
                for name in re.findall(pattern, span):
                    yield name, f"{page.relative_to(ROOT)}:{number}"


def _code_names() -> set[str]:
    """Names stapo's code defines or uses: identifiers, attributes, arguments and the words of string literals,
    docstrings left out (a docstring can be as stale as a doc page: ``eval_accuracy_no_tools`` was one)."""
    names = set()
    for path in (ROOT / "stapo").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                names.update(re.findall(r"[a-z][a-z0-9_]*", node.value))
            else:
                names.update(v for k in ("id", "attr", "name", "arg") if isinstance(v := getattr(node, k, None), str))
    return names


def test_every_metric_the_docs_name_is_one_the_code_logs():
    from stapo.telemetry.metrics import OPTIONAL_METRIC_KEYS, STEP_METRIC_KEYS

    logged, code = set(STEP_METRIC_KEYS) | set(OPTIONAL_METRIC_KEYS), _code_names()
    wrong = sorted({f"{where}: `{name}`" for name, where in _backticked(PAGES, r"^[a-z][a-z0-9_]*$")
                    if METRIC_SHAPED.search(name) and name not in logged and name not in code})
    assert not wrong, "the docs name metrics the trainer never logs (stapo/telemetry/metrics.py):\n" + "\n".join(wrong)


def test_every_config_key_the_docs_name_exists():
    from stapo.config import STAPOConfig

    def keys(section, prefix=""):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            yield from keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else \
                [(prefix + f.name, isinstance(value, dict))]
        yield from ((prefix + old, False) for old in getattr(section, "REMOVED_KEYS", {}))  # named as removed

    fields = dict(keys(STAPOConfig()))
    sections = "|".join(f.name for f in dataclasses.fields(STAPOConfig))
    recipes = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))
    found = list(_backticked(PAGES, rf"(?<![\w./-])((?:{sections})(?:\.[a-z_][a-z0-9_]*)+)"))
    found += [(name, f"{r.relative_to(ROOT)}:{n}") for r in recipes
              for n, line in enumerate(r.read_text(encoding="utf-8").splitlines(), 1) if line.lstrip().startswith("#")
              for name in re.findall(rf"(?<![\w./-])((?:{sections})(?:\.[a-z_][a-z0-9_]*)+)", line)]
    wrong = sorted({f"{where}: `{name}`" for name, where in found
                    if name not in fields and not name.startswith(NOT_CONFIG_KEYS)
                    and not any(name.startswith(k + ".") for k, is_dict in fields.items() if is_dict)  # mask.params.x
                    and not any(k.startswith(name + ".") for k in fields)})  # a section: model.lora
    assert not wrong, "the docs name config keys that do not exist (docs/configuration.md):\n" + "\n".join(wrong)
