"""Process life cycle, each in a fresh interpreter: embedded workers, dead drivers and workers, the
PyTorch-1.8 in-process mode, and workers started the way torchrun starts them."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, pid_alive, run_script, wait_gone
from workers import free_port

pytestmark = pytest.mark.timeout(120)


def _values(out: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in out.splitlines() if line.startswith(key + "=")]


# Tests whose scenarios neither kill nor stop a process, nor shut RPC down or change its group, share
# one driver script run (a module-scoped fixture): each scenario is a function whose result is its own
# line, ``<name>=ok``, or ``<name>=failed`` and its traceback, which only that scenario's test reports.
_SCENARIO_RUNNER = """
    import sys, traceback
    def scenario(fn):
        try:
            fn()
        except Exception:
            print(f"{fn.__name__}=failed")
            print("\\n".join(f"{fn.__name__}| {line}" for line in traceback.format_exc().splitlines()))
        else:
            print(f"{fn.__name__}=ok")
        sys.stdout.flush()
"""


def _scenario_passed(proc: subprocess.CompletedProcess[str], name: str, shut_down: bool = True) -> None:
    """Fail with scenario ``name``'s own traceback unless it passed; ``shut_down``: also with the output
    unless the shared script exited with 0 (what follows the scenarios, as the group's stop or RPC's
    shutdown that its own script had ended with: ``run_script`` fails a script of its own so)."""
    result = _values(proc.stdout, name)
    if result != ["ok"]:
        trace = "\n".join(line.split("| ", 1)[1] for line in proc.stdout.splitlines() if line.startswith(name + "| "))
        pytest.fail(f"scenario {name}: {result or 'no result'}\n{trace}\n--- stderr:\n{proc.stderr[-6000:]}")
    if shut_down and proc.returncode != 0:
        pytest.fail(f"the shared script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def _wait_until_stuck(marker: Path, driver: subprocess.Popen[str]) -> None:
    """Until a stage wrote ``marker`` (it is about to block for good); fails if the driver dies first."""
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert driver.poll() is None, "the driver script failed"
        assert time.monotonic() < deadline, "the stage never got stuck"
        time.sleep(0.05)


def _kill_driver(driver: subprocess.Popen[str], pids: list[int], within: float) -> None:
    """SIGKILL the driver; every worker in ``pids`` must be gone ``within`` seconds."""
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=10)
    took = wait_gone(pids, within=within)
    print(f"workers gone {took:.2f}s after the driver was killed")


def test_embedded_workers_start_stop_and_restart_in_one_process():
    out = run_script("""
        import torch, torch.distributed.autograd as dist_autograd
        from torch import nn
        from rrefpipe import Pipe
        from tests.conftest import pid_alive
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        x = torch.randn(6, 4)
        for round in range(2):  # a second pipe after the first closed: the RPC group starts again
            with Pipe(model, chunks=3, balance=[2, 1]) as pipe:
                assert [s.worker for s in pipe.stages] == ["worker1", "worker2"]
                pids = pipe._local_workers.pids
                with dist_autograd.context() as ctx:
                    out = pipe(x).local_value()
                    dist_autograd.backward(ctx, [out.sum()])
                torch.testing.assert_close(out, model(x))
            print("gone=" + str(not any(pid_alive(p) for p in pids)))
        pipe = Pipe(model, chunks=2, balance=[1, 2])  # never closed: stopped at interpreter exit
        print("pids=" + " ".join(map(str, pipe._local_workers.pids)))
    """)
    assert "as a ProcessGroup" not in out.stderr  # torch's internal deprecation, silenced in every process
    assert _values(out.stdout, "gone") == ["True", "True"]
    wait_gone([int(p) for p in _values(out.stdout, "pids")[0].split()], within=5)


def test_a_pipe_dropped_without_close_is_closed_by_the_next_one():
    """A notebook that rebinds ``pipe = Pipe(...)`` without closing: the dropped pipe's stages leave the
    workers at the new pipe's first forward, the new pipe keeps the same local workers, and closing the
    last pipe stops them, as if every pipe had been closed."""
    out = run_script("""
        import gc, torch, torch.distributed.rpc as rpc, torch.distributed.autograd as dist_autograd
        from torch import nn
        from rrefpipe import Pipe
        from tests.conftest import pid_alive
        from tests.distributed.probes import counts
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        first = None
        for k in range(3):
            pipe = Pipe(model, chunks=2, balance=[2, 1])  # the previous one is dropped here
            first = first or pipe._local_workers.pids
            with dist_autograd.context() as ctx:
                pipe.backward(ctx, pipe(torch.randn(4, 4)).local_value().sum())
            stages = [rpc.rpc_sync(w, counts)["stages"] for w in ("worker1", "worker2")]
            print(f"round{k}=" + ",".join(map(str, stages)) + f",{pipe._local_workers.pids == first}")
        pids = pipe._local_workers.pids
        del pipe
        gc.collect()
        Pipe(model, chunks=2, balance=[2, 1]).close()  # builds (closing the dropped one), then closes
        print("gone=" + str(not any(pid_alive(p) for p in pids)))
    """)
    # every round: one stage on each worker (the dropped pipe's are gone), on the same workers
    assert [_values(out.stdout, f"round{k}") for k in range(3)] == [["1,1,True"]] * 3
    assert _values(out.stdout, "gone") == ["True"]


def test_workers_exit_when_the_driver_is_killed():
    script = """
        import sys, torch
        from torch import nn
        from rrefpipe import Pipe
        pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), balance=[1, 1])
        pipe(torch.randn(2, 2))
        print("pids=" + " ".join(map(str, pipe._local_workers.pids)), flush=True)
        sys.stdin.read()  # hold until killed
    """
    import textwrap

    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        line = driver.stdout.readline()
        pids = [int(p) for p in line.split("=", 1)[1].split()]
        assert all(pid_alive(p) for p in pids)
        _kill_driver(driver, pids, within=10)
    finally:
        driver.kill()


def test_worker_stuck_in_a_stage_leaves_when_the_driver_is_killed(tmp_path):
    """Workers started as torchrun starts them (no stdin pipe): one is stuck forever in a layer's forward,
    holding its only RPC thread, so its pings to the driver can neither succeed nor fail. It must still
    notice the driver's death (through the rendezvous store) and exit."""
    port = free_port()
    stuck = tmp_path / "stuck"
    env = dict(os.environ, WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0")
    script = f"""
        import threading, torch, torch.distributed.rpc as rpc
        from torch import nn
        from rrefpipe import Pipe
        from workers import backend_options

        class StuckOnOddBatches(nn.Module):
            def forward(self, x):
                if x.shape[0] % 2:
                    open({str(stuck)!r}, "w").close()
                    threading.Event().wait()   # never returns
                return x

        rpc.init_rpc("driver", rank=0, world_size=3, rpc_backend_options=backend_options())
        pipe = Pipe(nn.Sequential(nn.Linear(2, 2), StuckOnOddBatches()), balance=[1, 1]).eval()
        assert pipe(torch.randn(4, 2)).local_value().shape == (4, 2)
        threading.Thread(target=pipe, args=(torch.randn(3, 2),), daemon=True).start()
        threading.Event().wait()   # hold until killed
    """
    import textwrap

    workers = [subprocess.Popen([sys.executable, "-m", "workers"], cwd=ROOT, env=dict(env, RANK=str(rank)),
                                stderr=subprocess.DEVNULL) for rank in (1, 2)]
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env)
    try:
        _wait_until_stuck(stuck, driver)  # the second worker's RPC thread is now stuck for good
        assert all(w.poll() is None for w in workers)
        _kill_driver(driver, [w.pid for w in workers], within=30)  # (two store checks, each up to 5 s, under load)
    finally:
        for proc in (driver, *workers):
            proc.kill()
            proc.wait(timeout=10)


def test_local_worker_busy_in_a_stage_leaves_when_the_driver_is_killed(tmp_path):
    """A local worker learns of its driver's death from its stdin pipe; one stuck in a layer's forward
    (its ping to the driver stuck with it) must still exit."""
    stuck = tmp_path / "stuck"
    script = f"""
        import threading, torch
        from torch import nn
        from rrefpipe import Pipe

        class Stuck(nn.Module):
            def forward(self, x):
                open({str(stuck)!r}, "w").close()
                threading.Event().wait()   # never returns
                return x

        pipe = Pipe(nn.Sequential(nn.Linear(2, 2), Stuck()), balance=[1, 1]).eval()
        print(*pipe._local_workers.pids, flush=True)
        threading.Thread(target=pipe, args=(torch.randn(3, 2),), daemon=True).start()
        threading.Event().wait()   # hold until killed
    """
    import textwrap

    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        _wait_until_stuck(stuck, driver)
        _kill_driver(driver, pids, within=20)
    finally:
        driver.kill()
        driver.wait(timeout=10)
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_dead_worker_is_named_quickly_and_close_returns():
    out = run_script("""
        import os, signal, time, torch, torch.distributed.autograd as dist_autograd
        from torch import nn
        from rrefpipe import Pipe, WorkerError
        pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)), chunks=2,
                    balance=[1, 1, 1], rpc_timeout=30)
        pipe(torch.randn(4, 2))
        os.kill(pipe._local_workers.pids[1], signal.SIGKILL)   # worker2 holds stage 1
        t = time.monotonic()
        try:
            with dist_autograd.context():
                pipe(torch.randn(4, 2))
        except WorkerError as exc:
            print(f"error={exc}")
            print(f"where={exc.stage},{exc.worker}")
        print(f"surfaced={time.monotonic() - t:.3f}")
        try:
            pipe.state_dict()   # a control call to the dead worker: also a WorkerError
        except WorkerError as exc:
            print(f"control={exc.stage},{exc.worker}")
        t = time.monotonic()
        pipe.close()
        print(f"closed={time.monotonic() - t:.3f}")
    """).stdout
    print(out)
    assert _values(out, "where") == ["1,worker2"] and _values(out, "control") == ["1,worker2"]
    assert float(_values(out, "surfaced")[0]) < 5
    assert float(_values(out, "closed")[0]) < 15


# -- One interpreter, no stage workers ------------------------------------------------------------
# The four tests below run no stage worker and kill nothing: their scenarios share one fresh
# interpreter (one `import torch` instead of four). The import check runs first, before any scenario
# imports anything; then RPC starts once as a world of one for the three in-process scenarios, which
# neither shut it down nor change the group (the one that starts a Gloo process group runs last), and
# it is shut down after them.


@pytest.fixture(scope="module")
def without_workers() -> subprocess.CompletedProcess[str]:
    """The run of the scenarios of the four tests below, in one fresh interpreter (see above)."""
    return run_script(textwrap.dedent(_SCENARIO_RUNNER) + textwrap.dedent("""
        def importing_leaves_torchs_optimizers_alone():
            import rrefpipe, rrefpipe.stage_side.checkpoint, workers.__main__
            print("heavy=" + ",".join(m for m in ("torch.distributed.optim", "torch.distributed.fsdp", "sympy")
                                      if m in sys.modules))

        def pytorch_18_style():
            import copy, torch
            from torch import nn
            from rrefpipe import Pipe
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
            ref = copy.deepcopy(model)
            pipe = Pipe(model, chunks=8, balance=[2, 1], checkpoint="always")
            assert [s.worker for s in pipe.stages] == ["solo", "solo"]
            assert list(pipe.modules())[1:] == list(model) and pipe.requires_grad_(True) is pipe
            x = torch.rand(16, 16)
            out = pipe(x).local_value()
            out.sum().backward()                      # plain autograd, no context needed
            ref(x).sum().backward()
            torch.testing.assert_close(out, ref(x))
            for p, q in zip(pipe.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
            kinds = [e.kind for e in pipe.execution_record()]
            assert kinds.count("recompute") == 2 * 8, kinds
            import torch.distributed.autograd as dist_autograd      # or a context, as with stage workers
            with dist_autograd.context() as ctx:
                pipe.backward(ctx, pipe(x).local_value().sum())
                total = pipe.clip_grad_norm_(ctx, 0.1)
                grads = dist_autograd.get_gradients(ctx)
            ref.zero_grad()
            ref(x).sum().backward()
            torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
            for p, q in zip(pipe.parameters(), ref.parameters()):
                torch.testing.assert_close(grads[p], q.grad)
            from rrefpipe import GradScaler                         # loss scaling in the context, too
            scaler = GradScaler(pipe, init_scale=8.0)
            with dist_autograd.context() as ctx:
                pipe.backward(ctx, scaler.scale(pipe(x).local_value().sum()))
                scaler.unscale_(ctx)
                grads = dist_autograd.get_gradients(ctx)
            ref.zero_grad()
            ref(x).sum().backward()
            for p, q in zip(pipe.parameters(), ref.parameters()):
                torch.testing.assert_close(grads[p], q.grad)

        def unreached_parameters():
            import torch, torch.nn.functional as F
            from rrefpipe import Pipe
            from tests.layers import UNREACHED_CASES, partly_unreached, twin
            x, y = torch.randn(12, 10), torch.randint(0, 4, (12,))
            first = lambda out: out[0] if isinstance(out, tuple) else out
            for case in UNREACHED_CASES:
                for checkpoint in ("always", "never"):
                    model, balance = partly_unreached(case)
                    ref = twin(model)
                    F.cross_entropy(first(ref(x)), y).backward()
                    pipe = Pipe(model, chunks=3, balance=balance, checkpoint=checkpoint)
                    F.cross_entropy(first(pipe(x).local_value()), y).backward()
                    pairs = list(zip(pipe.parameters(), ref.parameters()))
                    assert any(q.grad is None for _, q in pairs) and any(q.grad is not None for _, q in pairs)
                    for p, q in pairs:
                        assert (p.grad is None) == (q.grad is None), (case, checkpoint)
                        if q.grad is not None:
                            torch.testing.assert_close(p.grad, q.grad)

        def module_like_pytorchs():
            import copy, pytest, torch, torch.distributed as dist
            from torch import nn
            from torch.nn.parallel import DistributedDataParallel as DDP
            from rrefpipe import Pipe
            from tests.layers import Parent
            from workers import free_port
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
            plain = copy.deepcopy(model)
            pipe = Pipe(model, chunks=2, balance=[2, 1], checkpoint="never")
            assert len(pipe) == 3 and pipe[0] is model[0] and pipe[-1] is model[2] and list(pipe) == list(model)
            assert pipe.devices == [torch.device("cpu")] * 2 and [len(p) for p in pipe.partitions] == [2, 1]
            assert list(pipe.state_dict()) == list(plain.state_dict())
            for move in (pipe.cuda, pipe.cpu, lambda: pipe.to("cpu"), lambda: pipe.to(torch.zeros(1))):
                with pytest.raises(TypeError, match="cannot be moved"):
                    move()
            assert pipe.to(torch.float64) is pipe and model[0].weight.dtype == torch.float64  # a dtype is no move
            assert pipe.float() is pipe and model[0].weight.dtype == torch.float32
            assert pipe.to(torch.float32, True) is pipe  # to(dtype, non_blocking), as nn.Module takes it
            assert pipe.to(memory_format=torch.channels_last) is pipe  # (no 4-D weights here: nothing changes)
            parent = Parent(pipe, width=6)
            assert list(parent.state_dict()) == ["head.weight", "head.bias"] + ["pipe." + k for k in plain.state_dict()]
            new = {k: torch.randn_like(v) for k, v in parent.state_dict().items()}
            parent.load_state_dict(new)
            for k, v in pipe.state_dict().items():
                torch.testing.assert_close(v, new["pipe." + k])
            with pytest.raises(RuntimeError, match='Missing key.*"pipe.2.bias"'):
                parent.load_state_dict({k: v for k, v in new.items() if k != "pipe.2.bias"})

            ddp = DDP(pipe)
            assert list(ddp.state_dict()) == ["module." + k for k in plain.state_dict()]
            plain.load_state_dict(pipe.state_dict())
            x = torch.randn(4, 6)
            ddp(x).local_value().sum().backward()
            plain(x).sum().backward()
            for p, q in zip(pipe.parameters(), plain.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
            with pytest.warns(UserWarning, match="no BatchNorm layers"):
                Pipe(nn.Sequential(nn.Linear(2, 2)), deferred_batch_norm=True)
            with pytest.warns(UserWarning, match="no BatchNorm layers.*tracks running statistics"):
                Pipe(nn.Sequential(nn.BatchNorm1d(2, track_running_stats=False)), deferred_batch_norm=True)
            pipe.close()
            with pytest.raises(RuntimeError, match="closed"):
                pipe(x)
            assert list(pipe.state_dict()) == list(plain.state_dict())  # the layers are still the pipe's
            dist.destroy_process_group()

        scenario(importing_leaves_torchs_optimizers_alone)  # first: nothing else imported yet
        import torch.distributed.rpc as rpc
        from workers import free_port
        rpc.init_rpc("solo", rank=0, world_size=1,
                     rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}"))
        scenario(pytorch_18_style)
        scenario(unreached_parameters)
        scenario(module_like_pytorchs)
        rpc.shutdown()
    """), check=False)


def test_importing_rrefpipe_and_the_worker_leaves_torchs_optimizers_alone(without_workers):
    """Every local worker imports rrefpipe at start-up: torch.distributed.optim pulls in FSDP, DTensor
    and sympy (0.7 s a process here; Pipe() started in 1.8 s, now 1.1 s), which only a user who builds
    a DistributedOptimizer needs, and then imports."""
    _scenario_passed(without_workers, "importing_leaves_torchs_optimizers_alone", shut_down=False)
    assert _values(without_workers.stdout, "heavy") == [""]


def test_pytorch_18_style_world_size_one_runs_stages_in_process(without_workers):
    _scenario_passed(without_workers, "pytorch_18_style")


def test_world_size_one_gives_no_gradient_to_parameters_the_loss_does_not_reach(without_workers):
    """As with stage workers (tests/distributed/test_training.py): the in-process stages' marker and join
    nodes had handed the layers before an unused tensor zeros."""
    _scenario_passed(without_workers, "unreached_parameters")


def test_world_size_one_pipe_is_a_module_like_pytorchs(without_workers):
    """What code for PyTorch's Pipe does with it in a world of one: index and iterate its layers, read
    its devices, wrap it in DDP (checkpoint='never') or in a parent module and save and load their state
    dicts with the plain keys under the parent's prefix; moving it is refused, as there, a dtype is not."""
    _scenario_passed(without_workers, "module_like_pytorchs")


def test_worker_cli_under_torchrun_environment():
    """Workers started as `python -m workers` with RANK/WORLD_SIZE/MASTER_* set, as torchrun would."""
    port = free_port()
    env = dict(os.environ, WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-m", "workers"], cwd=ROOT, env=dict(env, RANK=str(rank)))
             for rank in (1, 2)]
    try:
        out = run_script(f"""
            import os, torch, torch.distributed.rpc as rpc
            from torch import nn
            from rrefpipe import Pipe
            from workers import backend_options, stop_workers
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
            rpc.init_rpc("driver", rank=0, world_size=3, rpc_backend_options=backend_options())
            model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
            with Pipe(model, chunks=2, balance=[1, 1]) as pipe:   # goes to the group's other workers
                print("workers=" + ",".join(s.worker for s in pipe.stages))
                with torch.no_grad():
                    x = torch.randn(4, 3)
                    torch.testing.assert_close(pipe(x).local_value(), model(x))
            stop_workers(["worker1", "worker2"])
        """).stdout
        assert _values(out, "workers") == ["worker1,worker2"]
        for proc in procs:
            assert proc.wait(timeout=20) == 0
    finally:
        for proc in procs:
            proc.kill()


def test_local_workers_import_modules_beside_the_users_script(tmp_path):
    """A layer class from ``models.py`` next to the script travels by reference: the local workers
    import it from the driver's ``sys.path`` even when the script runs from another directory."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "beside_the_script.py").write_text(textwrap.dedent("""
        from torch import nn
        class Double(nn.Module):
            def forward(self, x):
                return 2 * x
    """))
    (project / "train.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn
        from rrefpipe import Pipe
        from beside_the_script import Double
        model = nn.Sequential(nn.Linear(4, 4), Double())
        with Pipe(model, chunks=2, balance=[1, 1]) as pipe, torch.no_grad():
            x = torch.randn(4, 4)
            torch.testing.assert_close(pipe(x).local_value(), model(x))
        print("matched")
    """))
    proc = _run_file(project / "train.py", cwd=tmp_path)
    assert proc.returncode == 0 and "matched" in proc.stdout, proc.stderr[-3000:]


def _run_file(script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python script`` from ``cwd``, with rrefpipe importable as when installed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=90)


def test_a_users_own_workers_module_neither_runs_as_a_worker_nor_hides_the_cause(tmp_path):
    """A workers.py in the current directory had been what `python -m workers` ran in each local
    worker (user code run, then the driver waiting for the workers until its start-up timeout); one
    beside the script hides rrefpipe's package in the driver, which now says so."""
    (tmp_path / "workers.py").write_text("print('the user workers module ran')\n")
    project = tmp_path / "project"
    project.mkdir()
    script = project / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        from rrefpipe import Pipe
        with Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2, balance=[1, 1]) as pipe:
            with torch.no_grad():
                print("shape", tuple(pipe(torch.randn(2, 4)).local_value().shape))
    """))
    proc = _run_file(script, cwd=tmp_path)
    assert proc.returncode == 0 and "shape (2, 4)" in proc.stdout, proc.stderr[-3000:]
    assert "the user workers module ran" not in proc.stdout
    (project / "workers.py").write_text("")
    proc = _run_file(script, cwd=tmp_path)
    assert proc.returncode != 0
    assert f"'workers' is hidden by {project / 'workers.py'}" in proc.stderr


@pytest.mark.parametrize("worker_start, timeout, error", [
    # The start fails at the first exit: the other worker may or may not have exited by then.
    ("raise SystemExit('broken worker environment')", 60,
     r"workers that exited: \{'worker[12]': 1(, 'worker2': 1)?\}\): a stage worker exited before joining the group"),
    ("import threading; threading.Event().wait()", 2, ": 0 of 2 stage workers joined the group within 2 s"),
], ids=["exits", "hangs"])
def test_a_worker_that_exits_or_hangs_before_joining_fails_the_start(tmp_path, worker_start, timeout, error):
    """torch's rendezvous would wait 30 minutes for a worker process that exited at start-up: the start
    fails as soon as one has, or at the start-up timeout, kills the rest, and a next start works. The
    warm process that local workers fork from (``workers.warm``) runs the sitecustomize first: one that
    exits falls back to fresh workers, one that hangs fails the start at the start-up timeout."""
    (tmp_path / "sitecustomize.py").write_text(
        f"import os; open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close()\n{worker_start}\n")
    out = run_script(f"""
        import os, time
        from workers import LocalWorkers
        os.environ["PYTHONPATH"] = {str(tmp_path)!r}  # the workers run the sitecustomize above
        start = time.monotonic()
        try:
            LocalWorkers(2, startup_timeout={timeout}).start()
        except RuntimeError as exc:
            print("error=" + str(exc))
        print("took=" + str(time.monotonic() - start))
        del os.environ["PYTHONPATH"]
        with LocalWorkers(2) as workers:
            print("again=" + str(workers.running))
    """)
    assert re.search(error, _values(out.stdout, "error")[0])
    took = float(_values(out.stdout, "took")[0])
    assert took < 30 if timeout == 60 else took >= timeout  # no waiting for a worker that exited
    assert _values(out.stdout, "again") == ["True"]
    pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]  # those that ran the sitecustomize
    if os.environ.get("RREFPIPE_FRESH_WORKERS") == "1":
        assert len(pids) == 2
    else:  # the warm process the workers fork from: it exits (then 2 fresh workers), or hangs and is killed
        assert len(pids) == (3 if timeout == 60 else 1)
    wait_gone(pids, within=5)


@pytest.fixture(scope="module")
def one_local_group() -> subprocess.CompletedProcess[str]:
    """The scenarios of the two tests below, in one fresh driver with one group of two local workers
    that it starts first (the largest group of the process): neither scenario stops, kills or adds a
    worker or shuts RPC down, and each closes its pipes. The group is stopped after both."""
    return run_script(textwrap.dedent(_SCENARIO_RUNNER) + textwrap.dedent("""
        import torch, torch.distributed.autograd as dist_autograd
        from torch import nn
        from torch.distributed.optim import DistributedOptimizer
        from rrefpipe import Pipe
        from rrefpipe.skip import pop, skippable, stash
        from workers import LocalWorkers

        def largest_group_first_trains():
            model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
            for balance in ([3], [2, 1]):
                with Pipe(model, chunks=2, balance=balance, workers=group.names[:len(balance)]) as pipe:
                    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
                    with dist_autograd.context() as ctx:
                        pipe.backward(ctx, pipe(torch.randn(4, 4)).local_value().sum())
                        opt.step(ctx)

        @skippable(stash=["s"])
        class Keep(nn.Module):
            def forward(self, x):
                yield stash("s", x)
                return x * 3

        @skippable(pop=["s"])
        class Add(nn.Module):
            def forward(self, x):
                s = yield pop("s")
                return x + s

        def layers_and_factories_of_the_script():
            model = nn.Sequential(Keep(), nn.Linear(2, 2), Add())
            with Pipe(model, chunks=2, balance=[1, 2], workers=group.names) as pipe, torch.no_grad():
                x = torch.randn(4, 2)
                torch.testing.assert_close(pipe(x).local_value(), model(x))
            with Pipe.from_factories([lambda: nn.Linear(2, 3), lambda: nn.Tanh()], chunks=2,
                                     workers=group.names) as pipe:
                assert [len(s.layers) for s in pipe.stages] == [1, 1]
                assert pipe(torch.randn(4, 2)).local_value().shape == (4, 3)

        with LocalWorkers(2) as group:
            scenario(largest_group_first_trains)
            scenario(layers_and_factories_of_the_script)
    """), check=False)


def test_a_larger_group_after_a_smaller_one_says_how_to_keep_rrefs_working(one_local_group):
    """torch's RRef context keeps the process's first RPC group: RRefs owned by workers beyond it fail
    with "could not find destination id"; parameter_rrefs() says why and what to do, and a shared
    group started at the largest size first trains."""
    out = run_script("""
        import torch, torch.distributed.autograd as dist_autograd
        from torch import nn
        from torch.distributed.optim import DistributedOptimizer
        from rrefpipe import Pipe
        from workers import LocalWorkers
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
        with Pipe(model, chunks=2, balance=[3]) as pipe:
            pipe(torch.randn(4, 4))
        with Pipe(model, chunks=2, balance=[2, 1]) as pipe:
            try:
                pipe.parameter_rrefs()
            except RuntimeError as exc:
                print("refused=" + str("largest group first" in str(exc)))
    """).stdout
    assert _values(out, "refused") == ["True"]
    _scenario_passed(one_local_group, "largest_group_first_trains")


def test_layers_and_factories_defined_in_the_users_script(one_local_group):
    """Classes in the driver's __main__ and lambdas reach the workers (sent by value): the two local
    workers of the shared driver above, the skip's stash and pop on their two stages."""
    _scenario_passed(one_local_group, "layers_and_factories_of_the_script")


def test_close_is_prompt_with_a_forked_child_or_after_the_user_shut_rpc_down():
    """A child forked from the driver (a DataLoader worker) holds copies of the workers' stdin pipes:
    close() had waited 10 s and then killed the workers. After the user's own non-graceful
    rpc.shutdown(), close() had raised and left the worker processes unreaped."""
    out = run_script("""
        import multiprocessing, time, torch, torch.distributed.rpc as rpc
        from torch import nn
        from rrefpipe import Pipe
        for case in ("forked child", "user shutdown"):
            pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2, balance=[1, 1])
            procs = pipe._local_workers._procs
            if case == "forked child":
                multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True).start()
            else:
                rpc.shutdown(graceful=False)
            t = time.monotonic()
            pipe.close()
            print(f"{case}: took={time.monotonic() - t:.2f} codes={[p.returncode for p in procs]}")
    """).stdout
    lines = [line for line in out.splitlines() if "took=" in line]
    assert len(lines) == 2, out
    for line in lines:
        assert line.endswith("codes=[0, 0]"), line
        assert float(line.split("took=")[1].split()[0]) < 5, line


def test_the_users_graceful_rpc_shutdown_returns_with_local_workers():
    """rpc.shutdown() (graceful, the default), as at the end of a PyTorch-1.8-style script, waits until
    every worker of the group calls it too; the local workers never did, and it waited forever. They
    now join it at their next ping of the driver, here after training with DistributedOptimizer and
    with a forward's remote reference still held."""
    out = run_script("""
        import time, torch, torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch import nn
        from torch.distributed.optim import DistributedOptimizer
        from rrefpipe import Pipe
        pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2, balance=[1, 1])
        procs = pipe._local_workers._procs
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, pipe(torch.randn(4, 4)).local_value().sum())
            opt.step(ctx)
        with torch.no_grad():
            out = pipe(torch.randn(4, 4))
        t = time.monotonic()
        rpc.shutdown()
        shut = time.monotonic() - t
        t = time.monotonic()
        pipe.close()
        print(f"shutdown={shut:.2f} close={time.monotonic() - t:.2f} codes={[p.returncode for p in procs]}")
    """).stdout
    line = next(line for line in out.splitlines() if line.startswith("shutdown="))
    assert line.endswith("codes=[0, 0]"), line
    values = dict(part.split("=") for part in line.split()[:2])
    assert float(values["shutdown"]) < 15 and float(values["close"]) < 5, line  # a ping interval and the join


def test_pipes_built_from_two_threads_at_once_share_one_group_and_ctrl_c_stays_an_interrupt():
    """Two threads had both started a group (one failed after 14 s: "RPC is already initialized");
    a Ctrl-C while the workers started had become a RuntimeError with an empty reason."""
    out = run_script("""
        import threading, torch
        from torch import nn
        from rrefpipe import Pipe
        import workers.launch
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        pipes, errors = [], []
        def build():
            try:
                pipes.append(Pipe(model, chunks=2, balance=[1, 1]))
            except Exception as exc:
                errors.append(exc)
        threads = [threading.Thread(target=build) for _ in range(2)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(f"built={len(pipes)} errors={errors} shared={pipes[0]._local_workers is pipes[-1]._local_workers}")
        x = torch.randn(4, 4)
        with torch.no_grad():
            for pipe in pipes:
                torch.testing.assert_close(pipe(x).local_value(), model(x))
        for pipe in pipes: pipe.close()
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        workers.launch.init_rpc = interrupted  # Ctrl-C while the group starts
        try:
            Pipe(model, chunks=2, balance=[1, 1])
        except KeyboardInterrupt:
            print("interrupt=KeyboardInterrupt")
    """).stdout
    assert "built=2 errors=[] shared=True" in out and "interrupt=KeyboardInterrupt" in out, out
