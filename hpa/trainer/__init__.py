"""The HPA training loop and its machinery (optimizer, pipeline-schedule step, checkpoints)."""
