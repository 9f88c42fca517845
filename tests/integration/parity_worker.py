"""Run under torchrun (or the tests' forked launcher): the trainer a user's run builds, stepped
here so that its gradients and parameters can be read from outside.

    parity_worker.py OUT STEPS PLANT [the trainer's arguments]

Builds `torchtitan.train.Trainer` from the arguments, runs STEPS training steps through its own
`train_step` (forward, backward, accumulation, clipping, optimizer), and writes to OUT (rank 0):
each step's loss (the mean over ranks, as logged), gradient norm and the model's own step
metrics (an MoE model's balance), every parameter's gradient
after step 1 (after clipping, as the optimizer saw it) and every parameter after the last step,
each as the full tensor gathered from its FSDP, TP or expert-parallel shards and keyed by its
unsharded name.

PLANT plants a known bug for the checks to catch ("none" for none), from here, outside the
production code:
    unreduced-norm-grad: the first tensor-parallel partial gradient (a norm weight's) is used
        as this rank's partial sum, as a missing all-reduce would leave it;
    swapped-expert-rows: rank 0 swaps the first two rows of the first expert weight's gradient;
    scaled-shard: rank 1 scales its shard of `layers.1.attention.wq.weight`'s gradient by 1 + 1e-3;
    unscaled-microbatches: the pipeline's loss is not divided by its microbatch count;
    keys-in-rank-order: the gathered keys under context parallelism are masked as if they were
        in sequence order;
    experts-mean-without-cp: the experts' gradients are averaged over the EP group's dp_shard
        ranks only, as if its context-parallel ranks saw the same tokens.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

import torchtitan.train
from tests.integration.workers import shut_down
from torchtitan.config.manager import parse_args
from torchtitan.distributed import grad_norm
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.expert_parallel import expert_parallel_params, full_expert_tensor, routed_experts
from torchtitan.distributed.rank_agreement import mean_and_max_over_ranks
from torchtitan.tools.fqn import clean_fqn
from torchtitan.tools.logging import init_logger
from torchtitan.train import Trainer

SCALED_SHARD_PARAM = "layers.1.attention.wq.weight"


def full_tensors(model: torch.nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) as a whole float32 CPU tensor, by clean FQN; a
    collective, which every rank calls."""
    expert = {id(p) for p in expert_parallel_params(model).values()}
    out = {}
    for name, param in model.named_parameters():
        value = param.grad if grads else param.detach()
        if value is None:
            continue
        if id(param) in expert:
            value = full_expert_tensor(value, param)
        elif isinstance(value, DTensor):
            value = value.full_tensor()
        out[clean_fqn(name)] = value.detach().float().cpu().clone()
    return out


def whole_model(trainer: Trainer, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` of every pipeline stage, merged (each rank holds its stages' only)."""
    if trainer.pipeline is None:
        return tensors
    stages: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(stages, tensors)
    return {name: tensor for stage in stages for name, tensor in stage.items()}


def _leave_one_partial_gradient_unreduced() -> None:
    reduce = grad_norm._reduce_partial_grads

    def leaving_one(params):
        partial = [
            p
            for p in params
            if isinstance(p.grad, DTensor) and any(x.is_partial() for x in p.grad.placements)
        ]
        victim = partial[0] if partial else None
        local = victim.grad.to_local().clone() if victim is not None else None
        reduce(params)
        if victim is not None:
            grad = victim.grad
            placements = [Replicate() if x.is_partial() else x for x in grad.placements]
            victim.grad = DTensor.from_local(
                local, grad.device_mesh, placements, run_check=False, shape=grad.shape, stride=grad.stride()
            )

    grad_norm._reduce_partial_grads = leaving_one


def _change_a_gradient_before_clipping(change) -> None:
    clip = torchtitan.train.clip_grad_norm_

    def changed_then_clipped(parameters, max_norm, *pipeline_group):
        parameters = list(parameters)
        change(parameters)
        return clip(parameters, max_norm, *pipeline_group)

    torchtitan.train.clip_grad_norm_ = changed_then_clipped  # where the trainer looks it up


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def plant(bug: str, trainer: Trainer) -> None:
    model = trainer.model
    rank = dist.get_rank() if dist.is_initialized() else 0
    if bug == "unreduced-norm-grad":
        _leave_one_partial_gradient_unreduced()
    elif bug == "swapped-expert-rows":
        first_expert = next(iter(expert_parallel_params(model).values()))

        def swap(parameters):
            if rank == 0:
                local = _local(first_expert.grad)
                local[[0, 1]] = local[[1, 0]]

        _change_a_gradient_before_clipping(swap)
    elif bug == "scaled-shard":
        target = next(p for n, p in model.named_parameters() if clean_fqn(n) == SCALED_SHARD_PARAM)

        def scale(parameters):
            if rank == 1:
                _local(target.grad).mul_(1 + 1e-3)

        _change_a_gradient_before_clipping(scale)
    elif bug == "unscaled-microbatches":
        schedule = trainer.pipeline.schedule
        loss_fn, microbatches = schedule._loss_fn, trainer.pipeline.plan.n_microbatches
        schedule._loss_fn = lambda output, labels: loss_fn(output, labels) * microbatches
    elif bug == "keys-in-rank-order":
        # The headtail split gathers chunks 0, 3 (rank 0), 1, 2 (rank 1): read as 0, 1, 2, 3.
        def in_rank_order(self, seq_len, device):
            return torch.arange(seq_len, device=device)

        ContextParallel.gathered_positions = in_rank_order
    elif bug == "experts-mean-without-cp":
        for experts in routed_experts(model):
            experts._ep_hooks.data_ranks //= trainer.parallel_dims.cp
    elif bug != "none":
        raise ValueError(f"unknown bug to plant: {bug}")


def main(out: str, steps: int, bug: str, argv: list[str]) -> None:
    init_logger()
    trainer = Trainer(parse_args(argv))
    plant(bug, trainer)
    data = iter(trainer.dataloader)
    record = {"losses": [], "grad_norms": [], "step_metrics": []}
    for step in range(1, steps + 1):
        trainer.step = step
        loss, grad_norm, _ = trainer.train_step(data)
        record["losses"].append(mean_and_max_over_ranks(loss.item(), trainer.device)[0])
        record["grad_norms"].append(grad_norm.item())
        record["step_metrics"].append({name: value.item() for name, value in trainer.step_metrics.items()})
        if step == 1:
            record["grads"] = whole_model(trainer, full_tensors(trainer.model, grads=True))
    record["params"] = whole_model(trainer, full_tensors(trainer.model, grads=False))
    if trainer.rank == 0:
        torch.save(record, out)
    trainer.close()
    trainer = None
    if dist.is_initialized():
        shut_down()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
