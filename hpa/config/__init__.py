"""Configuration: frozen dataclasses (``schema``), YAML + overrides (``load``), errors."""

from .errors import ConfigError, UserError
from .load import build, build_section, load_config, parse_overrides, write_resolved
from .schema import Config, validate

__all__ = ["Config", "ConfigError", "UserError", "build", "build_section", "load_config", "parse_overrides", "validate",
           "write_resolved"]
