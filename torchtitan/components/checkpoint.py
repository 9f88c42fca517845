"""Distributed checkpoints (`[checkpoint]`) with torch.distributed.checkpoint (DCP).

A checkpoint is the folder `<dump_folder>/<checkpoint.folder>/step-N`, holding:

    model        the model's state dict (FSDP/TP shards as DTensors; resharded on load;
                 expert-parallel slices as DTensors of the whole expert weights)
    optimizer    the optimizer's state dict, keyed by parameter FQN (experts as in model)
    lr_scheduler the scheduler's state dict
    dataloader   each data-parallel rank's loader state, under `dp<rank>`
    train_state  step, tokens seen, the data-parallel layout, and each rank's RNG states

Pitfalls:
    * Visibility is atomic: DCP writes into `step-N.partial`, and only once every rank has
      finished does rank 0 rename it to `step-N`. A save that dies midway leaves a `.partial`
      folder that resume ignores (and the next save of that step replaces).
    * The checkpoint folder must be on storage every rank sees (a shared filesystem on clusters).
    * `async_with_pinned_mem` copies the state to host memory in the background while the next
      step's forward and backward run, so the trainer must call `wait_for_staging` before
      anything changes the saved tensors in place (the optimizer step); otherwise the checkpoint
      would mix this step's weights with the next one's.
    * A data position moves to another data-parallel layout only for packed (local) datasets,
      whose position is global; a streaming dataset's position is refused across layouts.
"""

import datetime
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtitan.components.checkpoint_checksums import ChecksummedWriter, verify_before_load
from torchtitan.components.checkpoint_data_position import restore_data_position, saved_data_position
from torchtitan.components.checkpoint_folders import (
    PARTIAL_SUFFIX,
    RESUME_KEY,
    BackgroundFileWork,
    complete_steps,
    delete_folders,
    hf_export_named_by,
    is_dcp,
    load_from,
    prune_checkpoints,
    read_metadata,
    replace_folder,
    saved_keys,
    saved_shapes,
    step_folder,
    step_of,
)
from torchtitan.components.checkpoint_hf_export import (
    check_exportable,
    in_export_dtype,
)
from torchtitan.components.checkpoint_resume import (
    choose_resume_step,
    rename_newer_than,
    use_the_schedulers_lr,
)
from torchtitan.components.checkpoint_staging import HostStaging
from torchtitan.components.hf_distributed_export import write_hf_export_from_all_ranks
from torchtitan.components.hf_load import load_hf_checkpoint
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import CHECKPOINT_STATE_KEYS as STATE_KEYS
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.expert_parallel import (
    expert_parallel_params,
    global_expert_view,
)
from torchtitan.distributed.rank_agreement import agree_on_config_errors
from torchtitan.protocols.state_dict_adapter import describe_mismatch

logger = logging.getLogger(__name__)


def why_nothing_is_saved(config: JobConfig) -> str | None:
    """The key that keeps this run from saving checkpoints, as a log message names it; None
    when it saves them."""
    if not config.checkpoint.enable:
        return "'checkpoint.enable' = false"
    if config.checkpoint.load_only:
        return "'checkpoint.load_only' = true"
    return None


@dataclass
class TrainState:
    """What the trainer needs besides model, optimizer, scheduler and data to continue exactly."""

    step: int = 0
    tokens_seen: int = 0
    dp_degree: int = 1
    local_batch_size: int = 1
    rng: dict = field(default_factory=dict)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# The longest the other ranks wait for rank 0's file work (a Hugging Face export, renames):
# the training timeout (comm.train_timeout_seconds) is far shorter than writing a large model.
RANK0_FILE_WORK_TIMEOUT_SECONDS = 3600


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device.type).get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "device" in state and device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(state["device"], device)


def _is_moment(value) -> bool:
    """An optimizer state shaped like its parameter (not a scalar such as Adam's step)."""
    return isinstance(value, torch.Tensor) and value.ndim > 0


def with_own_params(loaded_groups: list[dict], own_groups: list[dict]) -> list[dict]:
    """This rank's param groups (their parameter names) with the checkpoint's hyperparameters.

    Why: DCP stores the optimizer's param groups once, as one rank saved them, with that rank's
    parameter names. Where ranks hold different parameters (pipeline stages), or the saving
    layout had other ranks, the stored names are not this rank's. The groups are built alike in
    every layout, so group i's hyperparameters apply; where the counts differ (a stage without
    experts has no expert group), this rank's own groups are kept.
    """
    if len(loaded_groups) != len(own_groups):
        return own_groups
    return [{**loaded, "params": own["params"]} for loaded, own in zip(loaded_groups, own_groups)]


def per_group_lists_fitted(scheduler_state: dict, groups: int) -> dict:
    """The LR scheduler's per-param-group lists (`base_lrs`, `_last_lr`, `lr_lambdas`) cut or
    repeated to `groups` entries.

    Why: DCP stores the scheduler once, as one rank saved it. Every group follows the same
    schedule here, but ranks may hold different numbers of groups: a pipeline stage without
    MoE blocks has no expert group.
    """
    fitted = dict(scheduler_state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        values = fitted.get(key)
        if isinstance(values, list) and values and len(values) != groups:
            fitted[key] = (values * groups)[:groups]
    return fitted


class CheckpointManager:
    """Saves and resumes the training state under `[checkpoint]`.

    Args:
        job_config: the run's config.
        model, optimizer, lr_scheduler: what the trainer built (parallelized model).
        dataloader: the training `StatefulDataLoader`.
        dp_rank, dp_degree: this rank's data-parallel index and the data-parallel size.
        device: the training device (its RNG state is saved).
        hf_adapter: the model's `StateDictAdapter` instance, for `initial_load_in_hf` and
            `last_save_in_hf`; None when the model has none.
        whole_model_shapes: {state-dict key: shape} of the whole model, when `model` holds only
            part of it (this rank's pipeline stages), so that a load checks the checkpoint
            against the whole model; None: `model`'s own.
        pp_group: under pipeline parallelism, the pipeline's ranks, over which a Hugging Face
            export collects the stages; None otherwise.
    """

    def __init__(self, job_config: JobConfig, model, optimizer, lr_scheduler, dataloader, *, dp_rank: int,
                 dp_degree: int, device: torch.device, hf_adapter=None, whole_model_shapes=None,
                 pp_group=None):  # fmt: skip
        self.config = c = job_config.checkpoint
        self.job_config = job_config
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dataloader, self.dp_rank, self.dp_degree = dataloader, dp_rank, dp_degree
        self.device, self.hf_adapter = device, hf_adapter
        self.whole_model_shapes, self.pp_group = whole_model_shapes, pp_group
        self.folder = Path(job_config.job.dump_folder) / c.folder
        self.pending = None  # (future, partial folder, final folder) of an async save
        self.resumable_step: int | None = None  # the step of the last full checkpoint saved or loaded
        self.set_aside_after_first_save = False  # see `load`
        self.host_staging = HostStaging(device)  # async_with_pinned_mem's copies to host memory
        self._check(job_config)
        if c.enable and c.load_only:
            logger.info(f"Checkpoints: loading from {self.folder} as on a resume, saving none (load_only)")
        elif c.enable:
            keep = f"the newest {c.keep_latest_k} kept" if c.keep_latest_k > 0 else "all kept"
            logger.info(
                f"Checkpointing to {self.folder}: every {c.interval} steps and at the last, {keep}, "
                f"async_mode {c.async_mode}; a resume loads the newest complete one there"
            )
        if c.async_mode != "disabled" and dist.is_initialized():
            # Async saves coordinate on their own gloo group, off the training collectives.
            self.async_group = dist.new_group(backend="gloo")
        else:
            self.async_group = None
        self.wait_group = self._build_wait_group(job_config)
        self.file_work = BackgroundFileWork()  # rank 0's deleting and pruning of old folders

    def _build_wait_group(self, job_config: JobConfig):
        """A gloo group for the barriers around rank 0's file work, with a timeout of its own
        (see `own_groups`); None when not distributed or not checkpointing."""
        if not (self.config.enable and dist.is_initialized()):
            return None
        seconds = max(job_config.comm.init_timeout_seconds, RANK0_FILE_WORK_TIMEOUT_SECONDS)
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))

    @property
    def own_groups(self) -> tuple:
        """The groups whose timeout the trainer must not shorten after step 1: the async save's,
        whose background collectives wait for the slowest rank's write, and the one the other
        ranks wait on while the slowest writes its part of a Hugging Face export, or rank 0
        renames."""
        return tuple(group for group in (self.async_group, self.wait_group) if group is not None)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.wait_group)

    def _check(self, job_config: JobConfig) -> None:
        c = self.config
        if c.enable and self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(
                f"the checkpoint folder '{self.folder}' (job.dump_folder / checkpoint.folder) is a file; "
                "move it, or set checkpoint.folder to another name."
            )
        if c.create_seed_checkpoint and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                "'checkpoint.create_seed_checkpoint' = true writes the initial weights from one process; "
                "run it with NGPU=1 (one process), then start the real run from that folder."
            )
        if (c.initial_load_in_hf or c.last_save_in_hf) and self.hf_adapter is None:
            raise ConfigError(
                f"model '{job_config.model.name}' has no Hugging Face state-dict adapter, so "
                "'checkpoint.initial_load_in_hf' and 'checkpoint.last_save_in_hf' cannot be used."
            )
        if c.enable and c.last_save_in_hf and self.hf_adapter is not None:
            check_exportable(self.hf_adapter, self.model)

    # ----- state ------------------------------------------------------------------------

    def _model_state(self) -> dict:
        return get_model_state_dict(self.model)

    def _optimizer_state(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def _on_disk(self, state: dict) -> dict:
        """`state` as DCP stores it: expert-parallel tensors (weights and optimizer moments)
        become DTensor views of the whole expert weights. The views share storage, so a DCP
        load into the result fills `state` too, which then goes to set_*_state_dict as is."""
        ep_params = expert_parallel_params(self.model)
        if not ep_params:
            return state
        out = dict(state)
        if "model" in state:
            out["model"] = {
                k: global_expert_view(v, ep_params[k]) if k in ep_params else v
                for k, v in state["model"].items()
            }
        if "optimizer" in state:
            per_param = dict(state["optimizer"]["state"])
            for fqn in per_param.keys() & ep_params.keys():
                param = ep_params[fqn]
                per_param[fqn] = {
                    k: global_expert_view(v, param) if _is_moment(v) else v for k, v in per_param[fqn].items()
                }
            out["optimizer"] = {**state["optimizer"], "state": per_param}
        return out

    def _full_state(self, train_state: TrainState) -> dict:
        return {
            "model": self._model_state(),
            "optimizer": self._optimizer_state(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "dataloader": saved_data_position(self.dataloader, self.dp_rank),
            "train_state": {
                "step": train_state.step,
                "tokens_seen": train_state.tokens_seen,
                "dp_degree": self.dp_degree,
                "local_batch_size": self.job_config.training.local_batch_size,
                "rng": {f"rank{_rank()}": _rng_state(self.device)},
            },
        }

    # ----- saving -----------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        c = self.config
        if why_nothing_is_saved(self.job_config):
            return False
        return step % c.interval == 0 or step == last_step or (step == 1 and c.enable_first_step_checkpoint)

    def holds(self, step: int) -> bool:
        """Whether a full checkpoint of `step` has been saved (or is being saved) or was loaded by
        this run: a stop right after it need not write it again."""
        return self.resumable_step == step

    def save(self, train_state: TrainState, *, last: bool = False, force_sync: bool = False) -> None:
        """Save the state at `train_state.step`; the final save may be model-only or HF."""
        c = self.config
        self.wait()
        step = train_state.step
        if last and c.last_save_in_hf:
            self._save_hf(step_folder(self.folder, step, hf=True))
            return
        if last and c.last_save_model_only:
            export_dtype = self.config.export_dtype
            state = self._on_disk({"model": in_export_dtype(self._model_state(), self.model, export_dtype)})
        else:
            state = self._on_disk(self._full_state(train_state))
            self.resumable_step = step
        final = step_folder(self.folder, step)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        self._barrier()
        start = time.perf_counter()
        if c.async_mode == "async_with_pinned_mem" and not (last or force_sync):
            response = dcp.async_save(
                state, storage_writer=ChecksummedWriter(partial), process_group=self.async_group,
                async_stager=self.host_staging.stager_for_this_step(),
            )  # fmt: skip
            self.host_staging.copying(response.staging_completion)
            self.pending = (response.upload_completion, partial, final, start)
            return
        if c.async_mode == "async" and not (last or force_sync):
            future = dcp.async_save(
                state, storage_writer=ChecksummedWriter(partial), process_group=self.async_group
            )
            self.pending = (future, partial, final, start)
            return
        # On the checkpointer's group: ranks that finish writing wait for the slowest rank's
        # write and rank 0's metadata, which may outlast the training timeout.
        dcp.save(state, storage_writer=ChecksummedWriter(partial), process_group=self.wait_group)
        model_only = last and c.last_save_model_only
        self._publish(
            partial, final, start, kind=" (model only: an export, not resumable)" if model_only else ""
        )

    def wait_for_staging(self) -> None:
        """Block until a pending `async_with_pinned_mem` save has copied the state to host memory.

        Call it before changing any saved tensor in place (the optimizer step); with the other
        async modes, or with no save pending, it returns at once.
        """
        self.host_staging.wait()

    def save_seed(self) -> None:
        """Write the freshly initialized weights as `step-0` (model only), for `create_seed_checkpoint`."""
        final = step_folder(self.folder, 0)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        shutil.rmtree(partial, ignore_errors=True)
        start = time.perf_counter()
        dcp.save({"model": self._model_state()}, storage_writer=ChecksummedWriter(partial))
        self._publish(partial, final, start)

    def poll(self) -> None:
        """Make a pending async save visible as soon as it has finished; call once per step.

        Without it a finished save stayed `.partial` until the next save, so a run killed in
        between resumed from one interval earlier than it had written.
        """
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Finish a pending async save (blocking until written) and make it visible.

        Needs no barrier: DCP returns from a save on any rank only after the coordinator has
        gathered every rank's writes and written the metadata, so when this rank's future is
        done the checkpoint is whole, and rank 0 renames it while the others train on.
        """
        if self.pending is None:
            return
        future, partial, final, start = self.pending
        self.pending = None
        self.wait_for_staging()
        future.result()
        self._publish(partial, final, start, collective=False)

    def _publish(
        self, partial: Path, final: Path, start: float, collective: bool = True, kind: str = ""
    ) -> None:
        if collective:
            self._barrier()
        if _rank() == 0:
            # Renames only: the deleting, and pruning's reads, go to the background, since in
            # async mode the other ranks are meanwhile in the next step's collectives, which time
            # out after comm.train_timeout_seconds.
            self.file_work.delete(replace_folder(final, partial))
            self._after_first_save(step_of(final))
            self._keep_latest()
        self.set_aside_after_first_save = False
        if collective:
            self._barrier()
        logger.info(f"Saved checkpoint {final}{kind} in {time.perf_counter() - start:.1f}s")

    def _after_first_save(self, step: int) -> None:
        """Rank 0, once this run's first checkpoint or export of `step` is published: set aside
        what a restarting load left (see `load`)."""
        if self.set_aside_after_first_save:
            rename_newer_than(self.folder, step, self.file_work)

    def _keep_latest(self) -> None:
        folder, keep = self.folder, self.config.keep_latest_k
        if keep > 0:
            self.file_work.submit(lambda: delete_folders(prune_checkpoints(folder, keep)))

    def _save_hf(self, folder: Path) -> None:
        # Every rank writes its own shards (see `hf_distributed_export`): no rank gathers the model.
        replaced = write_hf_export_from_all_ranks(
            folder, self.model, self.hf_adapter, self.config.export_dtype, self.whole_model_shapes,
            process_group=self.wait_group,
        )  # fmt: skip
        if _rank() == 0:
            self.file_work.delete(replaced)
            # The abandoned run's step-N folders would otherwise be the next resume's newest.
            self._after_first_save(step_of(folder))
            logger.info(f"Saved the model as Hugging Face safetensors in {folder}")
        self.set_aside_after_first_save = False
        self._barrier()

    # ----- loading ----------------------------------------------------------------------

    def resume_step(self) -> int | None:
        """The step to resume from: `load_step`, else the newest complete checkpoint that holds a
        training state, else a seed checkpoint (model only, step 0), else None.

        A model-only final save (`last_save_model_only`) is an export: a later run resumes from
        the full checkpoint before it, and with none, is refused rather than restarted from
        step 0 with the exported weights (which would repeat warmup and data on them).
        Rank 0 chooses and tells the others, so ranks that list the folder differently (a
        network file system's attribute cache) still load the same step.
        """
        # Agreed first: a folder rank 0 cannot read is every rank's error, not rank 0's alone.
        choice = [
            agree_on_config_errors(
                lambda: choose_resume_step(self.folder, self.config) if _rank() == 0 else None
            )
        ]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def load(self, train_state: TrainState) -> bool:
        """Restore the newest checkpoint (or `initial_load_path`) in place; True when one was read."""
        if not self.config.enable:
            return False
        step = self.resume_step()
        if step is not None:
            self._load_full(step_folder(self.folder, step), train_state)
            if not self.config.load_only:  # which leaves the folder as it is
                self._set_aside_for_a_restart(step, train_state.step)
            if train_state.step == step > 0:
                self.resumable_step = step
            if self.config.load_step < 0 and (
                exports := [s for s in complete_steps(self.folder) if s > step]
            ):
                logger.info(
                    f"Newer step-N folders {exports} are model-only exports (last_save_model_only), "
                    f"which cannot be resumed from: resumed from step-{step}"
                )
            if self.config.initial_load_path:
                logger.info(
                    f"checkpoint.initial_load_path '{self.config.initial_load_path}' not read: "
                    f"{self.folder} already holds this run's checkpoints, resumed from step-{step}"
                )
        elif self.config.initial_load_path:
            self._load_initial(Path(self.config.initial_load_path), train_state)
        else:
            if self.config.load_only:
                logger.warning(
                    f"'checkpoint.load_only' = true, but {self.folder} holds no checkpoint and "
                    "checkpoint.initial_load_path is unset: training from the initial weights, saving "
                    "nothing. Point job.dump_folder or initial_load_path at the checkpoint to load."
                )
            return False
        if self.optimizer is not None and self.lr_scheduler is not None:
            use_the_schedulers_lr(self.optimizer, self.lr_scheduler, self.job_config.optimizer)
        if train_state.step >= (steps := self.job_config.training.steps):
            logger.warning(
                f"The loaded checkpoint is at step {train_state.step}, and training.steps = {steps}: "
                "nothing is left to train. Raise training.steps to train on."
            )
        return True

    def _set_aside_for_a_restart(self, loaded_step: int, restart_step: int) -> None:
        """After loading `loaded_step` into a run that continues from `restart_step`."""
        # A rollback, or a load that restarts the step count (a model-only step, or
        # train_state excluded): the checkpoints after it belong to the abandoned run.
        if self.config.load_step >= 0 or restart_step < loaded_step:
            self._set_aside_newer_than(loaded_step)
        # Those from the restart point up to the loaded step too, but only once this run has
        # a checkpoint of its own: set aside now, a crash before that would leave nothing
        # to resume from, and the relaunch would train from random weights.
        if restart_step < loaded_step:
            self.set_aside_after_first_save = True

    def _set_aside_newer_than(self, step: int) -> None:
        """After a rollback (`load_step` older than the newest, or a load that restarts at an
        earlier step), rename the newer checkpoints to `step-N.superseded`: left in place, the
        next plain resume would pick the abandoned run's newest, this run would overwrite them
        one by one, and `keep_latest_k` would delete this run's checkpoints before them.
        Collective: every rank calls it."""
        if _rank() == 0:
            rename_newer_than(self.folder, step, self.file_work)
        self._barrier()

    def _load_full(self, folder: Path, train_state: TrainState, key: str = RESUME_KEY) -> None:
        excluded = set(self.config.exclude_from_loading)
        if self.config.verify_checksums:
            verify_before_load(folder, key)
        metadata = read_metadata(folder, key)
        saved = {name.split(".")[0] for name in metadata.state_dict_metadata}
        wanted = [k for k in STATE_KEYS if k not in excluded and k in saved]
        if "model" not in saved:
            raise ConfigError(f"checkpoint {folder} holds no model state; it cannot be resumed from.")
        state = {}
        if "model" in wanted:
            state["model"] = self._model_state()
        if "optimizer" in wanted:
            state["optimizer"] = self._optimizer_state()
        if "lr_scheduler" in wanted:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if "train_state" in wanted:
            state["train_state"] = {"step": 0, "tokens_seen": 0, "dp_degree": 0, "local_batch_size": 0}
            rng_key = f"train_state.rng.rank{_rank()}"
            if any(k.startswith(rng_key) for k in metadata.state_dict_metadata):
                state["train_state"]["rng"] = {f"rank{_rank()}": _rng_state(self.device)}
        on_disk = self._on_disk(state)
        if "model" in on_disk:
            self._check_fits(folder, on_disk["model"], key)
        # Copied: the load writes the stored groups into these dicts.
        own_groups = [
            dict(g, params=list(g["params"])) for g in state.get("optimizer", {}).get("param_groups", [])
        ]
        load_from(folder, on_disk, key)
        if "model" in state:
            set_model_state_dict(self.model, state["model"])
        if "optimizer" in state:
            groups = with_own_params(on_disk["optimizer"]["param_groups"], own_groups)
            set_optimizer_state_dict(
                self.model, self.optimizer, {**state["optimizer"], "param_groups": groups}
            )
        if "lr_scheduler" in state:
            groups = len(self.optimizer.param_groups)
            self.lr_scheduler.load_state_dict(per_group_lists_fitted(state["lr_scheduler"], groups))
        if "train_state" in state:
            self._restore_train_state(state["train_state"], train_state)
        if "dataloader" in wanted:
            restore_data_position(
                self.dataloader, folder, state.get("train_state") or self._saved_layout(folder),
                dp_rank=self.dp_rank, dp_degree=self.dp_degree, dataset_name=self.job_config.training.dataset,
            )  # fmt: skip
        logger.info(
            f"Resumed from checkpoint {folder} (step {train_state.step}); loaded {', '.join(state)}"
            + (", dataloader" if "dataloader" in wanted else "")
            + (f"; excluded {', '.join(sorted(excluded))}" if excluded else "")
        )

    def _saved_layout(self, folder: Path) -> dict:
        """The data-parallel degree and local batch a checkpoint was saved with, which placing
        its data position needs even when `train_state` itself is excluded from loading."""
        layout = {"train_state": {"dp_degree": 0, "local_batch_size": 0}}
        load_from(folder, layout)
        return layout["train_state"]

    def _restore_train_state(self, saved: dict, train_state: TrainState) -> None:
        train_state.step = int(saved["step"])
        train_state.tokens_seen = int(saved["tokens_seen"])
        rng = saved.get("rng", {}).get(f"rank{_rank()}")
        if rng is not None and int(saved["dp_degree"]) == self.dp_degree:
            _set_rng_state(rng, self.device)

    def _load_initial(self, path: Path, train_state: TrainState) -> None:
        c = self.config
        if c.initial_load_in_hf and (export := hf_export_named_by(path)) != path:
            logger.info(f"checkpoint.initial_load_path '{path}' names the Hugging Face export {export}")
            path = export
        if not path.exists():
            raise ConfigError(f"'checkpoint.initial_load_path' = '{path}' does not exist.")
        if c.initial_load_in_hf:
            model = self.job_config.model
            load_hf_checkpoint(
                self.model, self.hf_adapter, path, f"{model.name} {model.flavor}", self.whole_model_shapes
            )
            logger.info(f"Initialized the model from Hugging Face safetensors in {path}")
            return
        self._check_initial_dcp(path)
        if not c.initial_load_model_only:
            # As upstream: a training checkpoint like any other (optimizer, lr schedule, data
            # position, step), less `exclude_from_loading`; this run saves to its own folder.
            self._load_full(path, train_state, "checkpoint.initial_load_path")
            return
        if c.verify_checksums:
            verify_before_load(path, "checkpoint.initial_load_path")
        state = {"model": self._model_state()}
        on_disk = self._on_disk(state)
        self._check_fits(path, on_disk["model"], "checkpoint.initial_load_path")
        load_from(path, on_disk, "checkpoint.initial_load_path")
        set_model_state_dict(self.model, state["model"])
        logger.info(f"Initialized the model from checkpoint {path}")

    def _check_initial_dcp(self, path: Path) -> None:
        """Raise ConfigError naming the fix when `path` is no DCP checkpoint, or holds no optimizer
        state that `initial_load_model_only = false` asks for."""
        key = f"'checkpoint.initial_load_path' = '{path}'"
        if not is_dcp(path):
            if any(path.glob("*.safetensors")):
                fix = "it holds safetensors: set checkpoint.initial_load_in_hf = true"
            elif steps := complete_steps(path):
                fix = f"point it at one of its checkpoints, e.g. '{path / f'step-{steps[-1]}'}'"
            else:
                fix = "point it at a step-N folder of a checkpoint"
            raise ConfigError(f"{key} is not a DCP checkpoint (it has no .metadata file); {fix}.")
        model_only = self.config.initial_load_model_only
        if not model_only and "optimizer" not in saved_keys(path, "checkpoint.initial_load_path"):
            raise ConfigError(
                f"{key} holds model weights only (an export), but checkpoint.initial_load_model_only = "
                "false asks for its optimizer state; set initial_load_model_only = true."
            )

    def _check_fits(self, folder: Path, model_on_disk: dict, key: str) -> None:
        """Raise ConfigError naming the tensors when the DCP checkpoint in `folder` does not hold
        this model (another model or flavor), instead of DCP's traceback."""
        stored = saved_shapes(folder, "model", key)
        expected = self.whole_model_shapes or {k: v.shape for k, v in model_on_disk.items()}
        if mismatch := describe_mismatch(expected, stored):
            raise ConfigError(
                f"{key}: checkpoint {folder} was saved from another model ({mismatch}). Use the "
                f"model.flavor it was saved with, or point {key} elsewhere."
            )

    def close(self, finished: bool = True) -> None:
        """Finish a pending save; when the run `finished` (not a stop, which has little time
        left), also wait for the background deleting and pruning."""
        self.wait()
        self.host_staging.close()
        if finished:
            self.file_work.wait()
