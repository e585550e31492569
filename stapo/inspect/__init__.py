"""Spurious-token inspector: per-token statistics recorded during training (``inspect.record_every=N``),
analysed offline by ``inspect_run(RUN_DIR)``: the paper's diagnostics (§3.2, Fig. 2, Fig. 6, App. C) on your
own runs (docs/inspector.md). Names resolve lazily so the trainer's recording path (``write_token_record``,
``build_token_record``) does not import matplotlib.

May import: ``stapo.plots``, ``stapo.run_dir`` and the rest below them (docs/index.md, "Layout");
the trainer imports the recording half, so never the trainer.
"""

from stapo.registry import lazy_attributes

_MODULES = {
    "stapo.inspect.analysis": (
        "CLASS_NAMES", "SPURIOUS_CLASS", "ClassStat", "display_token", "grad_norm_by_class",
        "grad_norm_proxy", "silenced_ratio_from_records", "silenced_ratio_over_training",
        "spurious_mask", "token_classes", "token_frequencies", "WEIGHT_CLASSES", "WeightClassStat",
        "weight_classes"),
    "stapo.inspect.collect": ("build_token_record",),
    "stapo.inspect.figures": ("plot_grad_norm_by_class", "plot_prob_entropy_plane",
                              "plot_silenced_ratio", "plot_token_frequencies"),
    "stapo.inspect.records": ("RecordRow", "TokenRecord", "load_records", "read_token_record",
                              "write_token_record"),
    "stapo.inspect.report": ("grad_norm_table_markdown", "inspect_run", "weight_table_markdown"),
    "stapo.inspect.tables": ("SilencedToken", "silenced_table_html", "silenced_table_markdown",
                             "silenced_token_table"),
}
__all__ = sorted(name for names in _MODULES.values() for name in names)

__getattr__ = lazy_attributes("stapo.inspect", _MODULES)


def __dir__() -> list[str]:
    return __all__
