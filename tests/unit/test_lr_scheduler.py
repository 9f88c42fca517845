"""The warmup-stable-decay learning-rate schedule, as the optimizer sees it step by step."""

import pytest
import torch

from torchtitan.components.lr_scheduler import build_lr_scheduler, lr_factor
from torchtitan.config.manager import parse_args

PEAK = 1e-3


def _config(args: list[str]):
    """A config whose schedule keys are the defaults unless `args` sets them (the default
    config file, the Llama 3 debug model, has its own schedule)."""
    defaults = ["--lr_scheduler.decay_ratio", "none", "--lr_scheduler.decay_type", "linear",
                "--lr_scheduler.min_lr_factor", "0"]  # fmt: skip
    return parse_args(["--optimizer.lr", str(PEAK), *defaults, *args], env={})


def _lrs_used(args: list[str]) -> list[float]:
    """The lr of every optimizer step of a run, read the way the trainer reads it."""
    cfg = _config(args)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.optimizer.lr)
    scheduler = build_lr_scheduler(optimizer, cfg)
    used = []
    for _ in range(cfg.training.steps):
        optimizer.step()
        used.append(optimizer.param_groups[0]["lr"])
        assert scheduler.get_last_lr()[0] == used[-1]  # what the trainer logs
        scheduler.step()
    return used


def test_warmup_rises_linearly_and_reaches_the_peak_on_its_last_step():
    args = ["--training.steps", "10", "--lr_scheduler.warmup_steps", "3", "--lr_scheduler.decay_ratio", "0.5"]
    lrs = _lrs_used(args)
    assert lrs[:4] == pytest.approx([PEAK / 3, 2 * PEAK / 3, PEAK, PEAK])


def test_the_schedule_is_upstream_torchtitans_step_for_step():
    """10 steps, 2 of warmup, decay over the rest: the values upstream's scheduler gives."""
    lrs = _lrs_used(["--training.steps", "10", "--lr_scheduler.warmup_steps", "2"])
    assert lrs == pytest.approx([PEAK * f for f in (0.5, 1, 1, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125)])


def test_linear_decay_would_reach_min_lr_factor_one_step_after_the_last():
    args = [
        "--training.steps",
        "10",
        "--lr_scheduler.warmup_steps",
        "2",
        "--lr_scheduler.min_lr_factor",
        "0.1",
    ]
    lrs = _lrs_used(args)
    decay = lrs[2:]
    steps = [b - a for a, b in zip(decay, decay[1:])]
    assert steps == pytest.approx([steps[0]] * len(steps))
    assert steps[0] < 0
    assert lrs[-1] + steps[0] == pytest.approx(0.1 * PEAK)  # so the last step still learns


def test_decay_ratio_is_a_fraction_of_all_steps_as_upstream():
    lrs = _lrs_used(
        ["--training.steps", "12", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.5"]
    )
    # 6 of the 12 steps decay; the peak holds from step 2 to step 7.
    assert lrs[1:7] == pytest.approx([PEAK] * 6)
    assert lrs[6:] == pytest.approx([PEAK * (6 - k) / 6 for k in range(6)])


def test_total_steps_stops_a_run_early_on_the_full_runs_schedule():
    full = _lrs_used(["--training.steps", "10", "--lr_scheduler.warmup_steps", "2"])
    early = _lrs_used(
        ["--training.steps", "6", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.total_steps", "10"]
    )
    assert early == full[:6]


def test_a_run_past_total_steps_keeps_the_minimum_lr():
    args = ["--training.steps", "8", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.total_steps", "5",
            "--lr_scheduler.min_lr_factor", "0.1"]  # fmt: skip
    lrs = _lrs_used(args)
    # The decay leaves the peak after step 3 and reaches 0.1 at step 6 (the schedule's virtual
    # step past its last), where it stays.
    assert lrs[2:5] == pytest.approx([PEAK, 0.7 * PEAK, 0.4 * PEAK])
    assert lrs[5:] == pytest.approx([0.1 * PEAK] * 3)


def test_decay_ratio_is_a_fraction_of_total_steps_when_set():
    lrs = _lrs_used(["--training.steps", "12", "--lr_scheduler.warmup_steps", "2",
                     "--lr_scheduler.decay_ratio", "0.5", "--lr_scheduler.total_steps", "24"])  # fmt: skip
    assert lrs[1:] == pytest.approx([PEAK] * 11)  # the decay starts after step 12


def test_a_decay_ratio_longer_than_the_steps_after_warmup_is_cut_and_warned_about(caplog):
    args = ["--training.steps", "10", "--lr_scheduler.warmup_steps", "4", "--lr_scheduler.decay_ratio", "0.8"]
    lrs = _lrs_used(args)
    assert lrs[3:] == pytest.approx([PEAK, PEAK] + [PEAK * (6 - k) / 6 for k in range(1, 6)])  # as unset
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "'lr_scheduler.decay_ratio' = 0.8 asks for 8 decay steps, but only 6" in warning


def test_decay_ratio_zero_never_decays():
    lrs = _lrs_used(
        ["--training.steps", "6", "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.decay_ratio", "0"]
    )
    assert lrs[1:] == pytest.approx([PEAK] * 5)


@pytest.mark.parametrize("decay_type, halfway", [("linear", 0.5), ("sqrt", 1 - 0.5**0.5), ("cosine", 0.5)])
def test_decay_shapes_at_their_midpoint_and_quarter(decay_type, halfway):
    factor = lambda step: lr_factor(step, 0, 100, 100, decay_type, min_factor=0.2)  # noqa: E731
    assert factor(51) == pytest.approx(0.2 + 0.8 * halfway)
    quarter = {"linear": 0.75, "sqrt": 0.5, "cosine": 0.5 * (1 + 2**-0.5)}[decay_type]
    assert factor(26) == pytest.approx(0.2 + 0.8 * quarter)
    assert factor(101) == pytest.approx(0.2)


def test_warmup_longer_than_the_run_is_cut_to_the_run():
    lrs = _lrs_used(["--training.steps", "4", "--lr_scheduler.warmup_steps", "100"])
    assert lrs == pytest.approx([PEAK * k / 4 for k in range(1, 5)])


def test_a_run_that_is_all_warmup_is_warned_about_naming_both_keys(caplog):
    _lrs_used(["--training.steps", "20", "--lr_scheduler.warmup_steps", "20"])
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    message = warning.getMessage()
    assert "'lr_scheduler.warmup_steps' = 20" in message and "'training.steps' = 20" in message
    assert "--lr_scheduler.warmup_steps 2" in message


def test_a_run_with_steps_after_warmup_gets_no_warmup_warning(caplog):
    _lrs_used(["--training.steps", "5", "--lr_scheduler.warmup_steps", "4"])
    assert not [r for r in caplog.records if "warmup" in r.getMessage()]


def test_a_scheduler_restored_from_its_state_continues_the_same_schedule():
    cfg = _config(["--training.steps", "10", "--lr_scheduler.warmup_steps", "3"])

    def fresh():
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=PEAK)
        return optimizer, build_lr_scheduler(optimizer, cfg)

    optimizer, scheduler = fresh()
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    want = []
    for _ in range(6):
        want.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()

    optimizer, resumed = fresh()
    resumed.load_state_dict(state)
    got = []
    for _ in range(6):
        got.append(resumed.get_last_lr()[0])
        optimizer.step()
        resumed.step()
    assert got == pytest.approx(want)
