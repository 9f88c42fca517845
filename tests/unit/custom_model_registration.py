"""A model of one's own, as `job.custom_import` loads it: importing this module registers it."""

from dataclasses import replace

from torchtitan.models import get_train_spec
from torchtitan.protocols import register_train_spec

_llama3 = get_train_spec("llama3")
register_train_spec(
    replace(_llama3, name="my_llama", flavors={"tiny": replace(_llama3.flavors["debugmodel"], n_layers=2)})
)
