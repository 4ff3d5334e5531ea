"""hpa: Hybrid Preference Alignment on megatron-core."""

__version__ = "0.1.0"
