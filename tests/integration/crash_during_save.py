"""A fault injected from outside the trainer, as `job.custom_import` loads it: the rank dies
(exit code 17) after writing its shards of the checkpoint of step `$CRASH_DURING_SAVE_STEP` and
before that checkpoint is published, as a preempted or crashed save would."""

import os

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.checkpoint_folders import step_of

CRASH_EXIT_CODE = 17
_publish = CheckpointManager._publish


def _crash_before_publishing(self, partial, final, *args, **kwargs):
    if str(step_of(final)) == os.environ.get("CRASH_DURING_SAVE_STEP"):
        os._exit(CRASH_EXIT_CODE)
    return _publish(self, partial, final, *args, **kwargs)


CheckpointManager._publish = _crash_before_publishing
