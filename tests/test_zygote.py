"""Local workers forked from a warm process (``workers.zygote``, ``workers.warm``): who their parent is,
what they take from the driver, that the warm process is reused and dies with its driver, and the
fallback to fresh interpreters. Each scenario runs in a fresh driver interpreter."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, pid_alive, run_script, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm processes are Linux-only")
forking = pytest.mark.skipif(os.environ.get("RREFPIPE_FRESH_WORKERS") == "1",
                             reason="RREFPIPE_FRESH_WORKERS=1: this run starts every worker fresh")

_PARENT = """
        def parent(pid):
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])

        def ask(name, expression):
            return rpc.rpc_sync(name, eval, args=(expression,))

        def pipes(pid):
            found = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except FileNotFoundError:  # closed since the listing
                    pass
            return {target for target in found if target.startswith("pipe:")}
"""


def _values(out: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in out.splitlines() if line.startswith(key + "=")]


def _ints(out: str, key: str) -> list[int]:
    return [int(v) for v in _values(out, key)[0].split(",")]


@forking
@pytest.mark.timeout(150)
def test_workers_are_forked_from_a_warm_process_that_the_next_group_reuses(tmp_path):
    """Two groups: each worker is the warm process's child (not a fresh interpreter, not the driver's),
    reports its own pid over RPC, and runs with the driver's arguments for it, directory, ``sys.path``
    and per-worker variables of the moment, and seeds of its own; the read end of its stdin pipe is
    held by no other worker and not by the warm process (nothing else keeps a worker from seeing its
    driver go). Both groups share one warm process; a group with another thread count (another
    environment) gets another. All are gone after the driver."""
    out = run_script(_PARENT + f"""
        import os, sys, torch, torch.distributed.rpc as rpc
        from workers import LocalWorkers, warm

        print(f"driver={{os.getpid()}}")
        for k, threads in enumerate((1, 1, 2)):
            os.environ["PYTEST_CURRENT_TEST"] = f"group {{k}}"   # a per-worker variable: no new warm process
            if k == 1:
                os.chdir({str(tmp_path)!r})
            with LocalWorkers(2, threads=threads) as group:
                print(f"pids{{k}}=" + ",".join(map(str, group.pids)))
                print(f"reported{{k}}=" + ",".join(str(rpc.rpc_sync(n, os.getpid)) for n in group.names))
                print(f"parents{{k}}=" + ",".join(str(parent(p)) for p in group.pids))
                print(f"warm{{k}}=" + ",".join(map(str, warm.warm_pids())))
                with open(f"/proc/{{group.pids[0]}}/cmdline") as f:
                    print(f"cmdline{{k}}=" + f.read().replace(chr(0), " "))
                for name in group.names:
                    print(f"argv{{k}}=" + " ".join(ask(name, "__import__('sys').argv[:3]")))
                    print(f"cwd{{k}}=" + str(ask(name, "__import__('os').getcwd()") == os.getcwd()))
                    print(f"path{{k}}=" + str(ask(name, "__import__('sys').path[0]") == os.path.abspath(sys.path[0])))
                    print(f"test{{k}}=" + ask(name, "__import__('os').environ['PYTEST_CURRENT_TEST']"))
                    print(f"threads{{k}}=" + str(ask(name, "__import__('torch').get_num_threads()")))
                stdins = [os.readlink(f"/proc/{{p}}/fd/0") for p in group.pids]
                others = [pipes(q) for q in [*group.pids, *warm.warm_pids()]]
                print(f"stdin_held_elsewhere{{k}}=" + str([sum(s in held for held in others) for s in stdins]))
                print(f"seeds{{k}}=" + ",".join(str(ask(n, "__import__('torch').initial_seed()")) for n in group.names))
        print("warm_parents=" + ",".join(str(parent(p)) for p in warm.warm_pids()))
    """, timeout=140).stdout
    driver = int(_values(out, "driver")[0])
    first_warm = _ints(out, "warm0")
    assert len(first_warm) == 1 and _ints(out, "warm1") == first_warm
    assert _ints(out, "warm2")[0] == first_warm[0] and len(_ints(out, "warm2")) == 2  # another environment
    assert _ints(out, "warm_parents") == [driver, driver]
    all_pids = []
    for k in range(3):
        pids = _ints(out, f"pids{k}")
        all_pids += pids
        assert _ints(out, f"reported{k}") == pids and driver not in pids
        assert _ints(out, f"parents{k}") == [_ints(out, f"warm{k}")[-1]] * 2
        assert "serve_forks" in _values(out, f"cmdline{k}")[0]
        assert _values(out, f"argv{k}") == ["-c --rank 1", "-c --rank 2"]
        assert _values(out, f"cwd{k}") == ["True", "True"] and _values(out, f"path{k}") == ["True", "True"]
        assert _values(out, f"test{k}") == [f"group {k}"] * 2
        assert _values(out, f"threads{k}") == [str(1 if k < 2 else 2)] * 2
        assert len(set(_values(out, f"seeds{k}")[0].split(","))) == 2
        assert _values(out, f"stdin_held_elsewhere{k}") == ["[1, 1]"]  # only by the worker itself
    assert len(set(all_pids)) == 6
    wait_gone(all_pids + _ints(out, "warm2"), within=10)


@forking
@pytest.mark.timeout(120)
def test_workers_and_their_warm_process_die_with_a_killed_driver():
    script = _PARENT + """
        import sys, torch, torch.distributed.rpc as rpc
        from torch import nn
        from rrefpipe import Pipe
        from workers import warm
        pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), balance=[1, 1])
        pipe(torch.randn(2, 2))
        print("pids=" + ",".join(map(str, pipe._local_workers.pids + warm.warm_pids())), flush=True)
        sys.stdin.read()  # hold until killed
    """
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout is not None
        pids = _ints(driver.stdout.readline(), "pids")
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        wait_gone(pids, within=10)
    finally:
        driver.kill()
        driver.wait(timeout=10)


@pytest.mark.timeout(150)
def test_fresh_workers_when_asked_when_the_warm_process_cannot_start_or_is_gone():
    """``RREFPIPE_FRESH_WORKERS=1`` and a warm process that exits before it is ready: the workers are
    the driver's own ``python -c`` children (the latter said once, not tried again). A warm process
    killed under its group takes its workers with it (exit status -9, as ``Popen`` says), and the next
    group starts another."""
    out = run_script(_PARENT + """
        import os, torch, torch.distributed.rpc as rpc
        from torch import nn
        from rrefpipe import Pipe
        from workers import LocalWorkers, warm

        def fresh(tag):
            with LocalWorkers(2) as group:
                model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
                with Pipe(model, chunks=2, balance=[1, 1], workers=group.names) as pipe, torch.no_grad():
                    x = torch.randn(4, 4)
                    torch.testing.assert_close(pipe(x).local_value(), model(x))
                with open(f"/proc/{group.pids[0]}/cmdline") as f:
                    cmdline = f.read()
                print(f"{tag}=" + str([parent(p) == os.getpid() for p in group.pids] == [True, True]
                                      and "from workers.__main__ import main" in cmdline and not warm.warm_pids()))

        os.environ["RREFPIPE_FRESH_WORKERS"] = "1"
        fresh("asked")
        del os.environ["RREFPIPE_FRESH_WORKERS"]
        warm.RUN_WARM, run_warm = "raise SystemExit(3)", warm.RUN_WARM
        fresh("broken")
        fresh("broken_again")
        warm.RUN_WARM = run_warm
        os.environ["ANOTHER_ENVIRONMENT"] = "1"
        with LocalWorkers(2) as group:
            (killed,) = warm.warm_pids()
            os.kill(killed, 9)
            print("codes=" + str([group._procs[k].wait(timeout=10) for k in range(2)]))
            print("exited=" + str(sorted(group.exited().items())))
        with LocalWorkers(2) as group:
            print("replaced=" + str(warm.warm_pids() != [killed] and len(warm.warm_pids()) == 1))
            print("works=" + str([rpc.rpc_sync(n, os.getpid) for n in group.names] == group.pids))
    """, timeout=140)
    for key in ("asked", "broken", "broken_again", "replaced", "works"):
        assert _values(out.stdout, key) == ["True"], (key, out.stdout, out.stderr[-3000:])
    assert _values(out.stdout, "codes") == ["[-9, -9]"]
    assert _values(out.stdout, "exited") == ["[('worker1', -9), ('worker2', -9)]"]
    assert out.stderr.count("the warm worker process exited with status 3") == 1, out.stderr[-3000:]
