"""``workers.torchrun_group`` and ``workers.network``: torchrun's environment, device maps for CUDA stages
across hosts (their options only: this runs on CPU), interface naming; and the group on one host."""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT
from workers import network
from workers.group import GroupEnv, stage_devices
from workers.options import backend_options

TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500",
                "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def group(rank: int, world_size: int = 4, local_world_size: int = 2) -> GroupEnv:
    return GroupEnv(rank=rank, world_size=world_size, master_addr="10.1.2.3", master_port=29500,
                    local_rank=rank % local_world_size, local_world_size=local_world_size)


# -- torchrun's environment ----------------------------------------------------------------------------
def test_group_reads_torchrun_environment():
    g = GroupEnv.from_environ(TORCHRUN_ENV)
    assert (g.rank, g.world_size, g.master_addr, g.master_port, g.local_rank, g.local_world_size) == (
        1, 4, "10.1.2.3", 29500, 1, 2)
    assert g.name == "worker1" and group(0).name == "driver"
    assert g.stage_workers == ["worker1", "worker2", "worker3"]


def test_group_names_what_is_missing_or_wrong():
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT.*torchrun"):
        GroupEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(RuntimeError, match="at least one stage worker"):
        GroupEnv.from_environ(dict(TORCHRUN_ENV, RANK="0", WORLD_SIZE="1"))
    with pytest.raises(RuntimeError, match="RANK 4 is outside WORLD_SIZE 4"):
        GroupEnv.from_environ(dict(TORCHRUN_ENV, RANK="4"))


# -- device maps -----------------------------------------------------------------------------------------
def test_cpu_stages_need_no_devices_or_maps():
    assert stage_devices(group(1), None) == (None, {})
    assert stage_devices(group(0), "cuda") == (None, {})  # the driver keeps its tensors on the CPU


def test_cuda_on_local_rank_maps_each_worker_to_every_later_one():
    # 2 nodes x 2 processes: ranks 0, 1 on node 0 (cuda:0 unused by the driver, cuda:1), ranks 2, 3 on node 1.
    # Activations go to the next worker, skips straight to any later one: each needs a map.
    assert stage_devices(group(1), "cuda") == (["cuda:1"], {"worker2": {"cuda:1": "cuda:0"},
                                                           "worker3": {"cuda:1": "cuda:1"}})
    assert stage_devices(group(2), "cuda") == (["cuda:0"], {"worker3": {"cuda:0": "cuda:1"}})
    assert stage_devices(group(3), "cuda") == (["cuda:1"], {})  # the last stage sends to the driver on the CPU


def test_cuda_wraps_around_the_gpus_of_a_node():
    # One node, one GPU, three processes (a laptop or a one-GPU box): both stage workers on cuda:0.
    one_gpu = [dataclasses.replace(group(r, world_size=3, local_world_size=3), gpus_per_node=1) for r in range(3)]
    assert [one_gpu[0].cuda_device(r) for r in (1, 2)] == ["cuda:0", "cuda:0"]
    assert stage_devices(one_gpu[1], "cuda") == (["cuda:0"], {"worker2": {"cuda:0": "cuda:0"}})
    assert stage_devices(one_gpu[2], "cuda") == (["cuda:0"], {})
    # Two GPUs, four processes per node: ranks 1, 2, 3 on cuda:1, cuda:0, cuda:1.
    two_gpus = dataclasses.replace(group(1, local_world_size=4), gpus_per_node=2)
    assert [two_gpus.cuda_device(r) for r in (1, 2, 3)] == ["cuda:1", "cuda:0", "cuda:1"]
    no_gpu = dataclasses.replace(group(1), gpus_per_node=0)
    with pytest.raises(RuntimeError, match="rank 1 on a GPU, but this node \\(worker1\\) sees no CUDA device"):
        stage_devices(no_gpu, "cuda")
    assert stage_devices(no_gpu, None) == (None, {})


def test_group_counts_the_gpus_of_its_node():
    assert GroupEnv.from_environ(TORCHRUN_ENV).gpus_per_node == torch.cuda.device_count()


def test_one_device_per_stage_worker_like_pipe_devices():
    devices = ["cuda:0", "cpu", "cuda:3"]
    assert stage_devices(group(1), devices) == (["cuda:0"], {"worker3": {"cuda:0": "cuda:3"}})  # none to the CPU
    assert stage_devices(group(2), devices) == (None, {})
    assert stage_devices(group(3), devices) == (["cuda:3"], {})
    assert stage_devices(group(1), ["cuda:0", "cuda:2", "cuda:1"]) == (
        ["cuda:0"], {"worker2": {"cuda:0": "cuda:2"}, "worker3": {"cuda:0": "cuda:1"}})
    with pytest.raises(ValueError, match="2 entries for 3 stage workers"):
        stage_devices(group(1), ["cuda:0", "cuda:1"])
    with pytest.raises(ValueError, match="None, 'cuda' or one device per stage worker"):
        stage_devices(group(1), "cuda:0")


def test_explicit_device_maps_are_keyed_by_the_sender():
    maps = {"worker1": {"worker3": {"cuda:1": "cuda:1"}, "worker2": {"cuda:1": "cuda:1"}},
            "worker2": {"worker3": {"cuda:0": "cuda:0"}}}
    devices, mine = stage_devices(group(1), "cuda", maps)
    assert devices == ["cuda:1"]
    assert mine == {"worker2": {"cuda:1": "cuda:1"}, "worker3": {"cuda:1": "cuda:1"}}  # overrides the derived one
    # worker2 sends from cuda:0 and receives worker1's tensors on cuda:1: TensorPipe wants both listed
    assert stage_devices(group(2), None, maps) == (["cuda:0", "cuda:1"], {"worker3": {"cuda:0": "cuda:0"}})


def test_overrides_list_every_device_a_worker_sends_from():
    devices, maps = stage_devices(group(1), "cuda", {"worker1": {"worker2": {"cuda:0": "cuda:1"}}})
    assert maps["worker2"] == {"cuda:1": "cuda:0", "cuda:0": "cuda:1"}
    assert devices == ["cuda:0", "cuda:1"]


def test_device_spellings_are_normalised():
    # "cpu:0" is the CPU (no maps), a bare "cuda" is cuda:0
    assert stage_devices(group(1), ["cuda", "cpu:0", "cuda:1"]) == (["cuda:0"], {"worker3": {"cuda:0": "cuda:1"}})
    assert stage_devices(group(2), ["cuda", "cpu:0", "cuda:1"]) == (None, {})


def test_device_plan_reaches_tensorpipe_options():
    devices, maps = stage_devices(group(1), "cuda")
    options = backend_options(devices=devices, device_maps=maps, rpc_timeout=9)
    assert options.devices == [torch.device("cuda:1")]
    assert options.device_maps == {"worker2": {torch.device("cuda:1"): torch.device("cuda:0")},
                                   "worker3": {torch.device("cuda:1"): torch.device("cuda:1")}}
    assert options.rpc_timeout == 9


# -- interfaces --------------------------------------------------------------------------------------------
TABLE = {"lo": ["127.0.0.1", "::1"], "eth0": ["192.0.2.7"], "ib0": ["198.51.100.9", "fe80::1"]}


def test_interface_by_name_or_by_address():
    assert network.resolve_interface("eth0", TABLE) == "eth0"
    assert network.resolve_interface("198.51.100.9", TABLE) == "ib0"
    assert network.resolve_interface("fe80:0::1", TABLE) == "ib0"
    with pytest.raises(ValueError, match=r"no network interface 'eth9'.*eth0 \(192.0.2.7\)"):
        network.resolve_interface("eth9", TABLE)
    with pytest.raises(ValueError, match="no interface of this host has the address 192.0.2.8"):
        network.resolve_interface("192.0.2.8", TABLE)


def test_this_hosts_interfaces_and_the_route_to_loopback():
    table = network.interfaces()
    assert "127.0.0.1" in table["lo"]
    assert network.route_interface("127.0.0.1") == "lo"  # a UDP connect: picks the route, sends nothing
    assert network.is_loopback("127.0.0.1") and network.is_loopback("localhost") and network.is_loopback("::1")
    assert not network.is_loopback("10.77.0.1") and not network.is_loopback("node0")


@pytest.fixture
def clean_ifname(monkeypatch):
    for var in network.IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_loopback_master_binds_lo_and_an_explicit_interface_wins(clean_ifname):
    assert network.configure_interface(None, "127.0.0.1", who="test") == "lo"
    assert os.environ["TP_SOCKET_IFNAME"] == os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    clean_ifname.setenv("TP_SOCKET_IFNAME", "eth0")
    assert network.configure_interface("127.0.0.1", "10.1.2.3", who="test") == "lo"  # an address names lo
    assert os.environ["TP_SOCKET_IFNAME"] == "lo"


def test_remote_master_keeps_the_environments_interface(clean_ifname):
    clean_ifname.setenv("TP_SOCKET_IFNAME", "lo")
    assert network.configure_interface(None, "10.1.2.3", who="test") == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_remote_master_without_interface_warns_and_leaves_the_choice_to_tensorpipe(clean_ifname, caplog):
    with caplog.at_level(logging.WARNING, logger="rrefpipe.workers"):
        assert network.configure_interface(None, "10.77.0.1", who="rank 3 (worker3)") is None
    assert "TP_SOCKET_IFNAME" not in os.environ and "GLOO_SOCKET_IFNAME" not in os.environ
    assert "rank 3 (worker3): no network interface named and MASTER_ADDR 10.77.0.1 is not loopback" in caplog.text


def test_worker_cli_rejects_an_unknown_interface(clean_ifname):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "workers", "--rank", "1", "--world-size", "2", "--master-port", "1",
                           "--interface", "nosuch0"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode != 0
    assert "python -m workers: no network interface 'nosuch0' on this host; it has: " in proc.stderr
    assert "lo (127.0.0.1" in proc.stderr


# -- the group on one host ----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_example_script_under_torchrun_on_one_host():
    """``examples/multihost.py`` under ``torchrun --standalone``: rank 0 drives two stage workers on
    loopback, matches plain PyTorch, and every rank exits 0 (the workers when the driver stops them)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           "examples/multihost.py", "--steps", "5"], capture_output=True, text=True, timeout=110,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("stages:") == 1  # the driver's code ran once, on rank 0
    line = [x for x in proc.stdout.splitlines() if x.startswith("plain PyTorch, same seed")][0]
    assert float(line.rsplit("largest parameter difference ", 1)[1].rstrip(")")) < 1e-4, line


# -- replicas (data parallel) ------------------------------------------------------------------------------
def replicated(rank: int, layout: str, world_size: int = 6, replicas: int = 2) -> GroupEnv:
    return dataclasses.replace(group(rank, world_size=world_size, local_world_size=3), replicas=replicas,
                               layout=layout)


def test_replica_layout_keeps_each_replicas_ranks_together():
    places = [replicated(k, "replica").place_of(k) for k in range(6)]
    assert places == [(0, -1), (0, 0), (0, 1), (1, -1), (1, 0), (1, 1)]
    names = [replicated(0, "replica").name_of(k) for k in range(6)]
    assert names == ["driver", "worker1", "worker2", "driver1", "worker4", "worker5"]
    assert replicated(4, "replica").driver == "driver1"
    assert replicated(3, "replica").stage_workers == ["worker4", "worker5"]
    assert replicated(0, "replica").stage_workers == ["worker1", "worker2"]  # replica 0 keeps today's names


def test_stage_layout_puts_the_drivers_first_then_each_stage_of_every_replica():
    places = [replicated(k, "stage").place_of(k) for k in range(6)]
    assert places == [(0, -1), (1, -1), (0, 0), (1, 0), (0, 1), (1, 1)]
    g = replicated(1, "stage")
    assert g.name == "driver1" and g.stage_workers == ["worker3", "worker5"]
    assert [g.rank_of(r, p) for r in range(2) for p in (-1, 0, 1)] == [0, 2, 4, 1, 3, 5]
    # two nodes of 3 processes: replica 0's stages (ranks 2, 4) on different nodes
    assert {2 // 3, 4 // 3} == {0, 1}


def test_one_replica_is_the_group_as_before():
    g = group(2)
    assert (g.replicas, g.name, g.driver, g.stage_workers) == (1, "worker2", "driver",
                                                              ["worker1", "worker2", "worker3"])


def test_replicas_must_split_the_job():
    with pytest.raises(ValueError, match="WORLD_SIZE 5 does not split into replicas=2 .* a multiple of 2"):
        GroupEnv.from_environ(dict(TORCHRUN_ENV, WORLD_SIZE="5"), replicas=2)
    with pytest.raises(ValueError, match="WORLD_SIZE 4 does not split into replicas=4"):
        GroupEnv.from_environ(TORCHRUN_ENV, replicas=4)  # a driver alone is no pipeline
    with pytest.raises(ValueError, match="layout must be one of"):
        GroupEnv.from_environ(TORCHRUN_ENV, replicas=2, layout="ring")
    with pytest.raises(ValueError, match="replicas must be a positive int"):
        GroupEnv.from_environ(TORCHRUN_ENV, replicas=0)


def test_device_maps_stay_within_a_replica():
    g = dataclasses.replace(replicated(4, "replica"), gpus_per_node=None)
    own, maps = stage_devices(g, ["cuda:0", "cuda:1"])
    assert own == ["cuda:0"] and maps == {"worker5": {"cuda:0": "cuda:1"}}  # not worker1/worker2 of replica 0
    with pytest.raises(ValueError, match="devices has 3 entries for 2 stage workers per replica"):
        stage_devices(g, ["cuda:0", "cuda:1", "cuda:2"])


def test_nccl_only_where_each_stage_worker_of_a_node_has_its_own_gpu():
    from workers.group import _collective_backend

    def node(rank: int, world: int, per_node: int, gpus: int, replicas: int) -> GroupEnv:
        return dataclasses.replace(group(rank, world_size=world, local_world_size=per_node), gpus_per_node=gpus,
                                   replicas=replicas)

    assert _collective_backend(node(1, 9, 9, 8, 1), "cuda") == "cpu:gloo,cuda:nccl"  # 8 stages, 8 GPUs, 1 driver
    assert _collective_backend(node(1, 6, 6, 1, 2), "cuda") == "gloo"  # one GPU for every stage worker
    assert _collective_backend(node(4, 6, 3, 2, 2), "cuda") == "cpu:gloo,cuda:nccl"  # a replica per 2-GPU node
    assert _collective_backend(node(1, 6, 6, 4, 2), ["cuda:0", "cuda:0"]) == "gloo"  # named devices shared
    assert _collective_backend(node(1, 6, 6, 4, 2), None) == "gloo"  # CPU stages
