"""Parallel degrees -> validated, named DeviceMesh. The one mesh builder of the project."""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.config.manager import ConfigError

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    """The parallel degrees of a run and the mesh built from them.

    `dp_shard = -1` takes the ranks left over after the other degrees. The mesh always has
    the dims ("dp_replicate", "dp_shard", "tp"), some of size 1, plus the flattened "dp"
    (replicate x shard: ranks that see different data).

    Raises:
        ConfigError: when the degrees do not multiply to the world size.
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.dp_shard == -1:
            others = self.dp_replicate * self.tp
            if self.world_size % others:
                raise ConfigError(
                    f"data_parallel_replicate_degree {self.dp_replicate} x tensor_parallel_degree "
                    f"{self.tp} = {others} does not divide the world size {self.world_size}; "
                    "choose degrees whose product divides the number of processes."
                )
            self.dp_shard = self.world_size // others
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees multiply to {product} (data_parallel_replicate_degree "
                f"{self.dp_replicate} x data_parallel_shard_degree {self.dp_shard} x "
                f"tensor_parallel_degree {self.tp}) but the world size is {self.world_size}; make "
                "the product equal the number of processes, or set data_parallel_shard_degree = -1."
            )

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP (or HSDP) shards parameters over dp_shard."""
        return self.dp_shard > 1

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication: replicas but no sharding."""
        return self.dp_replicate > 1 and self.dp_shard == 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Create the named mesh (None for a single process) and flatten "dp"."""
        if self.world_size == 1:
            return None
        mesh = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=MESH_DIMS
        )
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def dp_group(self):
        """The process group of ranks that see different data; None for one process."""
        return None if self._mesh is None else self._mesh["dp"].get_group()

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (0 without a mesh)."""
        return 0 if self._mesh is None else self._mesh["dp"].get_local_rank()
