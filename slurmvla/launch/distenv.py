"""DistEnv: the one place that turns launcher variables into rank, world size and rendezvous;
SlurmJob: the one reader of the SLURM job itself (ids, node list, restarts, the derived port).

Each source is a table of variable names, read in one function, never parsed ad hoc elsewhere:

- torchrun (also inside a SLURM task, on the sbatch path: its variables win);
- a SLURM job step with one task per process (srun, and submitit, which runs srun): rank, local
  rank and node from ``SLURM_PROCID`` / ``SLURM_LOCALID`` / ``SLURM_NODEID``; ``MASTER_ADDR`` is the
  first host of the step's expanded node list, ``MASTER_PORT`` a function of the job id;
- nothing: the one-process debug mode.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from slurmvla.launch.nodelist import expand_nodelist

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


# One task per process under srun / submitit. Step variables first: they describe this srun step.
SLURM_VARS = {
    "rank": "SLURM_PROCID",
    "local_rank": "SLURM_LOCALID",
    "world_size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
    "node_rank": "SLURM_NODEID",
    "num_nodes": ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
}

# The job itself, the same for every task (SlurmJob). Step variables first for the node list.
SLURM_JOB_VARS = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "nodelist": ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "restart_count": "SLURM_RESTART_COUNT",
}

# Outside Linux's ephemeral range (32768-60999), so a derived port never collides with an
# outgoing connection's; distinct job ids on one node get distinct ports (up to 15000 apart).
PORT_BASE, PORT_SPAN = 15000, 15000


def derive_master_port(job_id: str | int, array_task: str | int | None = None) -> int:
    """A deterministic rendezvous port for a job (and array task): every task computes the same."""
    try:
        key = int(job_id) * 1009 + (int(array_task) if array_task not in (None, "") else 0)
    except ValueError:
        raise ValueError(f"SLURM job id {job_id!r} / array task {array_task!r} is not an integer") from None
    return PORT_BASE + key % PORT_SPAN


def _first(env: Mapping[str, str], names: str | tuple[str, ...]) -> tuple[str | None, str | None]:
    for name in (names,) if isinstance(names, str) else names:
        value = env.get(name)
        if value not in (None, ""):
            return name, value
    return None, None


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM job this process belongs to, read once; every tool and the trainer ask it.

    ``job_id`` is this allocation's own id (what ``scontrol requeue`` takes; an array task has its
    own). The rendezvous port is derived from the array's job id plus the task id where there is
    an array, else from the job id: one port per task, the same in every process of that task.
    """

    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    nodelist: str | None = None
    restart_count: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SlurmJob:
        env = os.environ if environ is None else environ
        values = {field: _first(env, names)[1] for field, names in SLURM_JOB_VARS.items()}
        raw = values.pop("restart_count") or "0"
        try:
            restarts = int(raw)
        except ValueError:
            raise ValueError(f"SLURM_RESTART_COUNT={raw!r} is not an integer") from None
        return cls(**values, restart_count=restarts)

    @property
    def in_job(self) -> bool:
        return self.job_id is not None

    @property
    def hosts(self) -> list[str]:
        return expand_nodelist(self.nodelist) if self.nodelist else []

    @property
    def master_addr(self) -> str | None:
        """The first host of the node list (never the launch node's own address)."""
        hosts = self.hosts
        return hosts[0] if hosts else None

    @property
    def master_port(self) -> int | None:
        key = self.array_job_id or self.job_id
        return None if key is None else derive_master_port(key, self.array_task_id)


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
        # A SLURM job step (srun): SLURM_STEP_ID is set in tasks started by srun, not in the batch
        # script itself, where SLURM_NTASKS may say 8 while only one process runs.
        if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
            return cls._from_slurm(env, source="submitit" if "SUBMITIT_EXECUTOR" in env else "slurm")
        return cls()

    @classmethod
    def _from_slurm(cls, env: Mapping[str, str], source: str) -> DistEnv:
        def get(field: str) -> str:
            name, value = _first(env, SLURM_VARS[field])
            if value is None:
                raise ValueError(f"{source}: {SLURM_VARS[field]} is not set (needed for {field})")
            return value

        def as_int(field: str) -> int:
            raw = get(field)
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{source}: {SLURM_VARS[field]}={raw!r} is not an integer (read as {field})") from None

        world, nodes = as_int("world_size"), as_int("num_nodes")
        if world % nodes:
            raise ValueError(f"{source}: {world} tasks on {nodes} nodes is not the same number per node; "
                             "slurmvla needs --ntasks-per-node (or tasks_per_node) to be uniform")
        job = SlurmJob.from_environ(env)
        for field in ("nodelist", "job_id"):
            if getattr(job, field) is None:
                raise ValueError(f"{source}: {SLURM_JOB_VARS[field]} is not set (needed for {field})")
        hosts = job.hosts
        if len(hosts) != nodes:
            raise ValueError(f"{source}: node list {job.nodelist!r} has {len(hosts)} hosts for {nodes} nodes")
        port = env.get("MASTER_PORT") or job.master_port
        rank = as_int("rank")
        if not 0 <= rank < world:
            raise ValueError(f"{source}: rank {rank} is outside world size {world}")
        return cls(
            rank=rank, local_rank=as_int("local_rank"), world_size=world, local_world_size=world // nodes,
            node_rank=as_int("node_rank"), num_nodes=nodes,
            master_addr=env.get("MASTER_ADDR") or hosts[0], master_port=int(port), source=source,
        )

    def exports(self) -> dict[str, str]:
        """The variables a process of this job should see (torchrun's names, plus NNODES / NODE_RANK)."""
        return {
            "RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size), "NODE_RANK": str(self.node_rank),
            "NNODES": str(self.num_nodes), "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
        }

    def export_to(self, environ: dict[str, str] | None = None) -> list[str]:
        """Set the exports where unset; a variable already set keeps its value. Returns the
        names whose existing value differs, so the caller can say so instead of hiding it."""
        env = os.environ if environ is None else environ
        kept = []
        for name, value in self.exports().items():
            if name not in env:
                env[name] = value
            elif env[name] != value:
                kept.append(f"{name}={env[name]} (derived: {value})")
        return kept

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
