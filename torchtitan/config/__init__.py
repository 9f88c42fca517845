"""Config schema (`job_config`), its loader (`manager`) and its checks (`validation`)."""

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import ActivationCheckpoint, JobConfig, opt
from torchtitan.config.manager import parse_args

__all__ = ["ActivationCheckpoint", "ConfigError", "JobConfig", "opt", "parse_args"]
