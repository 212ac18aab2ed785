"""DistEnv: the one place that turns launcher variables into rank, world size and rendezvous.

Each source is a table of variable names, read in one function, never parsed ad hoc elsewhere.
This file knows torchrun and the one-process debug mode; SLURM and submitit tables sit beside them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# torchrun (and any launcher that follows its convention) exports these for every worker.
TORCHRUN_VARS = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK",
    "world_size": "WORLD_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "node_rank": "GROUP_RANK",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
}


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "local"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls._from_table(env, TORCHRUN_VARS, source="torchrun")
        return cls()

    @classmethod
    def _from_table(cls, env: Mapping[str, str], table: Mapping[str, str], source: str) -> DistEnv:
        def get_int(field: str, default: int) -> int:
            name = table[field]
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer (read as {field} from {source})") from None

        world_size = get_int("world_size", 1)
        rank = get_int("rank", 0)
        local_rank = get_int("local_rank", 0)
        local_world_size = get_int("local_world_size", world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size} (from {source})")
        if local_world_size < 1 or world_size % local_world_size:
            raise ValueError(
                f"local world size {local_world_size} does not divide world size {world_size} (from {source})"
            )
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=get_int("node_rank", rank // local_world_size),
            num_nodes=world_size // local_world_size,
            master_addr=env.get(table["master_addr"], "127.0.0.1"),
            master_port=get_int("master_port", 29500),
            source=source,
        )
