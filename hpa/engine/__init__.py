"""Running a Megatron model: forward-only passes with the pipeline broadcast (``forward``), the
pipeline-schedule step (``step``), optimizer and LR-scheduler set-up (``optimizer``)."""
