"""A model whose training steps take long, as `job.custom_import` loads it: importing this module
registers "slow_llama", Llama 3's debug model whose every step after the first ends with a sleep
of `$SLOW_STEP_SECONDS` (in its post-optimizer-step hook, a TrainSpec's own)."""

import os
import time
from dataclasses import replace

from torchtitan.models import get_train_spec
from torchtitan.protocols import register_train_spec

_steps_done = 0


def _sleep_after_the_first_step(model, dp_group) -> dict:
    global _steps_done
    _steps_done += 1
    if _steps_done > 1:
        time.sleep(float(os.environ.get("SLOW_STEP_SECONDS", "6")))
    return {}


register_train_spec(
    replace(get_train_spec("llama3"), name="slow_llama", post_optimizer_step_fn=_sleep_after_the_first_step)
)
