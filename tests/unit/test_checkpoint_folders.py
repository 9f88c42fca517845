"""Checkpoint folders: which survive keep_latest_k, and when an async save becomes visible."""

import logging
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.components.checkpoint import CheckpointManager, TrainState
from torchtitan.components.checkpoint_folders import (
    BackgroundFileWork,
    complete_steps,
    delete_folders,
    hf_export_named_by,
    prune_checkpoints,
    step_folder,
    step_of,
)
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args


def _save(folder, step: int, resumable: bool = True, suffix: str = "") -> None:
    state = {"model": {"weight": torch.full((2,), float(step))}}
    if resumable:
        state["train_state"] = {"step": step}
    dcp.save(state, checkpoint_id=str(folder / f"step-{step}{suffix}"))


def test_background_file_work_runs_in_order_and_outlives_a_failing_job(tmp_path, caplog):
    done = []
    work = BackgroundFileWork()
    work.submit(lambda: done.append(1))
    work.submit(lambda: (tmp_path / "missing").rename(tmp_path / "x"))  # raises FileNotFoundError
    work.submit(lambda: done.append(2))
    with caplog.at_level(logging.WARNING):
        work.wait()
    assert done == [1, 2]
    assert "background failed: FileNotFoundError" in caplog.text


def _prune(folder, keep: int) -> None:
    delete_folders(prune_checkpoints(folder, keep))


def test_keeps_the_k_newest_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        _save(tmp_path, step)
    _prune(tmp_path, keep=2)
    assert complete_steps(tmp_path) == [6, 8]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-6", "step-8"]


def test_pruning_only_renames_the_checkpoints_it_drops_leaving_the_deleting_to_the_caller(tmp_path):
    """Deleting a large checkpoint takes minutes; the rename is instant, and a resume never reads
    a renamed folder, so a kill before or during the deletion leaves no half checkpoint."""
    for step in (2, 4, 6):
        _save(tmp_path, step)
    doomed = prune_checkpoints(tmp_path, keep=1)
    assert complete_steps(tmp_path) == [6]
    assert [p.name.split(".deleting-")[0] for p in sorted(doomed)] == ["step-2", "step-4"]
    assert all((p / ".metadata").is_file() for p in doomed)  # still there, renamed


def test_a_damaged_old_checkpoint_is_kept_aside_neither_counted_as_resumable_nor_deleted(tmp_path):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    (tmp_path / "step-4" / ".metadata").write_bytes(b"")  # unreadable: neither resumable nor an error
    _save(tmp_path, 6, resumable=False)
    _prune(tmp_path, keep=1)
    assert complete_steps(tmp_path) == [2, 6]
    assert (tmp_path / "step-4.unreadable" / "__0_0.distcp").is_file()


def test_folders_a_killed_run_left_undeleted_are_deleted_at_the_next_prune(tmp_path):
    for step in (2, 4):
        _save(tmp_path, step)
    prune_checkpoints(tmp_path, keep=1)  # step-2 renamed, then the run is killed
    _save(tmp_path, 6)
    _prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-6"]


def test_a_model_only_final_save_does_not_push_out_the_last_resumable_checkpoint(tmp_path):
    for step in (2, 4):
        _save(tmp_path, step)
    _save(tmp_path, 5, resumable=False)  # last_save_model_only
    _prune(tmp_path, keep=1)
    assert complete_steps(tmp_path) == [4, 5]


def test_zero_keeps_every_checkpoint(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step)
    _prune(tmp_path, keep=0)
    assert complete_steps(tmp_path) == [2, 4, 6]


def test_an_unfinished_save_is_neither_counted_nor_removed(tmp_path):
    for step in (2, 4):
        _save(tmp_path, step)
    (tmp_path / "step-6.partial").mkdir()
    _prune(tmp_path, keep=1)
    assert complete_steps(tmp_path) == [4]
    assert (tmp_path / "step-6.partial").is_dir()


def test_a_save_a_crash_interrupted_is_removed_once_a_newer_checkpoint_completes(tmp_path):
    _save(tmp_path, 2, suffix=".partial")  # the crashed run's save
    for step in (4, 6):
        _save(tmp_path, step)
    _prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6"]


class FakeFuture:
    """An async save's future that finishes when the test says so."""

    def __init__(self):
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def result(self) -> None:
        assert self.finished, "wait() would block here"


def _manager_with_pending_save(tmp_path, step: int) -> tuple[CheckpointManager, FakeFuture]:
    cfg = parse_args(["--job.dump_folder", str(tmp_path), "--checkpoint.enable",
                      "--checkpoint.async_mode", "async"], env={})  # fmt: skip
    manager = CheckpointManager(
        cfg, None, None, None, None, dp_rank=0, dp_degree=1, device=torch.device("cpu")
    )
    _save(manager.folder, step, suffix=".partial")  # what dcp.async_save has written
    future = FakeFuture()
    final = manager.folder / f"step-{step}"
    manager.pending = (future, final.with_name(f"step-{step}.partial"), final, time.perf_counter())
    return manager, future


def test_an_async_save_stays_invisible_while_it_is_being_written(tmp_path):
    manager, _ = _manager_with_pending_save(tmp_path, step=5)
    manager.poll()
    assert complete_steps(manager.folder) == []


def test_a_finished_async_save_becomes_visible_at_the_next_poll(tmp_path):
    manager, future = _manager_with_pending_save(tmp_path, step=5)
    future.finished = True
    manager.poll()
    assert complete_steps(manager.folder) == [5]
    assert manager.pending is None


def _manager(tmp_path, *argv: str) -> CheckpointManager:
    cfg = parse_args(["--job.dump_folder", str(tmp_path), "--checkpoint.enable", *argv], env={})
    return CheckpointManager(cfg, None, None, None, None, dp_rank=0, dp_degree=1, device=torch.device("cpu"))


def _load_folders_only(manager: CheckpointManager, restarts_at_step_0: bool = False) -> list[str]:
    """What `load` resumes from (the state itself is not read: no model here). The step comes
    from the folder's name, as from its train_state, or is 0 for a load that restarts the count
    (a model-only checkpoint, or train_state excluded)."""
    loaded = []

    def load_full(folder, train_state):
        loaded.append(folder.name)
        train_state.step = 0 if restarts_at_step_0 else int(folder.name.removeprefix("step-"))

    manager._load_full = load_full
    manager.load(TrainState())
    return loaded


def test_a_rollback_sets_the_newer_checkpoints_aside_so_they_neither_resume_nor_outlive_its_own(tmp_path):
    manager = _manager(tmp_path, "--checkpoint.load_step", "10")
    for step in (10, 20, 30):
        _save(manager.folder, step)

    assert _load_folders_only(manager) == ["step-10"]

    assert complete_steps(manager.folder) == [10]
    assert sorted(p.name for p in manager.folder.iterdir()) == [
        "step-10",
        "step-20.superseded",
        "step-30.superseded",
    ]


def test_a_plain_resume_keeps_a_newer_model_only_export_and_says_why_it_is_passed_over(tmp_path, caplog):
    manager = _manager(tmp_path)
    _save(manager.folder, 10)
    _save(manager.folder, 12, resumable=False)  # last_save_model_only

    with caplog.at_level(logging.INFO, logger="torchtitan.components.checkpoint"):
        assert _load_folders_only(manager) == ["step-10"]

    assert complete_steps(manager.folder) == [10, 12]
    assert "Newer step-N folders [12] are model-only exports" in caplog.text


def test_a_folder_of_model_only_exports_is_refused_rather_than_restarted_from_step_0(tmp_path):
    manager = _manager(tmp_path)
    _save(manager.folder, 4, resumable=False)  # a finished run's last_save_model_only export

    with pytest.raises(ConfigError, match=r"only model-only checkpoints \(steps \[4\].*initial_load_path = "
                       r"'.*step-4'.*last_save_model_only = false"):  # fmt: skip
        manager.load(TrainState())


def test_a_seed_checkpoint_alone_is_loaded(tmp_path):
    manager = _manager(tmp_path)
    _save(manager.folder, 0, resumable=False)  # create_seed_checkpoint

    assert _load_folders_only(manager, restarts_at_step_0=True) == ["step-0"]


def test_a_load_that_restarts_the_step_count_sets_the_newer_checkpoints_aside_at_its_first_save(tmp_path):
    manager = _manager(tmp_path, "--checkpoint.exclude_from_loading", "train_state")
    for step in (3, 6):
        _save(manager.folder, step)

    assert _load_folders_only(manager, restarts_at_step_0=True) == ["step-6"]
    # A crash before this run's first save must find what it loaded: the relaunch loads it again.
    assert complete_steps(manager.folder) == [3, 6]

    _save(manager.folder, 1, suffix=".partial")
    manager._publish(manager.folder / "step-1.partial", manager.folder / "step-1", start=0.0)

    assert complete_steps(manager.folder) == [1]
    assert sorted(p.name for p in manager.folder.iterdir()) == [
        "step-1",
        "step-3.superseded",
        "step-6.superseded",
    ]


def test_a_rollback_that_restarts_the_step_count_sets_aside_the_newer_checkpoints_at_once(tmp_path):
    manager = _manager(
        tmp_path, "--checkpoint.load_step", "3", "--checkpoint.exclude_from_loading", "train_state"
    )
    for step in (3, 6):
        _save(manager.folder, step)

    assert _load_folders_only(manager, restarts_at_step_0=True) == ["step-3"]

    assert complete_steps(manager.folder) == [3]  # 6 would be the relaunch's newest otherwise


def test_a_folder_of_hf_exports_only_is_refused_rather_than_restarted_from_random_weights(tmp_path):
    manager = _manager(tmp_path)
    (manager.folder / "step-2-hf").mkdir(parents=True)  # a finished run's last_save_in_hf export

    with pytest.raises(ConfigError, match=r"only Hugging Face exports \(steps \[2\].*initial_load_path = "
                       r"'.*step-2-hf' and checkpoint.initial_load_in_hf = true"):  # fmt: skip
        manager.load(TrainState())


def test_a_folder_of_exports_only_is_passed_over_when_the_run_names_its_initial_load_path(tmp_path):
    manager = _manager(tmp_path, "--checkpoint.initial_load_path", str(tmp_path / "elsewhere"))
    (manager.folder / "step-2-hf").mkdir(parents=True)
    _save(manager.folder, 2, resumable=False)  # a last_save_model_only export

    assert manager.resume_step() is None


def test_a_step_n_path_names_the_step_n_hf_export_beside_it(tmp_path):
    export = tmp_path / "step-10-hf"
    export.mkdir()
    assert hf_export_named_by(tmp_path / "step-10") == export
    (tmp_path / "step-10").mkdir()  # a DCP checkpoint of the same step
    assert hf_export_named_by(tmp_path / "step-10") == export


def test_a_path_that_holds_safetensors_or_names_no_export_is_itself(tmp_path):
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / "model.safetensors").write_bytes(b"")
    (tmp_path / "step-3-hf").mkdir()
    assert hf_export_named_by(tmp_path / "step-3") == tmp_path / "step-3"
    assert hf_export_named_by(tmp_path / "step-4") == tmp_path / "step-4"
    assert hf_export_named_by(tmp_path / "weights") == tmp_path / "weights"


def test_a_checkpoint_folder_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "checkpoint").write_text("")
    with pytest.raises(ConfigError, match=r"checkpoint folder '.*checkpoint' .* is a file"):
        _manager(tmp_path)


def test_a_save_of_an_existing_step_replaces_the_folder_whole_and_returns_the_old_one_to_delete(tmp_path):
    from torchtitan.components.checkpoint_folders import replace_folder

    _save(tmp_path, 5)
    _save(tmp_path, 6, suffix=".partial")  # the new save's content, written as step-5's
    (tmp_path / "step-6.partial").rename(tmp_path / "step-5.partial")

    (old,) = replace_folder(tmp_path / "step-5", tmp_path / "step-5.partial")

    assert old.name.startswith("step-5.deleting-") and complete_steps(tmp_path) == [5]
    delete_folders([old])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]
    state = {"model": {"weight": torch.zeros(2)}}
    dcp.load(state, checkpoint_id=str(tmp_path / "step-5"))
    assert state["model"]["weight"].tolist() == [6.0, 6.0]


@pytest.mark.parametrize("hf", [False, True], ids=["dcp", "hf export"])
def test_a_step_folder_name_parses_back_to_its_step(tmp_path, hf):
    folder = step_folder(tmp_path, 1200, hf=hf)

    assert folder.name == ("step-1200-hf" if hf else "step-1200")
    assert step_of(folder) == 1200


def test_a_folder_that_is_no_step_checkpoint_has_no_step(tmp_path):
    with pytest.raises(ValueError, match="step-12.partial is not a step-N checkpoint folder"):
        step_of(tmp_path / "step-12.partial")


def test_a_step_folder_without_metadata_is_kept_aside_and_the_resume_takes_the_newest_complete_one(
    tmp_path, caplog
):
    manager = _manager(tmp_path)
    for step in (2, 4):
        _save(manager.folder, step)
    (manager.folder / "step-4" / ".metadata").unlink()

    with caplog.at_level(logging.WARNING):
        assert _load_folders_only(manager) == ["step-2"]

    assert sorted(p.name for p in manager.folder.iterdir()) == ["step-2", "step-4.incomplete"]
    assert (manager.folder / "step-4.incomplete" / "__0_0.distcp").is_file()
    assert "step-4 (step 4) is not usable: it has no .metadata" in caplog.text
    assert caplog.text.count("is not usable") == 1


def test_a_load_only_run_leaves_an_incomplete_step_folder_where_it_is(tmp_path, caplog):
    manager = _manager(tmp_path, "--checkpoint.load_only")
    for step in (2, 4):
        _save(manager.folder, step)
    (manager.folder / "step-4" / ".metadata").unlink()

    with caplog.at_level(logging.WARNING):
        assert _load_folders_only(manager) == ["step-2"]

    assert sorted(p.name for p in manager.folder.iterdir()) == ["step-2", "step-4"]
    assert "step-4 has no .metadata: not resumed from" in caplog.text


def test_a_save_over_a_step_folder_without_metadata_keeps_the_old_folder(tmp_path):
    from torchtitan.components.checkpoint_folders import replace_folder

    _save(tmp_path, 5)
    (tmp_path / "step-5" / ".metadata").unlink()
    _save(tmp_path, 5, suffix=".partial")

    assert replace_folder(tmp_path / "step-5", tmp_path / "step-5.partial") == []

    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5", "step-5.incomplete"]
    assert (tmp_path / "step-5.incomplete" / "__0_0.distcp").is_file()


def test_a_second_incomplete_folder_of_the_same_step_gets_a_name_of_its_own(tmp_path):
    from torchtitan.components.checkpoint_folders import keep_incomplete_aside

    (tmp_path / "step-3.incomplete").mkdir()
    (tmp_path / "step-3").mkdir()

    assert keep_incomplete_aside(tmp_path) == [3]

    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0] == "step-3.incomplete" and names[1].startswith("step-3.incomplete-") and len(names) == 2
