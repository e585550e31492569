"""What can be named in a config: ``stapo masks``, ``stapo tools`` and ``stapo recipes``."""

from __future__ import annotations

import argparse
import dataclasses

from stapo.cli.common import load_config, load_user_modules, recipe_dirs, recipes


def _listed(params: dict) -> str:
    return ", ".join(f"{k}={'<required>' if v is dataclasses.MISSING else repr(v)}" for k, v in params.items())


def cmd_masks(args: argparse.Namespace) -> int:
    load_user_modules(args.imports)
    from stapo.losses import describe_masks

    for info in describe_masks():
        print(f"{info.name:<24} {info.summary}")
        print(f"{'':<24} params: {_listed(info.params) or '(none)'}")
    return 0


def cmd_tools(args: argparse.Namespace) -> int:
    """Each tool with the parameters training gives it under CONFIG (``rollout.tools.*``, then its own
    ``rollout.tools.params``), the sandbox the python tool gets here, and the tool-call parsers."""
    load_user_modules(args.imports)
    cfg = load_config(args.config, args.overrides)
    from stapo.tools import describe_tool_parsers, describe_tools, sandbox_report

    tools = cfg.rollout.tools
    print(f"tools with the values training uses (rollout.tools.*; {'on' if tools.enabled else 'off'} in this config):")
    for info in describe_tools():
        schema = info.obj.parameters
        arguments = ", ".join(f"{k} ({v.get('type', 'any')}{', required' if k in schema.get('required', ()) else ''})"
                              for k, v in schema.get("properties", {}).items())
        settings, notes = tools.settings_of(info.name)
        print(f"{info.name:<16} {info.summary}")
        print(f"{'':<16} arguments: {arguments or '(none)'}")
        print(f"{'':<16} params: {_listed({**info.params, **settings}) or '(none)'}")
        for note in notes:
            print(f"{'':<16} note: {note}")
    print(f"\n{sandbox_report()}")  # what the python tool's sandbox gets on this machine
    print("\ntool-call parsers:")
    for info in describe_tool_parsers():
        print(f"{info.name:<16} {info.summary}")
        print(f"{'':<16} stop: {', '.join(map(repr, info.obj.stop)) or '(none)'}")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    """Every recipe ``stapo train NAME`` finds, by folder, with the first line of its header comment."""
    listed = recipes()
    for folder in recipe_dirs():
        print(f"{folder}:")
        for name, path in listed.items():
            if path.parent == folder:
                comments = [line.lstrip("# ").strip() for line in path.read_text(encoding="utf-8").splitlines()
                            if line.startswith("#")]
                header = next((line for line in comments if line), "")
                print(f"  {name:<32} {header[:100]}")
    return 0


def add_catalog_parsers(sub) -> None:
    masks = sub.add_parser("masks", help="list registered token masks and their parameters")
    masks.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE",
                       help="Python file to import first (registers user masks)")
    masks.set_defaults(func=cmd_masks)

    tools = sub.add_parser("tools", help="list registered tools with the parameters training gives them, what "
                                         "the python sandbox gets on this machine, and the tool-call parsers",
                           description="Tools with the parameters training gives them under CONFIG "
                                       "(rollout.tools.*; default: the built-in tiny recipe).")
    tools.add_argument("config", nargs="?", help="YAML recipe or recipe name (default: the built-in tiny recipe)")
    tools.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.tools.timeout_s=30")
    tools.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE",
                       help="Python file to import first (registers user tools)")
    tools.set_defaults(func=cmd_tools)

    listing = sub.add_parser("recipes", help="list the recipes `stapo train NAME` runs by name")
    listing.set_defaults(func=cmd_recipes)
