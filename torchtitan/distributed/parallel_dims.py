"""Parallel degrees -> validated, named DeviceMesh. The one mesh builder of the project."""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.config.manager import ConfigError


@dataclass
class ParallelDims:
    """Data-parallel degrees of a run and the mesh built from them.

    `dp_shard = -1` takes the ranks left over after the other degrees. Dims of degree 1 are
    left out of the mesh; `dp` (replicate x shard, flattened) is always available once built.
    """

    dp_replicate: int
    dp_shard: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.dp_shard == -1:
            if self.world_size % self.dp_replicate:
                raise ConfigError(
                    f"'parallelism.data_parallel_replicate_degree' = {self.dp_replicate} does "
                    f"not divide the world size {self.world_size}."
                )
            self.dp_shard = self.world_size // self.dp_replicate
        product = self.dp_replicate * self.dp_shard
        if product != self.world_size:
            raise ConfigError(
                f"parallel degrees multiply to {product} (data_parallel_replicate_degree "
                f"{self.dp_replicate} x data_parallel_shard_degree {self.dp_shard}) but the "
                f"world size is {self.world_size}; make the product equal the number of "
                "processes, or set data_parallel_shard_degree = -1."
            )

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard == 1

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The named mesh ("dp_replicate", "dp_shard", flattened "dp"); None for one process."""
        if self.world_size == 1:
            return None
        names = ("dp_replicate", "dp_shard")
        mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=names)
        mesh[names]._flatten("dp")
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (0 without a mesh)."""
        return 0 if self._mesh is None else self._mesh["dp"].get_local_rank()
