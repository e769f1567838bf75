"""Application settings: shared defaults merged with local overrides."""

from appcfg.client import http_client_options
from appcfg.loader import load_config

__all__ = ["http_client_options", "load_config"]
