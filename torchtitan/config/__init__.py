"""Config schema (`job_config`) and its loader (`manager`)."""

from torchtitan.config.job_config import ActivationCheckpoint, JobConfig
from torchtitan.config.manager import ConfigError, parse_args

__all__ = ["ActivationCheckpoint", "ConfigError", "JobConfig", "parse_args"]
