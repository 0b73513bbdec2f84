import subprocess
import sys

import pytest

from tests.conftest import ROOT
from workers import free_port
from workers.__main__ import parse_args
from workers.options import backend_options, parse_device_map


def test_rank_and_master_come_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    args = parse_args([])
    assert (args.rank, args.world_size, args.master_addr, args.master_port) == (2, 4, "10.0.0.1", 29500)


def test_flags_override_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    args = parse_args(["--rank", "1", "--world-size", "2", "--master-port", "1234", "--name", "s1"])
    assert (args.rank, args.name) == (1, "s1")


def test_missing_rank_is_an_error(monkeypatch, capsys):
    for key in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit):
        parse_args([])
    assert "--rank is required" in capsys.readouterr().err


def test_device_maps_parse_and_reach_the_options():
    maps = parse_device_map(["worker2=cuda:0>cuda:1", "worker2=cuda:1>cuda:0", "driver=cpu>cpu"])
    assert maps == {"worker2": {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}, "driver": {"cpu": "cpu"}}
    options = backend_options(device_maps={"worker2": {"cpu": "cpu"}}, transports=["uv"], rpc_timeout=7)
    assert options.rpc_timeout == 7
    assert "worker2" in options.device_maps
    with pytest.raises(ValueError, match="PEER=SRC>DST"):
        parse_device_map(["worker2:cuda:0"])


def test_local_workers_map_each_device_to_every_later_worker():
    """Activations go to the next worker, skips to any later one: every later peer needs a device map."""
    from workers import LocalWorkers

    local = LocalWorkers(3, devices=["cuda:0", "cuda:1", "cuda:2"])
    args = local._device_args(0)
    assert args == ["--device", "cuda:0", "--device-map", "worker2=cuda:0>cuda:1",
                    "--device-map", "worker3=cuda:0>cuda:2"]
    assert local._device_args(2) == ["--device", "cuda:2"]
    parsed = parse_args(["--rank", "1", "--world-size", "4", "--master-port", "1", *args])
    assert parse_device_map(parsed.device_map) == {"worker2": {"cuda:0": "cuda:1"}, "worker3": {"cuda:0": "cuda:2"}}


def test_local_workers_map_cuda_devices_only():
    """TensorPipe maps join CUDA devices: CPU workers get no device and no map, and nobody maps to one."""
    from workers import LocalWorkers

    local = LocalWorkers(3, devices=["cuda", "cpu:0", "cuda:1"])  # spelled as users may
    assert local._device_args(0) == ["--device", "cuda:0", "--device-map", "worker3=cuda:0>cuda:1"]
    assert local._device_args(1) == []
    assert LocalWorkers(2)._device_args(0) == []


@pytest.mark.timeout(60)
def test_a_worker_started_by_hand_says_where_it_waits():
    """With no driver up (or a mistyped port) it waits for the rendezvous: it must say so, not look hung."""
    proc = subprocess.Popen([sys.executable, "-m", "workers", "--rank", "1", "--world-size", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port())],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline() if proc.stderr else ""
    finally:
        proc.kill()
        proc.wait()
    assert first.startswith("python -m workers: worker1 (rank 1 of 2) joining the group at 127.0.0.1:")
