"""Parallel degrees -> validated, named DeviceMesh. The one mesh builder of the project."""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.config.errors import ConfigError
from torchtitan.config.validation import expert_parallel_conflict
from torchtitan.distributed.process_group import set_group_timeouts

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
# With expert parallelism dp_shard is built from two dims: EP groups are runs of consecutive
# ranks (fast links for the all-to-all), and each expert is FSDP-sharded across the groups.
EP_MESH_DIMS = ("dp_replicate", "dp_shard_mod_ep", "ep", "tp")
# When EP also borrows the TP ranks, its group is ("dp_shard_in_ep", "tp") flattened.
EP_OVER_TP_MESH_DIMS = ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "tp")


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
    is then the flattening of ("dp_shard_mod_ep", "ep"). Experts are split over "ep" and
    FSDP-sharded over the ranks holding the same experts (`expert_dp_mesh`); every other
    parameter is sharded over the whole dp_shard as without EP.

    Under TP, `etp` (expert tensor parallel degree) says what the experts do with the TP ranks:
    `etp == tp` shards each EP rank's experts over its TP group, and EP borrows only from
    dp_shard as above; `etp == 1` makes EP borrow the TP ranks too (torchtitan's default): the
    EP group is then ("dp_shard_in_ep", "tp") flattened, `ep / tp` of its ranks coming from
    dp_shard. Without EP, `etp` does not matter: TP shards the experts.

    Raises:
        ConfigError: when the degrees do not multiply to the world size, ep does not fit
            dp_shard (and tp, when it borrows tp), or cp meets pp or ep (not built yet).
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
        if conflict := expert_parallel_conflict(self.ep, self.tp, self.etp, self.dp_shard):
            raise ConfigError(conflict)
        for degree, key in ((self.pp, "pipeline_parallel_degree"), (self.ep, "expert_parallel_degree")):
            if self.cp > 1 and degree > 1:
                raise ConfigError(
                    f"'parallelism.context_parallel_degree' = {self.cp} does not run with {key} = "
                    f"{degree} yet; set one of them to 1."
                )

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
    def ep_from_dp_shard(self) -> int:
        """The ranks of an EP group that see different data (taken from dp_shard)."""
        return self.ep // self.tp if self.ep_borrows_tp else self.ep

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
        if timeout_seconds is not None:
            groups = {self.submesh(name).get_group() for name in self.mesh_group_names()}
            set_group_timeouts(timeout_seconds, groups)
        return mesh

    def _build_mesh(self, device_type: str) -> DeviceMesh:
        if self.ep_enabled:
            in_ep = self.ep_from_dp_shard
            shape = (self.dp_replicate, self.dp_shard // in_ep, in_ep, self.tp)
            names = EP_OVER_TP_MESH_DIMS if self.ep_borrows_tp else EP_MESH_DIMS
            mesh = self._init_mesh(device_type, shape, names)
            dp_shard = mesh["dp_shard_mod_ep", names[2]]._flatten("dp_shard")
            self._derived["dp_shard"] = dp_shard
            self._derived["dp"] = mesh["dp_replicate", "dp_shard_mod_ep", names[2]]._flatten("dp")
            if self.ep_borrows_tp:
                self._derived["ep"] = mesh["dp_shard_in_ep", "tp"]._flatten("ep")
            if self.dp_replicate > 1:
                self._derived["expert_dp"] = mesh["dp_replicate", "dp_shard_mod_ep"]._flatten("expert_dp")
                self._derived["hsdp"] = DeviceMesh._concatenate([mesh["dp_replicate"], dp_shard])
        else:
            shape = (self.dp_replicate, self.dp_shard, self.cp, self.tp)
            mesh = self._init_mesh(device_type, shape, MESH_DIMS)
            self._derived["dp"] = mesh["dp_replicate", "dp_shard"]._flatten("dp")
            if self.cp_enabled:
                dp_shard_cp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
                self._derived["dp_shard_cp"] = dp_shard_cp
                self._derived["dp_cp"] = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
                self._derived["hsdp"] = DeviceMesh._concatenate([mesh["dp_replicate"], dp_shard_cp])
            else:
                self._derived["hsdp"] = mesh["dp_replicate", "dp_shard"]
        self._mesh = mesh
        return mesh

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
