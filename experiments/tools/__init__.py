"""The re-drawn task sweeps: ``python -m experiments.tools.redraw_sweep`` and
``python -m experiments.tools.redraw_ablation``."""
