"""``python -m hpa.train`` / ``torchrun ... -m hpa.train --config X [overrides]``: HPA training."""

from __future__ import annotations

import sys

from hpa.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
