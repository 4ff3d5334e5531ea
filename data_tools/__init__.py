"""Offline data tools: converters (``prepare_*``), the preference cleaner, the demo task generator and
tokenizer training. Each is a module with an argparse CLI: ``python -m data_tools.<name> --help``."""
