"""Config modules, command-line overrides and pre-flight checks."""

from muloco.config.loader import ConfigError, available_configs, derive, load_config

__all__ = ["ConfigError", "available_configs", "derive", "load_config"]
