"""Parallel degrees -> validated, named DeviceMesh. The one mesh builder of the project."""

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.config.errors import ConfigError
from torchtitan.config.validation import expert_parallel_conflict
from torchtitan.distributed.process_group import set_group_timeouts

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
# With expert parallelism dp_shard is built from two dims: EP groups are runs of consecutive
# ranks (fast links for the all-to-all), and each expert is FSDP-sharded across the groups.
# The "ep" group is ("dp_shard_in_ep", "cp") flattened, with "tp" too when it borrows TP.
EP_MESH_DIMS = ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")


@dataclass
class ParallelDims:
    """The parallel degrees of a run and the mesh built from them.

    `dp_shard = -1` takes the ranks left over after the other degrees. The mesh always has
    the dims ("dp_replicate", "dp_shard", "cp", "tp"), some of size 1, plus the flattened "dp"
    (replicate x shard: ranks that see different batches). Pipeline parallelism (`pp > 1`) adds
    an outermost "pp" dim; the other dims then describe the ranks of one stage.

    Context parallelism (`cp > 1`) splits each sequence over the "cp" ranks, which see the same
    batch. They hold the same weights, so FSDP shards over dp_shard and cp together (the
    flattened "dp_shard_cp"), as torchtitan does, and averages the gradients over both.

    Expert parallelism (`ep > 1`) borrows its ranks from dp_shard, as torchtitan does: dp_shard
    is then the flattening of ("dp_shard_mod_ep", "dp_shard_in_ep"), and the EP group takes
    "dp_shard_in_ep". Experts are split over "ep" and FSDP-sharded over the ranks holding the
    same experts (`expert_dp_mesh`); every other parameter is sharded over the whole dp_shard
    (and cp) as without EP. Under context parallelism the EP group takes every "cp" rank too,
    as in torchtitan: `ep / cp` of its ranks come from dp_shard.

    Under TP, `etp` (expert tensor parallel degree) says what the experts do with the TP ranks:
    `etp == tp` shards each EP rank's experts over its TP group, and EP borrows only from
    dp_shard as above; `etp == 1` makes EP borrow the TP ranks too (torchtitan's default): the
    EP group is then ("dp_shard_in_ep", "tp") flattened, `ep / tp` of its ranks coming from
    dp_shard. Without EP, `etp` does not matter: TP shards the experts.

    Raises:
        ConfigError: when the degrees do not multiply to the world size, ep does not fit
            dp_shard (and cp, and tp when it borrows tp).
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1
    etp: int = 1
    pp: int = 1
    cp: int = 1
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    # Flattened and combined meshes, kept here because slicing them out of the root mesh by
    # name is deprecated (and warns) since torch 2.11.
    _derived: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _cp_exchange_group: object = field(default=None, repr=False)

    def __post_init__(self):
        pp = f"pipeline_parallel_degree {self.pp} x " if self.pp > 1 else ""
        cp = f" x context_parallel_degree {self.cp}" if self.cp > 1 else ""
        if self.dp_shard == -1:
            others = self.pp * self.dp_replicate * self.cp * self.tp
            if self.world_size % others:
                raise ConfigError(
                    f"{pp}data_parallel_replicate_degree {self.dp_replicate}{cp} x tensor_parallel_degree "
                    f"{self.tp} = {others} does not divide the world size {self.world_size}; "
                    "choose degrees whose product divides the number of processes."
                )
            self.dp_shard = self.world_size // others
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees multiply to {product} ({pp}data_parallel_replicate_degree "
                f"{self.dp_replicate} x data_parallel_shard_degree {self.dp_shard}{cp} x "
                f"tensor_parallel_degree {self.tp}) but the world size is {self.world_size}; make "
                "the product equal the number of processes, or set data_parallel_shard_degree = -1."
            )
        if self.ddp_enabled and self.tp > 1:
            # torch's replicate on a slice of a TP mesh swaps the TP weights for plain DTensor
            # attributes, so no parameter gets a gradient and nothing trains.
            raise ConfigError(
                f"data_parallel_replicate_degree {self.dp_replicate} with data_parallel_shard_degree 1 "
                f"is DDP, which does not combine with tensor_parallel_degree {self.tp}; shard instead: "
                f"data_parallel_shard_degree = {self.dp_replicate} with data_parallel_replicate_degree = 1 "
                "(FSDP), or HSDP with both degrees above 1."
            )
        if conflict := expert_parallel_conflict(self.ep, self.tp, self.etp, self.dp_shard, self.cp):
            raise ConfigError(conflict)

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> "ParallelDims":
        """The degrees of a `[parallelism]` section for `world_size` ranks (not built yet)."""
        p = parallelism
        return cls(
            p.data_parallel_replicate_degree,
            p.data_parallel_shard_degree,
            p.tensor_parallel_degree,
            world_size,
            ep=p.expert_parallel_degree,
            etp=p.expert_tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            cp=p.context_parallel_degree,
        )

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP (or HSDP) shards parameters over dp_shard (and cp)."""
        return self.dp_shard * self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication: replicas but no sharding."""
        return self.dp_replicate > 1 and self.dp_shard * self.cp == 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def ep_borrows_tp(self) -> bool:
        """EP groups span the TP ranks (etp 1 under TP): experts are whole, not TP-sharded."""
        return self.ep > 1 and self.tp > 1 and self.etp == 1

    @property
    def ep_data_ranks(self) -> int:
        """The ranks of an EP group that see different tokens (its dp_shard and cp ranks)."""
        return self.ep // self.tp if self.ep_borrows_tp else self.ep

    @property
    def ep_from_dp_shard(self) -> int:
        """The ranks of an EP group taken from dp_shard (they see different batches)."""
        return self.ep_data_ranks // self.cp

    def ep_parts(self) -> str:
        """Where the EP group's ranks come from, e.g. "2 of dp_shard x cp 2 x tp 2"."""
        parts = [f"{self.ep_from_dp_shard} of dp_shard"]
        parts += [f"cp {self.cp}"] * self.cp_enabled + [f"tp {self.tp}"] * self.ep_borrows_tp
        return " x ".join(parts)

    @property
    def expert_dp_degree(self) -> int:
        """Ranks holding the same experts (they average the experts' gradients)."""
        return self.dp_replicate * self.dp_shard // self.ep_from_dp_shard

    def build_mesh(self, device_type: str, timeout_seconds: int | None = None) -> DeviceMesh | None:
        """Create the named mesh (None for a single process) and its flattened "dp".

        Args:
            timeout_seconds: the collective timeout of every group the mesh creates (None:
                torch's default for new groups, 10 min on NCCL and 30 on gloo, whatever the
                default group's timeout is). The trainer passes `comm.init_timeout_seconds`.
        """
        if self.world_size == 1:
            return None
        mesh = self._build_mesh(device_type)
        if self.cp_enabled and self.ep == self.cp:
            self._cp_exchange_group = self._copy_of_cp_group()
        if timeout_seconds is not None:
            groups = {self.submesh(name).get_group() for name in self.mesh_group_names()}
            if self._cp_exchange_group is not None:
                groups.add(self._cp_exchange_group)
            set_group_timeouts(timeout_seconds, groups)
        return mesh

    def _copy_of_cp_group(self):
        """A second process group of every "cp" group's ranks; this rank's one."""
        cp_dim = self.mesh.mesh_dim_names.index("cp")
        groups = self.mesh.mesh.movedim(cp_dim, -1).reshape(-1, self.cp).tolist()
        return dist.new_subgroups_by_enumeration(groups, group_desc="cp_exchange")[0]

    def cp_exchange_group(self):
        """The process group context parallelism's exchanges in attention run on.

        The "cp" group, or where the EP group has the same ranks (EP degree = CP degree) a
        copy of it: AC tells CP's exchanges from EP's all-to-alls by their group
        (`activation_checkpoint.context_parallel_collective`), and recomputes the one where it
        replays the other. For equal ranks torch may hand out one group for both (gloo does).
        """
        return self._cp_exchange_group or self.submesh("cp").get_group()

    def _build_mesh(self, device_type: str) -> DeviceMesh:
        if self.ep_enabled:
            mesh, shard = self._build_ep_mesh(device_type)
        else:
            shape = (self.dp_replicate, self.dp_shard, self.cp, self.tp)
            mesh = self._init_mesh(device_type, shape, MESH_DIMS)
            shard = ("dp_shard",)
        self._derived["dp"] = mesh[("dp_replicate", *shard)]._flatten("dp")
        if self.cp_enabled:
            dp_shard_cp = self._derived["dp_shard_cp"] = mesh[(*shard, "cp")]._flatten("dp_shard_cp")
            self._derived["dp_cp"] = mesh[("dp_replicate", *shard, "cp")]._flatten("dp_cp")
            self._derived["hsdp"] = DeviceMesh._concatenate([mesh["dp_replicate"], dp_shard_cp])
        elif self.ep_enabled:
            self._derived["hsdp"] = DeviceMesh._concatenate([mesh["dp_replicate"], self.submesh("dp_shard")])
        else:
            self._derived["hsdp"] = mesh["dp_replicate", "dp_shard"]
        self._mesh = mesh
        return mesh

    def _build_ep_mesh(self, device_type: str) -> tuple[DeviceMesh, tuple[str, str]]:
        """The root mesh with dp_shard split in two, its derived "dp_shard", "ep" and
        "expert_dp", and the names of dp_shard's two parts."""
        in_ep = self.ep_from_dp_shard
        shape = (self.dp_replicate, self.dp_shard // in_ep, in_ep, self.cp, self.tp)
        mesh = self._init_mesh(device_type, shape, EP_MESH_DIMS)
        shard = ("dp_shard_mod_ep", "dp_shard_in_ep")
        self._derived["dp_shard"] = mesh[shard]._flatten("dp_shard")
        ep_dims = ("dp_shard_in_ep", "cp", "tp") if self.ep_borrows_tp else ("dp_shard_in_ep", "cp")
        self._derived["ep"] = mesh[ep_dims]._flatten("ep")
        if self.dp_replicate > 1:
            self._derived["expert_dp"] = mesh["dp_replicate", "dp_shard_mod_ep"]._flatten("expert_dp")
        return mesh, shard

    def _init_mesh(self, device_type: str, shape: tuple, names: tuple) -> DeviceMesh:
        """The root mesh; under pipeline parallelism "pp" is its outermost dim, so that the
        ranks of one stage are neighbours (the links FSDP and TP use most)."""
        if self.pp_enabled:
            shape, names = (self.pp, *shape), ("pp", *names)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)

    def mesh_group_names(self) -> list[str]:
        """The names `submesh` takes that name a 1-D group of this layout."""
        return [*self.mesh.mesh_dim_names, *(name for name in self._derived if name != "hsdp")]

    def submesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh of one dim ("dp_replicate", "dp_shard", "tp", "ep", ...) or of a
        flattened one ("dp", "expert_dp", and "ep" when it borrows tp); "hsdp" is the 2-D
        (dp_replicate, dp_shard) mesh."""
        if name in self._derived:
            return self._derived[name]
        return self.mesh[name]

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def expert_dp_mesh(self) -> DeviceMesh:
        """The 1-D mesh the experts' FSDP shards over: every rank holding the same experts.

        Under HSDP the experts are sharded across the replicas too (dp_replicate flattened with
        dp_shard_mod_ep), not replicated: their all-gathers then cross replica groups, but each
        rank holds less. (A 2-D HSDP unit with a shard dim of 1 inside an activation checkpoint
        runs different FSDP hooks in forward and in recompute, which selective AC refuses.)
        """
        if self.dp_replicate > 1:
            return self.submesh("expert_dp")
        return self.submesh("dp_shard_mod_ep")

    def fsdp_mesh_name(self) -> str:
        """The 1-D mesh FSDP shards over without replicas: "dp_shard", or "dp_shard_cp"."""
        return "dp_shard_cp" if self.cp_enabled else "dp_shard"

    def dp_group(self):
        """The process group of ranks that see different tokens (different batches, or under
        context parallelism different parts of a sequence); None for one process."""
        if self._mesh is None:
            return None
        return self.submesh("dp_cp" if self.cp_enabled else "dp").get_group()

    def cp_rank(self) -> int:
        """This rank's index among the ranks splitting one sequence (0 without CP)."""
        return self.submesh("cp").get_local_rank() if self.cp_enabled else 0

    def pp_rank(self) -> int:
        """This rank's index along the pipeline (0 without pipeline parallelism)."""
        return self.submesh("pp").get_local_rank() if self.pp_enabled else 0

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (0 without a mesh)."""
        return 0 if self._mesh is None else self.submesh("dp").get_local_rank()
