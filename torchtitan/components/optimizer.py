"""Adam/AdamW from `[optimizer]`, with the fastest kernel the device offers, stepping after
backward or, with `early_step_in_backward`, inside it."""

import logging

import torch
import torch.nn as nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.expert_parallel import routed_experts
from torchtitan.distributed.grad_norm import GradSquareSums
from torchtitan.distributed.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)


def build_optimizer(model: nn.Module, job_config: JobConfig, device: torch.device):
    """Adam or AdamW over all trainable parameters of `model`.

    `implementation = "fused"` uses the fused kernel wherever torch has one (CUDA and the CPU
    among others; 8x faster than foreach for the Llama 3 debug model on the CPU) and foreach
    elsewhere. Fused's step keeps no temporaries; foreach's makes some about the size of the
    parameters.

    MoE expert weights get a param group of their own, same hyperparameters: under expert
    parallelism they are plain local tensors (or DTensors on another mesh), which the
    multi-tensor kernels refuse to mix with FSDP's DTensors. They get it in every layout, so
    that the optimizer and LR scheduler states of one layout load into another.
    """
    cfg = job_config.optimizer
    impl = cfg.implementation
    if impl == "fused" and device.type not in _get_fused_kernels_supported_devices():
        impl = "foreach"
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    experts = {id(p) for module in routed_experts(model) for p in module.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if id(p) not in experts]}]
    if experts:
        groups.append({"params": [p for p in params if id(p) in experts]})
    hyperparameters = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "fused": impl == "fused",
        "foreach": impl == "foreach",
    }
    if cfg.early_step_in_backward:
        logger.info(
            f"Optimizer: {cfg.name} steps each parameter inside backward as soon as its gradient "
            "is ready, then frees the gradient (optimizer.early_step_in_backward)"
        )
        return OptimizerInBackward(cls, groups, hyperparameters)
    return cls(groups, **hyperparameters)


class OptimizerInBackward(torch.optim.Optimizer):
    """Steps each parameter as soon as backward has its gradient, then frees that gradient.

    The gradients then never all exist at once: a step holds at most the ones backward has
    not reached yet, which saves up to the size of all gradients (4 bytes per parameter, or
    per shard under FSDP). Each parameter gets an optimizer of `optimizer_cls` of its own,
    stepped from a post-accumulate-grad hook; FSDP2 calls those hooks on the sharded
    parameter once its gradient is reduce-scattered (and all-reduced under HSDP).

    To everything else it is one optimizer with the usual param groups and state, keyed like
    `optimizer_cls`'s over the same groups: the LR scheduler sets the groups' lr, which each
    step copies into the parameter's optimizer, and the parameters' optimizers share this one's
    `state`, so checkpoints load across the two ways of stepping. `step()` steps every
    parameter that has a gradient, for callers that set gradients by hand (DCP's state init).

    `grad_norm()` returns the global norm of the gradients the hooks stepped with since it was
    last read, measured before each was freed.

    Pitfalls: nothing can look at all gradients after backward, so clipping by the global norm
    and gradient accumulation are impossible (each micro-batch's backward would step); DDP
    all-reduces gradients after the hooks fire, so it would step on unreduced ones. The
    trainer refuses these (`check_early_step_in_backward`).
    """

    def __init__(self, optimizer_cls: type[torch.optim.Optimizer], groups: list[dict], hyperparameters: dict):
        per_param = {p: optimizer_cls([p], **hyperparameters) for group in groups for p in group["params"]}
        # The class's own defaults, so that the param groups (and checkpoints) carry the keys
        # an optimizer_cls over the same groups would.
        defaults = next(iter(per_param.values())).defaults if per_param else hyperparameters
        super().__init__(groups, defaults)
        self._grad_squares = GradSquareSums()
        # By index: load_state_dict replaces the group dicts the LR scheduler then updates.
        self._per_param: dict[torch.Tensor, tuple[torch.optim.Optimizer, int]] = {}
        for index, group in enumerate(self.param_groups):
            for param in group["params"]:
                per_param[param].state = self.state
                self._per_param[param] = (per_param[param], index)
                param.register_post_accumulate_grad_hook(self._step_in_backward)

    def _step_in_backward(self, param: torch.Tensor) -> None:
        self._grad_squares.add([param])
        self._step_one(param)
        param.grad = None
        # What torch's LR schedulers check (set by the `step` they wrap) before warning that
        # the scheduler stepped before the optimizer.
        self._opt_called = True

    def _step_one(self, param: torch.Tensor) -> None:
        one, index = self._per_param[param]
        one.param_groups[0].update((k, v) for k, v in self.param_groups[index].items() if k != "params")
        one.step()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for param in self._per_param:
            if param.grad is not None:
                self._step_one(param)
        return loss

    def grad_norm(self) -> torch.Tensor:
        """The global norm (float32) of the gradients stepped since the last call."""
        return self._grad_squares.global_norm().float()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for one, _ in self._per_param.values():
            one.state = self.state


def check_early_step_in_backward(
    job_config: JobConfig, parallel_dims: ParallelDims, accum_steps: int
) -> None:
    """Refuse `optimizer.early_step_in_backward` where a step needs every gradient at once.

    Raises:
        ConfigError: with gradient accumulation, or with DDP (pure data-parallel replication).
    """
    if not job_config.optimizer.early_step_in_backward:
        return
    t = job_config.training
    if accum_steps > 1:
        raise ConfigError(
            f"'optimizer.early_step_in_backward' = true steps in every backward, but "
            f"'training.global_batch_size' = {t.global_batch_size} accumulates {accum_steps} "
            "micro-batches per step; set training.global_batch_size = -1 (or local_batch_size x "
            "data-parallel degree), or early_step_in_backward = false."
        )
    if parallel_dims.ddp_enabled:
        raise ConfigError(
            "'optimizer.early_step_in_backward' = true would step on gradients DDP has not "
            f"all-reduced yet ('parallelism.data_parallel_replicate_degree' = {parallel_dims.dp_replicate} "
            "without sharding); shard with data_parallel_shard_degree > 1 (FSDP or HSDP), or set "
            "early_step_in_backward = false."
        )
