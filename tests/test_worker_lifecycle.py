"""Stage workers' life cycle around their driver: a driver that is slow to answer, a child forked from it,
the user's own ``rpc.shutdown()``, a dead worker in a shared group, a driver of another name.
Each scenario runs in fresh interpreters (their own RPC state)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, run_script, wait_gone
from workers import free_port


def _values(out: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in out.splitlines() if line.startswith(key + "=")]


@pytest.fixture(scope="module")
def gil_holding_driver() -> subprocess.CompletedProcess[str]:
    """One driver for two tests: the loopback one reads which addresses the driver and its local
    workers listen on, once the group is up and again after the first forward (it only reads /proc),
    before the driver holds the GIL for 24 s and then checks its workers. A failed reading is printed,
    not raised: the GIL scenario goes on, and only the loopback test misses its line."""
    return run_script("""
        import ctypes, os, traceback, torch
        from torch import nn
        from rrefpipe import Pipe
        from tests.conftest import pid_alive

        def sockets(pid):
            inodes = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except FileNotFoundError:  # closed since the listing (a thread of that process)
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
            return inodes

        def listening(pids):
            ours = set().union(*(sockets(pid) for pid in pids))
            found = []
            for table in ("/proc/net/tcp", "/proc/net/tcp6"):
                for line in open(table).read().splitlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and fields[9] in ours:  # LISTEN, on a socket of these processes
                        found.append(fields[1].rsplit(":", 1)[0])
            return found

        def read_addresses(pipe, into):
            try:
                into.update(listening([os.getpid(), *pipe._local_workers.pids]))
                return True
            except Exception:
                traceback.print_exc()
                return False

        with Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=1, balance=[1, 1]) as pipe:
            addresses = set()
            read = read_addresses(pipe, addresses)   # the group just started
            with torch.no_grad():
                pipe(torch.randn(2, 4))
            if read_addresses(pipe, addresses) and read:   # and after a forward
                print("addresses=" + ",".join(sorted(addresses)), flush=True)
            ctypes.PyDLL(None).sleep(24)   # libc's sleep, called with the GIL held
            print("alive=" + str(all(pid_alive(p) for p in pipe._local_workers.pids)))
            with torch.no_grad():
                print("shape=" + str(tuple(pipe(torch.randn(2, 4)).local_value().shape)))
    """, timeout=110, check=False)


def _succeeded(proc: subprocess.CompletedProcess[str]) -> None:
    if proc.returncode != 0:
        pytest.fail(f"script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


@pytest.mark.timeout(120)
def test_workers_stay_with_a_driver_that_holds_the_gil(gil_holding_driver):
    """A live driver in a long C call that keeps the GIL answers no ping: 24 s is well over two ping
    timeouts in a row, after which workers used to leave. Its store and stdin pipe say it is alive.
    (The workers' ping interval, 2 s with a 5 s timeout, is no option of local workers: the 24 s stay.)"""
    out = gil_holding_driver
    _succeeded(out)
    assert _values(out.stdout, "alive") == ["True"] and _values(out.stdout, "shape") == ["(2, 4)"]


@pytest.mark.timeout(120)
def test_local_workers_listen_on_loopback_only(gil_holding_driver):
    """Every socket the driver and its local workers listen on is bound to 127.0.0.1: the rendezvous
    store's too, which torch's TCPStore binds to every interface whatever address it is given.
    (Read in the driver of the GIL test above, which the reading leaves alone.)"""
    out = gil_holding_driver
    _succeeded(out)
    assert _values(out.stdout, "addresses"), out.stderr[-6000:]
    addresses = _values(out.stdout, "addresses")[0].split(",")
    assert addresses == ["0100007F"], addresses  # 127.0.0.1 as /proc/net/tcp writes it; never 0.0.0.0


@pytest.mark.timeout(120)
def test_a_child_forked_from_the_driver_exits_and_leaves_the_workers_alone():
    """A child forked from the driver (as some data loading does) runs the driver's exit hooks when it
    exits: it used to wait forever to stop workers that are not its own."""
    out = run_script("""
        import os, sys, threading, torch
        from torch import nn
        from rrefpipe import Pipe
        pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=1, balance=[1, 1])
        pid = os.fork()
        if pid == 0:
            sys.exit(0)   # a normal exit: atexit hooks run
        waiter = threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True)
        waiter.start()
        waiter.join(timeout=30)
        print("child_exited=" + str(not waiter.is_alive()))
        if waiter.is_alive():
            os.kill(pid, 9)
        with torch.no_grad():
            print("shape=" + str(tuple(pipe(torch.randn(2, 4)).local_value().shape)))
        pipe.close()
    """, timeout=110)
    assert _values(out.stdout, "child_exited") == ["True"] and _values(out.stdout, "shape") == ["(2, 4)"]


@pytest.mark.timeout(120)
def test_a_pipe_after_the_users_own_rpc_shutdown_starts_new_workers():
    """The user's ``rpc.shutdown()`` ends the embedded group under its open pipe: the next pipe starts a
    new one instead of failing with torch's "RPC has not been initialized"."""
    out = run_script("""
        import torch, torch.distributed.rpc as rpc
        from torch import nn
        from rrefpipe import Pipe
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        first = Pipe(model, chunks=1, balance=[1, 1])
        print("old=" + " ".join(map(str, first._local_workers.pids)))
        rpc.shutdown()
        with Pipe(model, chunks=1, balance=[1, 1]) as second, torch.no_grad():
            x = torch.randn(2, 4)
            torch.testing.assert_close(second(x).local_value(), model(x))
            print("new=" + " ".join(map(str, second._local_workers.pids)))
        first.close()
    """, timeout=110)
    old, new = (set(_values(out.stdout, key)[0].split()) for key in ("old", "new"))
    assert not old & new
    wait_gone([int(p) for p in old], within=10)


@pytest.mark.timeout(120)
def test_the_users_own_group_after_rpc_shutdown_is_not_taken_for_the_embedded_one():
    """After ``rpc.shutdown()`` under an open pipe the user starts a group of their own, with the same
    worker names: a new pipe used the old embedded group's bookkeeping (counted as running while RPC
    was initialised at all), and closing the old pipe then stopped the user's workers. Now the new pipe
    takes the user's group, and the user's workers outlive the old pipe's close."""
    out = run_script("""
        import torch, torch.distributed.rpc as rpc
        from torch import nn
        from rrefpipe import Pipe
        from workers import LocalWorkers
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        x = torch.randn(2, 4)
        first = Pipe(model, chunks=1, balance=[1, 1])
        rpc.shutdown()
        with LocalWorkers(2) as mine:
            with Pipe(model, chunks=1, balance=[1, 1]) as second, torch.no_grad():
                torch.testing.assert_close(second(x).local_value(), model(x))
                print("embedded=" + str(second._local_workers is not None))
            first.close()
            print("mine_exited=" + str(mine.exited()))
            with Pipe(model, chunks=1, balance=[1, 1], workers=mine.names) as third, torch.no_grad():
                torch.testing.assert_close(third(x).local_value(), model(x))
                print("after_close=ok")
    """, timeout=110)
    assert _values(out.stdout, "embedded") == ["False"]
    assert _values(out.stdout, "mine_exited") == ["{}"] and _values(out.stdout, "after_close") == ["ok"]


@pytest.mark.timeout(120)
def test_a_dead_worker_of_an_open_pipe_is_named_until_that_pipe_is_closed():
    """A pipe built while another open pipe's worker is dead says which one and what to do; once that
    pipe is closed, or dropped without ``close()``, the next pipe starts new workers. The pipe built
    after the close is the one whose worker dies next and that is dropped: three groups, not four."""
    out = run_script("""
        import gc, os, signal, torch
        from torch import nn
        from rrefpipe import Pipe
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        x = torch.randn(2, 4)

        def kill_worker2(pipe):
            os.kill(pipe._local_workers.pids[1], signal.SIGKILL)
            pipe._local_workers._procs[1].wait()

        pipe = Pipe(model, chunks=1, balance=[1, 1])
        kill_worker2(pipe)
        try:
            Pipe(model, chunks=1, balance=[1, 1])
        except ValueError as exc:
            print("error=" + str(exc))
        pipe.close()
        pipe = Pipe(model, chunks=1, balance=[1, 1])
        with torch.no_grad():
            print("closed_then=" + str(tuple(pipe(x).local_value().shape)))
        kill_worker2(pipe)   # the same again with this pipe's workers, which it then drops
        del pipe
        gc.collect()
        with Pipe(model, chunks=1, balance=[1, 1]) as pipe, torch.no_grad():
            print("dropped_then=" + str(tuple(pipe(x).local_value().shape)))
    """, timeout=110)
    error = _values(out.stdout, "error")
    assert error and "{'worker2': -9}" in error[0] and "close that pipe first" in error[0], out.stdout
    assert _values(out.stdout, "closed_then") == ["(2, 4)"] and _values(out.stdout, "dropped_then") == ["(2, 4)"]


@pytest.mark.timeout(120)
def test_a_worker_joined_by_a_driver_of_another_name_says_which_option_to_use():
    """``python -m workers`` watches a driver called "driver"; a group whose rank 0 is "master" (torch's
    tutorials) made it leave two seconds after joining, blaming a dead driver."""
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    driver_code = """
        import sys, torch.distributed.rpc as rpc
        from workers import backend_options
        rpc.init_rpc("master", rank=0, world_size=2, rpc_backend_options=backend_options())
        sys.stdin.read()   # stay in the group until the test is done
        rpc.shutdown(graceful=False)
    """
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(driver_code)], cwd=ROOT, env=env,
                              stdin=subprocess.PIPE, stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([sys.executable, "-m", "workers", "--rank", "1", "--world-size", "2"], cwd=ROOT,
                              env=env, stderr=subprocess.PIPE, text=True)
    try:
        _, err = worker.communicate(timeout=60)
        assert worker.returncode == 1, err
        assert "the group has no driver named 'driver' (its members: master, worker1)" in err
        assert "start the worker with --driver NAME" in err and "(rank 0 here: 'master')" in err
    finally:
        for proc in (worker, driver):
            proc.kill()
            proc.wait(timeout=10)


def test_a_store_server_that_takes_no_socket_is_asked_again_without_libuv(monkeypatch):
    """Older torch releases' libuv store server refuses a listening socket: the store is made again with
    torch's other server, on a fresh socket bound to the same port (the first one closed, or the bind
    would fail)."""
    from datetime import timedelta

    import torch.distributed as dist

    from workers import rendezvous

    real, calls = dist.TCPStore, []

    def store(*args, **kwargs):
        calls.append(kwargs.get("use_libuv"))
        if "use_libuv" not in kwargs:
            raise RuntimeError("libuv TCPStore backend does not support master_listen_fd")
        return real(*args, **kwargs)

    monkeypatch.setattr(rendezvous.dist, "TCPStore", store)
    port = free_port()
    served = rendezvous._serving_store("127.0.0.1", port, 1, timedelta(seconds=10))
    served.set("key", "value")
    client = real("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=10))
    assert client.get("key") == b"value" and calls == [None, False]


@pytest.mark.parametrize("watched", [True, False])
def test_a_watched_worker_leaves_a_silent_driver_only_after_the_limit(monkeypatch, watched):
    """Pings that time out: a worker whose watches see the driver's process keeps waiting (the driver
    may hold the GIL) until ``SILENT_DRIVER_LIMIT`` seconds of them, since a torchrun store on another
    host may outlive the driver; one without a watch leaves at the second. A fake clock, no waiting."""
    import importlib

    serve = importlib.import_module("workers.serve")  # the module: the package exports its function

    clock = [0.0]
    pings = []

    def silent(*args, **kwargs):
        pings.append(clock[0])
        clock[0] += 10.0
        if len(pings) > 100:  # a worker that would wait for ever: end it as a lost connection would
            raise RuntimeError("ECONNRESET")
        raise RuntimeError("RPC ran for more than set timeout (10000 ms)")

    monkeypatch.setattr(serve.rpc, "rpc_sync", silent)
    monkeypatch.setattr(serve.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(serve, "_stop", type("NeverStopped", (), {"wait": staticmethod(lambda _: False)})())
    assert serve._ping_driver("worker1", "driver", 1.0, watched) is False
    # the silence is timed from the end of the first missed ping (10 s), left at the first one past it
    assert len(pings) == (int(serve.SILENT_DRIVER_LIMIT // 10) + 2 if watched else 2), pings
