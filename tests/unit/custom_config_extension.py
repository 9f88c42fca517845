"""Keys of one's own, in upstream torchtitan's style, as `job.custom_config_module` loads them."""

from dataclasses import dataclass, field
from typing import Literal

from torchtitan.config import opt


@dataclass
class Training:
    """Extends [training]: a key of its own, and a new default for one of the trainer's."""

    curriculum: Literal["none", "short_first"] = opt("none", "order each batch's sequences by length")
    steps: int = 7


@dataclass
class Probe:
    """A section of its own."""

    enable: bool = opt(False, "fit a linear probe on the hidden states")
    layers: list[int] = opt([0], "layers whose hidden states are probed")
    temperature: float = opt(1.0, "probe softmax temperature", gt=0)
    note: str | None = None


@dataclass
class JobConfig:
    training: Training = field(default_factory=Training)
    probe: Probe = field(default_factory=Probe)
