"""The profiler's trace schedule: windows on the `profiling.profile_freq` grid, resumed or not."""

import pytest
import torch

from torchtitan.components.profiling import maybe_profile
from torchtitan.config import parse_args


def _traced_iterations(tmp_path, first_step: int, last_step: int) -> list[int]:
    cfg = parse_args(
        ["--profiling.enable_profiling", "--profiling.profile_freq", "4", "--profiling.profiler_warmup", "1",
         "--profiling.profiler_active", "1", "--job.dump_folder", str(tmp_path)],
        env={},
    )  # fmt: skip
    with maybe_profile(cfg, rank=0, first_step=first_step) as profiler:
        for _ in range(first_step, last_step):
            torch.ones(4, 4) @ torch.ones(4, 4)
            profiler.step()
    folders = (tmp_path / cfg.profiling.save_traces_folder).iterdir()
    return sorted(int(f.name.removeprefix("iteration_")) for f in folders)


# 3 and 7: the resume's first step is a traced one, whose warm-up step ran before the resume.
@pytest.mark.parametrize("first_step", [0, 3, 5, 6, 7])
def test_traces_stay_on_the_profile_freq_grid_after_a_resume(tmp_path, first_step):
    assert _traced_iterations(tmp_path, first_step, 12) == [s for s in (4, 8, 12) if s > first_step]
