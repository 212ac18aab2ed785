"""The step-time and scaling model (slurmvla/planner/network.py, scaling.py) and its command line: the ring and tree
costs as docs/plan.md states them, a cluster file, the overlap each engine schedules, and the table that
``python -m slurmvla.plan --nodes 1,2,...`` prints and ``--json`` keeps. No process group: the collectives
themselves are held to real runs in test_comms.py."""

from __future__ import annotations

import json

import pytest

from slurmvla import plan
from slurmvla.compose import compose
from slurmvla.planner import PlanError
from slurmvla.planner.comms import Collective, CommOptions, layout_of, step_collectives
from slurmvla.planner.network import NETWORKS, collective_seconds, load_network, placement
from slurmvla.planner.scaling import Segment, simulate

H100 = NETWORKS["h100-sxm-ib400"]
ZERO3_REGATHER = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                  "stage3_max_reuse_distance": 0}


def test_ring_all_reduce_within_a_node():
    t = collective_seconds("all_reduce", 10**9, placement("world", 8, 8, 8, 8), H100)
    assert t["link"] == "nvlink"
    assert t["bandwidth"] == pytest.approx(2 * 7 / 8 * 1e9 / (450e9 * 0.8))
    assert t["latency"] == pytest.approx((10 + 2 * 7 * 1.0) * 1e-6)


def test_across_nodes_the_nodes_nics_carry_a_world_group_and_the_tree_shortens_its_latency():
    t = collective_seconds("all_reduce", 10**9, placement("world", 16, 16, 8, 16), H100)
    # bus bandwidth: min(NVLink 450 x 0.8, 8 NICs x 50 GB/s x 0.9 / 8 GPUs x 8 ranks a node)
    assert t["link"] == "network" and t["bandwidth"] == pytest.approx(2 * 15 / 16 * 1e9 / 360e9)
    # ring: 30 steps x 5 us; tree: 2 x log2(2) network hops + 2 x 7 NVLink hops
    assert t["latency"] == pytest.approx((10 + 2 * 5 + 2 * 7) * 1e-6)
    ag = collective_seconds("all_gather", 10**9, placement("world", 16, 16, 8, 16), H100)
    assert ag["bandwidth"] == pytest.approx(15 / 16 * 1e9 / 360e9) and ag["latency"] == pytest.approx((10 + 15 * 5) * 1e-6)


def test_replica_groups_share_the_nodes_nics():
    """HSDP sharded within a node: 8 replica groups, one rank a node each: each gets one NIC's share."""
    where = placement("replicate", 4, 32, 8, 8)
    assert (where.n, where.per_node, where.nodes) == (4, 1, 4)
    t = collective_seconds("all_reduce", 10**9, where, H100)
    assert t["bandwidth"] == pytest.approx(2 * 3 / 4 * 1e9 / (50e9 * 0.9))
    # shard degree 4 on 8-GPU nodes: two ranks of each replica group per node
    assert placement("replicate", 8, 32, 8, 4).per_node == 2


def test_a_group_of_one_costs_nothing():
    assert collective_seconds("all_reduce", 10**9, placement("replicate", 1, 8, 8, 8), H100) == \
        {"bandwidth": 0.0, "latency": 0.0, "link": "none"}


def test_a_cluster_file_takes_a_preset_and_overrides(tmp_path):
    f = tmp_path / "ours.yaml"
    f.write_text("base: h100-sxm-ib400\nnics_per_node: 4\nnic_gbps: 25\n")
    net = load_network(str(f))
    assert net.name == "h100-sxm-ib400" and net.nics_per_node == 4 and net.nic_gbps == 25 and net.intra_gbps == 450
    g = tmp_path / "full.json"
    g.write_text(json.dumps({"name": "lab", "gpus_per_node": 4, "gpu": "a100-40gb", "intra_gbps": 300,
                             "intra_latency_us": 1, "nics_per_node": 1, "nic_gbps": 12.5, "inter_latency_us": 8}))
    assert load_network(str(g)).node_network_gbps == 12.5


@pytest.mark.parametrize("text, words", [
    ("base: h100-sxm-ib400\nnic_gbs: 25\n", "unknown field 'nic_gbs'"),
    ("gpus_per_node: 8\n", "missing field"),
    ("base: h100-sxm-ib400\nnic_gbps: 0\n", "nic_gbps=0 is not valid"),
    ("base: h100-sxm-ib400\ninter_efficiency: 2\n", "inter_efficiency=2 is not valid"),
    ("base: dgx\n", "base=dgx is not a preset"),
    ("base: h100-sxm-ib400\ngpu: h100\n", "gpu=h100 is not a GPU"),
    ("[1, 2", "not valid YAML"),
])
def test_a_bad_cluster_file_is_one_line_naming_the_value(tmp_path, text, words):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(PlanError) as e:
        load_network(str(f))
    assert words in str(e.value) and len(str(e.value).splitlines()) == 1


def _timeline(comm_s: float) -> dict:
    segments = [Segment("forward unit 0", 0, 1.0), Segment("backward unit 0", 0, 1.0), Segment("backward root", 0, 1.0)]
    bucket = Collective("backward", "all_reduce", 8, "world", "float32", 1, after="backward unit 0", before="step")
    return simulate(segments, 0.5, [bucket], lambda c: (comm_s, "network"))


def test_a_reduction_hides_behind_the_backward_that_follows_it():
    hidden, exposed = _timeline(0.8), _timeline(1.5)
    assert hidden["step_s"] == pytest.approx(3.5) and hidden["exposed_s"]["network"] == 0
    assert exposed["step_s"] == pytest.approx(4.0) and exposed["exposed_s"]["network"] == pytest.approx(0.5)


def test_a_gather_is_prefetched_one_segment_ahead_and_the_first_waits():
    segments = [Segment("forward root", 0, 1.0), Segment("forward unit 0", 0, 1.0)]
    gathers = [Collective("forward", "all_gather", 8, "world", "bfloat16", 1, before="forward root"),
               Collective("forward", "all_gather", 8, "world", "bfloat16", 1, before="forward unit 0")]
    t = simulate(segments, 0.0, gathers, lambda c: (0.5, "nvlink"))
    # the root's gather is exposed (0.5); unit 0's starts with the root's compute, at 0.5, and ends at 1.0: hidden
    assert t["step_s"] == pytest.approx(2.5) and t["exposed_s"]["nvlink"] == pytest.approx(0.5)


def test_zero3_moves_one_and_a_half_times_what_ddp_does():
    """The ZeRO paper's figure: DDP's all-reduce moves 2x the parameters (reduce-scatter + all-gather); ZeRO-3
    gathers them in forward and again in backward and reduce-scatters the gradients: 3x. Here when nothing is
    persistent, nothing prefetched and nothing kept from forward to backward (stage3_max_reuse_distance=0; a
    model far larger than the reuse distance and the live-parameter budget gets there with the defaults), in fp32.
    (With the defaults and a small model the coordinator keeps every parameter from forward to backward: 1x.)"""
    cfg = compose(["engine=zero3"])
    layout = layout_of(cfg)

    def traffic(collectives: list[Collective]) -> float:
        return sum(c.bytes * (2 if c.kind == "all_reduce" else 1) for c in collectives if c.bytes > 8)

    zero3 = step_collectives(cfg, layout, 8, 8, CommOptions(zero=ZERO3_REGATHER))
    ddp = step_collectives(compose(["engine=ddp"]), layout, 8, 8)
    assert traffic(zero3) / traffic(ddp) == pytest.approx(1.5, rel=0.01)


def test_the_scaling_table_prints_and_json_keeps_it(tmp_path, capsys):
    out = tmp_path / "s.json"
    plan.main(["precision=bf16", "trainer.global_batch_size=16", "--nodes", "1,2", "--gpu", "a100-80gb",
               "--json", str(out)])
    text = capsys.readouterr().out
    assert text.startswith("ESTIMATE, not a measurement") and "a100-sxm-ib200" in text and "recommended at 2 node(s)" in text
    data = json.loads(out.read_text())
    t = data["scaling"]
    assert data["network"]["name"] == "a100-sxm-ib200" and t["micro_batch_size"] == 2 and t["nodes"] == [1, 2]
    engines = {(r["engine"], r["nodes"]) for r in t["rows"]}
    for name in ("ddp", "fsdp_full", "fsdp_grad_op", "hsdp", "zero1", "zero2", "zero3"):
        assert {(name, 1), (name, 2)} <= engines
    for r in t["rows"]:
        assert r["global_batch_size"] == 2 * r["world_size"] and r["step_s"] >= r["compute_s"] > 0
        assert r["bottleneck"] and r["scaling_efficiency"] is not None
    assert sum(r.get("recommended", False) for r in t["rows"]) == 2
    assert set(t["recommended"]) == {"1", "2"} or set(t["recommended"]) == {1, 2}


@pytest.mark.parametrize("argv, words", [
    (["--nodes", "1,x"], "--nodes 1,x is not valid"),
    (["--nodes", "0"], "--nodes 0 is not valid"),
    (["--nodes", "1,2", "--network", "dgx"], "--network dgx is neither a preset nor a file"),
    (["--nodes", "1,2", "--gpu", "rtx4090-24gb"], "no network preset has its nodes"),
])
def test_scaling_mistakes_are_one_line(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        plan.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and words in err, err
