"""`checkpoint.async_mode = "async_with_pinned_mem"`: the state is copied to host memory in the
background, and a save holds the weights of its own step however late that copy finishes."""

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from torchtitan.components import checkpoint_folders, checkpoint_staging
from torchtitan.components.checkpoint import CheckpointManager, TrainState
from torchtitan.config.manager import parse_args


class _LoaderStub:
    def state_dict(self) -> dict:
        return {"sample_index": 0}


class _GatedStager(checkpoint_staging.DefaultStager):
    """DCP's stager, holding each copy back until the test opens the gate."""

    gate = threading.Event()

    def _stage(self, state_dict, **kwargs):
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        return super()._stage(state_dict, **kwargs)


@pytest.fixture
def manager(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_staging, "DefaultStager", _GatedStager)
    _GatedStager.gate.clear()
    cfg = parse_args(["--job.dump_folder", str(tmp_path), "--checkpoint.enable",
                      "--checkpoint.async_mode", "async_with_pinned_mem"], env={})  # fmt: skip
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # creates the moments that are saved too
    manager = CheckpointManager(
        cfg, model, optimizer, scheduler, _LoaderStub(), dp_rank=0, dp_degree=1, device=torch.device("cpu")
    )
    yield manager
    _GatedStager.gate.set()
    manager.close()


def _saved_model(folder, like: dict) -> dict:
    state = {"model": {name: torch.zeros_like(value) for name, value in like.items()}}
    dcp.load(state, checkpoint_id=str(folder))
    return state["model"]


def test_the_save_returns_before_the_state_is_copied(manager):
    manager.save(TrainState(step=1))

    assert manager.host_staging.pending is not None and not manager.host_staging.pending.done()
    assert manager.pending is not None


def test_a_save_holds_its_own_steps_weights_when_the_next_step_waits_for_staging(manager):
    expected = {name: value.clone() for name, value in manager.model.state_dict().items()}
    manager.save(TrainState(step=1))

    # The copy starts only after the trainer has reached the next optimizer step.
    threading.Timer(0.2, _GatedStager.gate.set).start()
    manager.wait_for_staging()
    with torch.no_grad():
        for param in manager.model.parameters():
            param.add_(1.0)  # the next optimizer step
    manager.wait()

    saved = _saved_model(manager.folder / "step-1", expected)
    for name, value in expected.items():
        assert torch.equal(saved[name], value), name


def test_the_stager_and_its_host_buffers_are_reused_by_the_next_save(manager):
    _GatedStager.gate.set()
    manager.save(TrainState(step=1))
    first = manager.host_staging.stager
    manager.save(TrainState(step=2))  # waits for step 1's write first

    # Before torch 2.13 a used stager cannot copy again; there the second save gets a new one.
    assert (manager.host_staging.stager is first) == checkpoint_staging.STAGER_REUSABLE
    manager.wait()
    assert checkpoint_folders.complete_steps(manager.folder) == [1, 2]


def test_three_saves_in_a_row_each_hold_their_own_steps_weights(manager):
    _GatedStager.gate.set()
    expected = {}
    for step in (1, 2, 3):
        manager.save(TrainState(step=step))
        manager.wait_for_staging()
        expected[step] = {name: value.clone() for name, value in manager.model.state_dict().items()}
        with torch.no_grad():
            for param in manager.model.parameters():
                param.add_(1.0)
    manager.wait()

    for step, weights in expected.items():
        saved = _saved_model(manager.folder / f"step-{step}", weights)
        assert all(torch.equal(saved[name], value) for name, value in weights.items()), step


def test_wait_for_staging_returns_at_once_with_nothing_pending(manager):
    manager.wait_for_staging()
    assert manager.host_staging.pending is None and manager.host_staging.stager is None
