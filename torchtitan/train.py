"""The trainer: builds everything from a JobConfig through the model's TrainSpec, then steps.

Run as `python -m torchtitan.train [--config NAME_OR_PATH] [--section.key value ...]`, alone
or under torchrun. The same code runs on CUDA (nccl) and on the CPU (gloo).
"""

import gc
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from torchtitan.components.ac_auto import resolve_auto_plan
from torchtitan.components.checkpoint import CheckpointManager, TrainState, why_nothing_is_saved
from torchtitan.components.compile import tag_compile_caches_with_process_groups
from torchtitan.components.dataloader import build_validation_dataloader, unwrap_worker_error
from torchtitan.components.loss_head import build_chunked_loss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.model_converter import build_model_converters
from torchtitan.components.optimizer import OptimizerInBackward, check_early_step_in_backward
from torchtitan.components.outputs import check_run_outputs
from torchtitan.components.profiling import MemorySnapshotter, maybe_profile
from torchtitan.components.stop import (
    STOP_FILE_ENV,
    StopRequested,
    StopRequests,
    exit_code_of_stop,
    stop_building_on_sigterm,
)
from torchtitan.components.training_step import (
    autocast_context,
    describe_layout,
    finite_or_raise,
    forward_backward,
    gradient_accumulation_steps,
    pipeline_forward_backward,
)
from torchtitan.components.validate import Validator
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import format_help, parse_args, wants_help
from torchtitan.config.toml_writer import to_toml
from torchtitan.config.validation import dump_folder_error
from torchtitan.distributed.activation_offload import offloaders_in
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.data_parallel import set_gradient_sync
from torchtitan.distributed.determinism import set_determinism
from torchtitan.distributed.device import local_device
from torchtitan.distributed.grad_norm import clip_grad_norm_
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import (
    Pipeline,
    build_stages,
    describe_pipeline,
    largest_over_stages,
    merged_model,
)
from torchtitan.distributed.process_exit import exit_skipping_interpreter_teardown, report_to_torchrun
from torchtitan.distributed.process_group import init_distributed, set_collective_timeout
from torchtitan.distributed.rank_agreement import agree_on_config_errors, mean_and_max_over_ranks
from torchtitan.distributed.tensor_parallel import loss_context
from torchtitan.models import build_run_state_dict_adapter, get_train_spec
from torchtitan.protocols.train_spec import import_custom_module
from torchtitan.tools.device_info import device_name
from torchtitan.tools.dtypes import TORCH_DTYPES
from torchtitan.tools.exit_codes import EXIT_BAD_INPUT, EXIT_INTERRUPTED
from torchtitan.tools.logging import init_logger

logger = logging.getLogger("torchtitan")


class Trainer:
    """Owns the model, optimizer, data and metrics of one run."""

    def __init__(self, job_config: JobConfig):
        self.job_config = cfg = job_config
        # First, so that a misspelt model or flavor fails before any process group or log output.
        import_custom_module(cfg.job.custom_import)
        self.spec = get_train_spec(cfg.model.name)
        self.model_args = self.spec.get_flavor(cfg.model.flavor).update_from_config(cfg)
        self.device = local_device()
        world_size = init_distributed(
            self.device,
            cfg.comm.init_timeout_seconds,
            cfg.comm.trace_buf_size,
            cpu_collectives=cfg.training.enable_cpu_offload,
            trace_dump_prefix=os.path.join(
                cfg.job.dump_folder, cfg.comm.save_traces_folder, cfg.comm.save_traces_file_prefix
            ),
        )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.parallel_dims = ParallelDims.from_config(cfg.parallelism, world_size)
        self.parallel_dims.build_mesh(self.device.type, timeout_seconds=cfg.comm.init_timeout_seconds)
        tag_compile_caches_with_process_groups()
        logger.info(f"Parallelism: {describe_layout(cfg, self.parallel_dims)}")
        # Before anything is allocated, so that the snapshots see every allocation.
        self.memory_snapshotter = MemorySnapshotter(cfg, self.rank, self.device)
        set_determinism(cfg.training.seed, cfg.training.deterministic, cfg.training.deterministic_warn_only)
        self._write_resolved_config()
        agree_on_config_errors(lambda: check_run_outputs(cfg, self.rank, self.rank == 0))
        # Mode "auto" plans here, before anything is built: every rank gets the same plan.
        self.job_config = cfg = resolve_auto_plan(cfg, world_size, self.rank, self.device)

        self.tokenizer = self.spec.build_tokenizer_fn(cfg)
        self._check_vocab()
        self.accum_steps = gradient_accumulation_steps(cfg, self.parallel_dims.dp_degree)
        check_early_step_in_backward(cfg, self.parallel_dims, self.accum_steps)
        dp_rank, dp_degree = self.parallel_dims.dp_rank(), self.parallel_dims.dp_degree
        self.dataloader = agree_on_config_errors(  # a hub stream may leave one rank empty
            lambda: self.spec.build_dataloader_fn(cfg, self.tokenizer, dp_rank, dp_degree)
        )

        self.loss_fn = build_chunked_loss(cfg, self.spec.build_loss_fn, self.parallel_dims)
        self.context_parallel = ContextParallel.from_config(cfg, self.parallel_dims, self.model_args)
        self.pipeline: Pipeline | None = None
        self.whole_model_shapes = None  # under PP, where this rank's model is a part of it
        self.model_parts: list[torch.nn.Module] = []  # what forward runs: the model, or its stages
        self.model = self._build_model()
        self.optimizer = self.spec.build_optimizer_fn(self.model, cfg, self.device)
        self.lr_scheduler = self.spec.build_lr_scheduler_fn(self.optimizer, cfg)
        self.validator = self._build_validator(dp_rank, dp_degree)
        self.metrics = agree_on_config_errors(  # rank 0's wandb may refuse to start
            lambda: MetricsProcessor(cfg, self.device, self.flops_per_token, self.rank == 0, self.rank)
        )
        self.step = 0
        self.first_step = 1  # of this run; later when it resumes from a checkpoint
        self.lr = cfg.optimizer.lr
        self.step_metrics: dict[str, torch.Tensor] = {}
        # Activation offload's per step: the bytes that crossed to the host (and back).
        self.offloaders = [o for part in self.model_parts for o in offloaders_in(part)]
        self.offloaded_step_bytes = 0
        self.stop = StopRequests(cfg.comm.init_timeout_seconds)
        if self.stop.stop_file_is_users and (unsaved := why_nothing_is_saved(cfg)) and self.rank == 0:
            logger.warning(
                f"${STOP_FILE_ENV} is set, but {unsaved}: a stop before the end saves nothing to "
                "resume from. Set checkpoint.enable = true and load_only = false to resume after a stop."
            )
        self.train_state = TrainState()
        self.checkpointer = CheckpointManager(
            cfg, self.model, self.optimizer, self.lr_scheduler, self.dataloader, dp_rank=dp_rank,
            dp_degree=dp_degree, device=self.device,
            hf_adapter=self._hf_adapter(), whole_model_shapes=self.whole_model_shapes,
            pp_group=self.pipeline.pp_group if self.pipeline else None,
        )  # fmt: skip
        # Tensor-parallel ranks share their batch, pipeline stages split its layers and
        # context-parallel ranks its sequences, so each device does 1/(tp x pp x cp) of its work.
        t, d = cfg.training, self.parallel_dims
        per_device = t.local_batch_size * t.seq_len * self.accum_steps
        self.tokens_per_device_per_step = per_device // (d.tp * d.pp * d.cp)

    # ----- construction -------------------------------------------------------------------

    def _write_resolved_config(self) -> None:
        agree_on_config_errors(self._write_config_file)

    def _write_config_file(self) -> None:
        text = to_toml(self.job_config)
        if self.rank == 0:
            dump = Path(self.job_config.job.dump_folder)
            try:
                dump.mkdir(parents=True, exist_ok=True)
                (dump / "config.toml").write_text(text)
            except OSError as e:
                raise ConfigError(dump_folder_error(str(dump), e.strerror or str(e))) from None
            if self.job_config.job.print_args:
                logger.info(f"Resolved config (also in {dump / 'config.toml'}):\n{text}")
            else:
                logger.info(f"Resolved config written to {dump / 'config.toml'}")

    def _check_vocab(self) -> None:
        if self.tokenizer.vocab_size > self.model_args.vocab_size:
            raise ConfigError(
                f"the tokenizer in 'model.hf_assets_path' = '{self.job_config.model.hf_assets_path}' "
                f"has {self.tokenizer.vocab_size} tokens but flavor '{self.job_config.model.flavor}' "
                f"embeds only {self.model_args.vocab_size}; use the flavor's own tokenizer."
            )

    def _build_model(self) -> torch.nn.Module:
        cfg = self.job_config
        model = self.spec.build_meta_model(self.model_args, TORCH_DTYPES[cfg.training.dtype])
        self.converters = build_model_converters(cfg, self.parallel_dims, self.device)
        self.converters.convert(model)
        if cfg.model.print_after_conversion:
            logger.info(f"Model after its converters ({cfg.model.converters or 'none'}):\n{model}")
        self.num_params, self.flops_per_token = self.model_args.num_flops_per_token(
            model, cfg.training.seq_len
        )
        logger.info(
            f"Model {cfg.model.name} {cfg.model.flavor}: "
            f"{sum(p.numel() for p in model.parameters()):,} parameters "
            f"({self.num_params:,} without embeddings) on {device_name(self.device)}; "
            f"attention {self.model_args.describe_attention()}"
        )
        if cfg.model.moe_force_load_balance:
            logger.warning(
                "MoE routing is forced round-robin (model.moe_force_load_balance = true): every "
                "expert gets the same number of tokens whatever the router scores; for benchmarks, "
                "not for training a model"
            )
        if self.parallel_dims.pp_enabled:
            return self._build_pipeline(model)
        model = self._parallelize(model)
        self.model_parts = [model]
        return model

    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Parallelize `model` (a meta model, or a pipeline stage's part of one), then allocate and
        initialize it."""
        cfg = self.job_config
        model = self.spec.parallelize_fn(model, self.parallel_dims, cfg, self.device)
        model.to_empty(device=self.device)
        # Re-seed so the weights do not depend on any RNG use during construction.
        torch.manual_seed(0 if cfg.training.seed is None else cfg.training.seed)
        model.init_weights(buffer_device=self.device)
        model.train()
        return model

    def _build_pipeline(self, whole: torch.nn.Module) -> torch.nn.Module:
        """Split `whole` (on the meta device) into this rank's stages, parallelize each, and build
        the schedule; returns the module over all of this rank's stages (`merged_model`)."""
        cfg, dims = self.job_config, self.parallel_dims
        self.whole_model_shapes = {name: t.shape for name, t in whole.state_dict().items()}
        plan, self.model_parts = build_stages(whole, cfg, self.model_args, dims, self._parallelize)
        scale = plan.n_microbatches * self.accum_steps
        pp_group = dims.submesh("pp").get_group()
        self.pipeline = Pipeline(plan, self.model_parts, self.loss_fn, pp_group, self.device, scale,
                                 cfg.parallelism.pipeline_parallel_schedule_csv,
                                 context_parallel=self.context_parallel)  # fmt: skip
        logger.info(describe_pipeline(plan, dims.pp_rank()))
        return merged_model(self.model_parts)

    def _hf_adapter(self):
        """The model's Hugging Face state-dict adapter (None if it has none), built from the
        run's args (attention overrides included, so an export that HF would run with another
        mask is refused) with the published flavor's context length unless training.seq_len
        is longer (`with_trained_seq_len`: a config.json that says what this run computed)."""
        adapter = build_run_state_dict_adapter(self.job_config)
        if adapter is not None:
            adapter.use_tokenizer_ids(self.tokenizer.bos_id, self.tokenizer.eos_id)
        return adapter

    def _build_validator(self, dp_rank: int, dp_degree: int) -> Validator | None:
        if not self.job_config.validation.enable:
            return None
        loader = build_validation_dataloader(self.job_config, self.tokenizer, dp_rank, dp_degree)
        return Validator(loader, self.loss_fn, self.device, self.job_config.validation.steps, self.pipeline)

    # ----- training -----------------------------------------------------------------------

    def _next_batch(self, data_iter) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            inputs, labels = next(data_iter)
        except ConfigError as e:  # a bad record in a hub stream, maybe found by a loader worker
            raise unwrap_worker_error(e) from None
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)

    def train_step(self, data_iter) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over `accum_steps` micro-batches.

        Returns (loss averaged over this rank's micro-batches, grad norm, data seconds);
        tensors stay on the device so nothing waits for the host here.
        """
        self.optimizer.zero_grad(set_to_none=True)
        offloaded_before = sum(o.bytes_total for o in self.offloaders)
        steps_in_backward = isinstance(self.optimizer, OptimizerInBackward)
        if steps_in_backward:
            # An async_with_pinned_mem save of the last step may still be copying these weights.
            self.checkpointer.wait_for_staging()
        total_loss = torch.zeros((), device=self.device)
        data_seconds = 0.0
        for micro_batch in range(self.accum_steps):
            last = micro_batch == self.accum_steps - 1
            for part in self.model_parts:
                set_gradient_sync(part, self.parallel_dims, sync=last)
            start = time.perf_counter()
            inputs, labels = self._next_batch(data_iter)
            data_seconds += time.perf_counter() - start
            if self.pipeline is not None:
                total_loss += pipeline_forward_backward(
                    self.pipeline, inputs, labels, self.parallel_dims, self.job_config
                )
                continue
            total_loss += forward_backward(
                self.model,
                self.loss_fn,
                inputs,
                labels,
                self.accum_steps,
                self.parallel_dims,
                self.job_config,
                extra_loss_fn=self.spec.extra_loss_fn,
                context_parallel=self.context_parallel,
            )
        if steps_in_backward:
            grad_norm = self.optimizer.grad_norm()
        else:
            pp_group = self.pipeline.pp_group if self.pipeline else None
            grad_norm = clip_grad_norm_(self.model.parameters(), self.job_config.training.max_norm, pp_group)
            self.checkpointer.wait_for_staging()
            self.optimizer.step()
        # Read before the scheduler advances: the log line reports the lr this step used.
        self.lr = self.optimizer.param_groups[0]["lr"]
        self.lr_scheduler.step()
        self.converters.post_optimizer_hook(self.model)
        if self.spec.post_optimizer_step_fn is not None:
            self.step_metrics = self.spec.post_optimizer_step_fn(self.model, self.parallel_dims.dp_group())
        self.offloaded_step_bytes = sum(o.bytes_total for o in self.offloaders) - offloaded_before
        return total_loss, grad_norm, data_seconds

    def _finite_or_raise(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float, float]:
        """This step's loss (the mean and the largest over ranks) and gradient norm, once all are
        finite.

        Checked where the host waits for them anyway, on log and checkpoint steps, so never
        between them. A non-finite gradient leaves NaN weights after the step, so they are
        never checkpointed.

        Raises:
            FloatingPointError: naming the step.
        """
        global_loss, max_loss = mean_and_max_over_ranks(loss.item(), self.device)
        norm = grad_norm.item()
        finite_or_raise(self.step, global_loss, norm)
        return global_loss, max_loss, norm

    def _log(self, loss: torch.Tensor, grad_norm: torch.Tensor, started: float) -> None:
        global_loss, max_loss, norm = self._finite_or_raise(loss, grad_norm)
        steps_left = self.job_config.training.steps - self.step
        steps_done = self.step - self.first_step + 1  # in this run: a resumed run starts later
        eta = (time.perf_counter() - started) / steps_done * steps_left
        extra = {name: value.item() for name, value in self.step_metrics.items()}
        if self.offloaders:
            extra["offload_gib"] = self.offloaded_step_bytes / 2**30
        if self.pipeline is not None:
            extra = largest_over_stages(extra, self.pipeline.pp_group)
        self.metrics.log(self.step, global_loss, norm, self.lr, eta, extra=extra, max_loss=max_loss)

    def _validates_at(self, step: int) -> bool:
        """Step 1 (a baseline, as upstream), every `validation.freq` steps, and the last step."""
        freq, last = self.job_config.validation.freq, self.job_config.training.steps
        return step == 1 or step % freq == 0 or step == last

    def _validate(self) -> None:
        autocast = autocast_context(self.job_config, self.parallel_dims, self.device)
        with loss_context(self.parallel_dims, self.job_config), autocast:
            val_loss = self.validator.validate(self.model)
        # Upstream torchtitan's line, spacing included, so that log greps written for it keep working.
        logger.info(f"validate step: {self.step:2}  loss: {val_loss:7.4f}")
        self.metrics.write({"step": self.step, "validation/loss": val_loss})

    def train(self) -> None:
        """Run `training.steps` optimizer steps (or until SIGTERM), logging and checkpointing as
        configured; resumes from the newest checkpoint first."""
        cfg = self.job_config
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed()
            logger.info("Wrote the seed checkpoint (step 0, model only); exiting")
            return
        if self.checkpointer.load(self.train_state):
            self.step = self.train_state.step
        self.first_step = self.step + 1
        data_iter = iter(self.dataloader)
        gc.disable()
        started = time.perf_counter()
        self.metrics.reset_window()  # the first step's throughput leaves out setup and loading
        logger.info(
            f"Training {cfg.training.steps} steps: global batch "
            f"{cfg.training.local_batch_size * self.parallel_dims.dp_degree * self.accum_steps} x "
            f"{cfg.training.seq_len} tokens, {self.accum_steps} micro-batch(es) per step"
        )
        try:
            with maybe_profile(cfg, self.rank, self.step) as profiler:
                self._train_steps(data_iter, started, profiler)
        except torch.OutOfMemoryError:
            self.memory_snapshotter.on_oom()
            raise
        logger.info(
            f"Training finished at step {self.step}: {self.step - self.first_step + 1} steps in "
            f"{time.perf_counter() - started:.1f}s"
        )

    def _train_steps(self, data_iter, started: float, profiler) -> None:
        cfg = self.job_config
        unchecked = None  # the last step's (loss, grad_norm) until checked finite
        while self.step < cfg.training.steps:
            if self.stop.agreed():
                # Not before the first step (nothing trained), nor again right after a save
                # (or resume) of this step: during the rewrite the grace period could run out.
                saves = not why_nothing_is_saved(cfg)
                if saves and self.step > 0 and not self.checkpointer.holds(self.step):
                    self._save_finite(unchecked, force_sync=True)
                raise StopRequested
            self.step += 1
            if self.step % cfg.training.gc_freq == 0:
                gc.collect(1)
            loss, grad_norm, data_seconds = self.train_step(data_iter)
            unchecked = (loss, grad_norm)
            self.metrics.count(self.tokens_per_device_per_step, data_seconds)
            first = self.step == self.first_step
            if first or self.step % cfg.metrics.log_freq == 0 or self.step == cfg.training.steps:
                self._log(loss, grad_norm, started)
                unchecked = None
            if first:
                set_collective_timeout(cfg.comm.train_timeout_seconds, keep=self.checkpointer.own_groups)
            if self.validator and self._validates_at(self.step):
                with self.metrics.paused():
                    self._validate()
            self.train_state.step = self.step
            self.train_state.tokens_seen += self.tokens_per_device_per_step * self.parallel_dims.world_size
            if self.checkpointer.should_save(self.step, cfg.training.steps):
                with self.metrics.paused():
                    self._save_finite(unchecked, last=self.step == cfg.training.steps)
                unchecked = None
            else:
                self.checkpointer.poll()
            profiler.step()
            self.memory_snapshotter.after_step(self.step)

    def _save_finite(self, unchecked: tuple | None, **save_options) -> None:
        """Checkpoint, after checking the loss and gradient norm of `unchecked` (the last step's
        when no log line has checked them) are finite."""
        if unchecked is not None:
            self._finite_or_raise(*unchecked)
        self.checkpointer.save(self.train_state, **save_options)

    def close(self, finished: bool = True) -> None:
        """Release what the run holds; `finished`: it trained to the end (a stop or an error
        does not wait for the checkpointer's background deleting)."""
        self.checkpointer.close(finished)
        self.metrics.close()
        gc.enable()


def _stopped(trainer: "Trainer | None") -> int:
    if trainer is None:
        return exit_code_of_stop(None)
    unsaved = why_nothing_is_saved(trainer.job_config)
    return exit_code_of_stop(trainer.stop, trainer.first_step, trainer.step, unsaved)


def main(argv: list[str] | None = None) -> None:
    """Parse the config and train; always clean up (writers, process group).

    Exit codes (`torchtitan.tools.exit_codes`): 0 done, 2 config mistake (one paragraph on
    stderr, no traceback), 143 stopped by SIGTERM or the stop file (`TORCHTITAN_STOP_FILE`)
    with what was trained saved (or nothing trained yet), 3 stopped so with steps trained and
    checkpointing off, 130 interrupted. A SIGTERM while the trainer is still being built
    stops the build at once. A rank of a process group leaves without the interpreter's final
    teardown (`exit_skipping_interpreter_teardown` says why).
    """
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        try:
            print(format_help(argv), flush=True)
        except ConfigError as e:  # a job.custom_config_module whose keys cannot be listed
            print(f"error: {e}", file=sys.stderr)
            sys.exit(EXIT_BAD_INPUT)
        except BrokenPipeError:  # `--help | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    init_logger()
    trainer = None
    exit_code = 0
    finished = False
    joined_process_group = False
    stop_building_on_sigterm()
    try:
        trainer = Trainer(parse_args(argv))
        trainer.stop.stop_between_steps_on_sigterm()
        trainer.train()
        finished = True
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        report_to_torchrun(f"error: {e}")
        exit_code = EXIT_BAD_INPUT
    except StopRequested:
        exit_code = _stopped(trainer)
    except KeyboardInterrupt:
        logger.warning("Interrupted; shutting down")
        exit_code = EXIT_INTERRUPTED
    finally:
        if trainer is not None:
            trainer.close(finished)
            # Free the model (a DDP reducer's threads among it) while its process group is
            # alive: destroyed later, at interpreter exit, DDP sometimes aborted the process.
            trainer = None
            gc.collect()
        if dist.is_initialized():
            joined_process_group = True
            dist.destroy_process_group()
    if joined_process_group:
        exit_skipping_interpreter_teardown(exit_code)
    if exit_code:
        sys.exit(exit_code)


if __name__ == "__main__":
    # @record writes an uncaught exception where torchrun's summary finds it, so the failing
    # rank is named with its traceback even when LOG_RANK hides its output.
    record(main)()
