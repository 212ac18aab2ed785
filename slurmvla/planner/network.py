"""How long a collective takes on a cluster's links: a bandwidth / latency table per link (NVLink within a node,
the network across nodes), presets for common GPU nodes and a file a user writes for theirs, and the
alpha-beta cost of ring and tree algorithms. Every figure is an ESTIMATE; docs/plan.md ("Step time and
scaling") states the model and its assumptions, and benchmarks/comm_calibration.py measures the CPU's own gloo
links to check it where something can be measured.

Cost of one collective on a group of n ranks, g of them on each of the N nodes it spans (S the full buffer's
bytes):

* bandwidth: all-reduce 2 (n-1)/n x S / B, all-gather and reduce-scatter (n-1)/n x S / B, broadcast S / B;
  B the bus bandwidth: the NVLink rate within one node; across nodes the smaller of the NVLink rate and what the
  group's g ranks per node get of the node's network (g x the node's NIC bandwidth / GPUs per node: NCCL runs one
  ring per NIC, rail-aligned, so a node's NICs carry a world group's traffic together, and the G / g groups that
  share a node, e.g. HSDP's replica groups, share them);
* latency: a launch cost, plus per ring step the link's latency (2 (n-1) steps for an all-reduce, n-1 for the
  others); an all-reduce across nodes takes NCCL's tree instead where that is shorter (2 log2 N network hops +
  2 (g-1) NVLink hops);
* a group of one costs nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from slurmvla.planner import PlanError


@dataclass(frozen=True)
class Network:
    name: str
    gpus_per_node: int
    # The GPU these nodes carry (a key of slurmvla.planner.gpus.GPUS), the default --gpu with this network.
    gpu: str
    # Within a node, per GPU and direction (GB/s, 1e9 bytes) and per ring step (microseconds).
    intra_gbps: float
    intra_latency_us: float
    # Across nodes: NICs per node, each NIC's rate per direction (GB/s), and per network hop (microseconds).
    nics_per_node: int
    nic_gbps: float
    inter_latency_us: float
    # Fixed cost of launching one collective (microseconds).
    launch_us: float = 10.0
    # Fraction of the link rates a collective's bandwidth term reaches (protocol overhead, NCCL's achieved
    # bus bandwidth against the links' nominal rates).
    intra_efficiency: float = 0.8
    inter_efficiency: float = 0.9
    source: str = ""

    @property
    def node_network_gbps(self) -> float:
        return self.nics_per_node * self.nic_gbps

    def describe(self) -> str:
        return (f"{self.name}: {self.gpus_per_node} x {self.gpu}, NVLink {self.intra_gbps:g} GB/s per GPU and direction "
                f"(x{self.intra_efficiency:g}), {self.nics_per_node} x {self.nic_gbps:g} GB/s network per node "
                f"(x{self.inter_efficiency:g}); latency {self.intra_latency_us:g} us per NVLink step, "
                f"{self.inter_latency_us:g} us per network hop, {self.launch_us:g} us per collective")


# NVLink per direction: NVLink 4 (H100 / H200 SXM) 900 GB/s bidirectional per GPU, NVLink 3 (A100 SXM) 600 (NVIDIA
# datasheets); NICs: ConnectX-7 400 Gb/s = 50 GB/s, HDR 200 Gb/s = 25 GB/s, one per GPU (DGX H100 / DGX A100).
# Latencies and efficiencies are the model's assumptions (of the order NCCL's own tuning model uses), stated in
# docs/plan.md; a file for a cluster overrides any of them.
NETWORKS: dict[str, Network] = {n.name: n for n in (
    Network("h100-sxm-ib400", 8, "h100-80gb", 450.0, 1.0, 8, 50.0, 5.0,
            source="8 x H100 SXM, NVLink 4 (900 GB/s bidirectional), 8 x 400 Gb/s InfiniBand (DGX H100)"),
    Network("h200-sxm-ib400", 8, "h200-141gb", 450.0, 1.0, 8, 50.0, 5.0,
            source="8 x H200 SXM, NVLink 4 (900 GB/s bidirectional), 8 x 400 Gb/s InfiniBand"),
    Network("a100-sxm-ib200", 8, "a100-80gb", 300.0, 1.0, 8, 25.0, 5.0,
            source="8 x A100 SXM, NVLink 3 (600 GB/s bidirectional), 8 x 200 Gb/s InfiniBand (DGX A100)"),
)}


def load_network(spec: str) -> Network:
    """A preset's name, or a YAML / JSON file of a Network's fields (``name``, ``gpus_per_node``, ``gpu``,
    ``intra_gbps``, ``intra_latency_us``, ``nics_per_node``, ``nic_gbps``, ``inter_latency_us``; optional
    ``launch_us``, ``intra_efficiency``, ``inter_efficiency``, ``source``; ``base: PRESET`` takes a preset's
    values first). A PlanError, one line, for anything else."""
    if spec in NETWORKS:
        return NETWORKS[spec]
    path = Path(spec)
    if not path.is_file():
        raise PlanError(f"--network {spec} is neither a preset nor a file; choose one of {list(NETWORKS)} or write a "
                        "YAML / JSON file of a Network's fields (docs/plan.md)")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - the parser's own words, on one line
        raise PlanError(f"--network {spec}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                        f"{str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise PlanError(f"--network {spec}: expected a mapping of fields, got {type(data).__name__}")
    return network_from(dict(data), spec)


def network_from(data: dict[str, Any], where: str = "network") -> Network:
    known = {f.name: f for f in fields(Network)}
    base = data.pop("base", None)
    values: dict[str, Any] = {}
    if base is not None:
        if base not in NETWORKS:
            raise PlanError(f"{where}: base={base} is not a preset; choose one of {list(NETWORKS)}")
        values = asdict(NETWORKS[base])
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise PlanError(f"{where}: unknown field {unknown[0]!r}; the fields are {list(known)}")
    values.update(data)
    values.setdefault("name", Path(where).stem)
    missing = [k for k, f in known.items() if k not in values and f.default is MISSING]
    values.update({k: f.default for k, f in known.items() if k not in values and f.default is not MISSING})
    if missing:
        raise PlanError(f"{where}: missing field {missing[0]!r} (or base: one of {list(NETWORKS)})")
    from slurmvla.planner.gpus import GPUS

    if values["gpu"] not in GPUS:
        raise PlanError(f"{where}: gpu={values['gpu']} is not a GPU the planner knows; choose one of {list(GPUS)}")
    for key in ("gpus_per_node", "nics_per_node"):
        if not isinstance(values[key], int) or values[key] < 1:
            raise PlanError(f"{where}: {key}={values[key]} is not valid; it must be an integer >= 1")
    for key in ("intra_gbps", "nic_gbps"):
        if not isinstance(values[key], (int, float)) or values[key] <= 0:
            raise PlanError(f"{where}: {key}={values[key]} is not valid; it must be a number > 0 (GB/s)")
    for key in ("intra_latency_us", "inter_latency_us", "launch_us"):
        if not isinstance(values[key], (int, float)) or values[key] < 0:
            raise PlanError(f"{where}: {key}={values[key]} is not valid; it must be a number >= 0 (microseconds)")
    for key in ("intra_efficiency", "inter_efficiency"):
        if not isinstance(values[key], (int, float)) or not 0 < values[key] <= 1:
            raise PlanError(f"{where}: {key}={values[key]} is not valid; it must be in (0, 1]")
    return Network(**{k: values[k] for k in known if k in values})


@dataclass(frozen=True)
class Placement:
    """A group's ranks on the nodes: n in all, g on each of the nodes it spans."""

    n: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, self.n // self.per_node)


def placement(span: str, group: int, world: int, gpus_per_node: int, shard: int) -> Placement:
    """Where a group's ranks are, ranks numbered node by node: the world and FSDP's shard group take consecutive
    ranks; HSDP's replica group takes every shard-th rank."""
    if span == "replicate":
        per_node = max(1, gpus_per_node // shard) if shard < gpus_per_node else 1
    else:
        per_node = min(group, gpus_per_node)
    return Placement(group, max(1, min(per_node, group)))


def collective_seconds(kind: str, nbytes: int, where: Placement, net: Network) -> dict[str, float]:
    """{"bandwidth": s, "latency": s, "link": "nvlink" | "network" | "none"} of one collective."""
    n = where.n
    if n <= 1:
        return {"bandwidth": 0.0, "latency": 0.0, "link": "none"}
    g, nodes = where.per_node, where.nodes
    intra = net.intra_gbps * net.intra_efficiency * 1e9
    if nodes == 1:
        bus, link, step = intra, "nvlink", net.intra_latency_us
    else:
        share = g * net.node_network_gbps / net.gpus_per_node * net.inter_efficiency * 1e9
        bus, link, step = min(intra, share), "network", net.inter_latency_us
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "broadcast": 1.0}[kind]
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    latency = steps * step
    if kind == "all_reduce" and nodes > 1:
        tree = 2 * math.ceil(math.log2(nodes)) * net.inter_latency_us + 2 * (g - 1) * net.intra_latency_us
        latency = min(latency, tree)
    return {"bandwidth": factor * nbytes / bus, "latency": (net.launch_us + latency) * 1e-6, "link": link}
