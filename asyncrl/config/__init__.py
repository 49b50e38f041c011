"""The run config shared by every asyncrl component (see :mod:`asyncrl.config.loader`)."""

from asyncrl.config.loader import ConfigError, load_config, read_config_file
from asyncrl.config.run_config import DerivedNumbers, RunConfig
from asyncrl.config.secrets import revealed_document, secret

__all__ = ["ConfigError", "DerivedNumbers", "RunConfig", "load_config", "read_config_file", "revealed_document", "secret"]
