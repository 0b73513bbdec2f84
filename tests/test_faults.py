"""Faults: nothing hangs, the cause is named, the time to surface is recorded (see the run's summary)."""
from __future__ import annotations

import subprocess
import textwrap
import time

import pytest

from tests.conftest import record_surfacing, run_script

pytestmark = pytest.mark.timeout(120)

PRELUDE = """
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a shell's background job starts with Ctrl-C ignored)
import time, torch, torch.distributed.autograd as dist_autograd
from torch import nn
from rrefpipe import Pipe, StageError, WorkerError
from tests import layers
def report(**kv):
    for k, v in kv.items():
        print(f"{k}={v}")
"""


def _values(out: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line and not line.startswith("["))


def _run(name: str, body: str) -> dict[str, str]:
    proc = run_script(PRELUDE + textwrap.dedent(body))
    print(proc.stderr[-6000:])  # the workers' logs too: pytest shows them when a later assertion fails
    values = _values(proc.stdout)
    assert values, "the script reported nothing"
    for key in ("surfaced", "closed", "exited"):
        if key in values:
            record_surfacing(name, key, float(values[key]))
    return values


@pytest.mark.parametrize("phase, layer", [("forward", "DieInForward"), ("backward", "DieInBackward")])
def test_worker_killed_during_a_step(phase, layer):
    """The stage-1 worker SIGKILLs itself mid-forward or mid-backward: its name comes back at once."""
    v = _run(f"worker killed during {phase}", f"""
        pipe = Pipe(nn.Sequential(nn.Linear(4, 4), layers.{layer}(), nn.Linear(4, 4)), chunks=2,
                    balance=[1, 1, 1], rpc_timeout=30)
        t = time.monotonic()
        try:
            with dist_autograd.context() as ctx:
                pipe.backward(ctx, pipe(torch.randn(4, 4)).local_value().sum())
        except WorkerError as exc:
            report(stage=exc.stage, worker=exc.worker, phase=exc.phase, type=exc.error_type,
                   message=exc.error_message, surfaced=time.monotonic() - t)
        try:  # a control call goes to every stage at once; the one that failed is named
            pipe.state_dict()
        except WorkerError as exc:
            report(control=",".join(map(str, (exc.stage, exc.worker, exc.phase, exc.error_message.split(" (")[0]))))
        t = time.monotonic(); pipe.close(); report(closed=time.monotonic() - t)
    """)
    assert (v["stage"], v["worker"]) == ("1", "worker2")
    assert v["phase"].startswith(phase)
    assert (v["type"], v["message"].split(" (")[0]) == ("WorkerError", "the worker is unreachable")
    assert v["control"] == "1,worker2,state_dict,the worker is unreachable"
    assert float(v["surfaced"]) < 10 and float(v["closed"]) < 15


def test_worker_killed_between_forward_and_backward_is_named_not_its_neighbour():
    """The stage after the dead one is the node that reports the refused gradient send: the
    driver probes the workers and names the dead one."""
    v = _run("worker killed between forward and backward", """
        import os, signal
        pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2,
                    balance=[1, 1, 1], rpc_timeout=30)
        try:
            with dist_autograd.context() as ctx:
                loss = pipe(torch.randn(4, 4)).local_value().sum()
                os.kill(pipe._local_workers.pids[1], signal.SIGKILL)   # worker2 holds stage 1
                pipe._local_workers._procs[1].wait(timeout=10)            # gone before backward starts
                t = time.monotonic()
                pipe.backward(ctx, loss)
        except StageError as exc:
            report(kind=type(exc).__name__, stage=exc.stage, worker=exc.worker, phase=exc.phase,
                   surfaced=time.monotonic() - t)
        # Which report reaches the driver first is a race (its own connection, or stage 2's refused
        # send): explain stage 2's report as it reads when stage 2 is first.
        from rrefpipe import _rpc
        from rrefpipe.driver_side import diagnosis
        node = _rpc.worker_names().index("worker3")
        exc = diagnosis.explain(RuntimeError(f"Error on Node {node}: ECONNREFUSED: connection refused"),
                                "backward", pipe._driver.pipe_id, pipe._driver.workers)
        report(neighbour=f"{type(exc).__name__},{exc.stage},{exc.worker}")
        pipe.close()
    """)
    assert (v["kind"], v["stage"], v["worker"], v["phase"]) == ("WorkerError", "1", "worker2", "backward")
    assert v["neighbour"] == "WorkerError,1,worker2"
    assert float(v["surfaced"]) < 10


def test_a_stage_hung_past_the_rpc_timeout_is_the_one_named():
    """Every stage before a hung one times out waiting for the next, the first stage first: the driver
    pings the workers and names the one whose RPC thread is still stuck (it had named stage 0)."""
    v = _run("stage hung past the RPC timeout", """
        class HangsOnce(nn.Module):  # the fault: the first forward blocks for 6 s, past the 2 s RPC timeout
            calls = 0
            def forward(self, x):
                HangsOnce.calls += 1
                if HangsOnce.calls == 1:
                    time.sleep(6)
                return x
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), HangsOnce())
        with Pipe(model, chunks=1, balance=[1, 1, 1], rpc_timeout=2) as pipe, torch.no_grad():
            t = time.monotonic()
            try:
                pipe(torch.randn(2, 4))
            except WorkerError as exc:
                report(stage=exc.stage, worker=exc.worker, hung="did not answer" in str(exc),
                       surfaced=time.monotonic() - t)
            import torch.distributed.rpc as rpc
            rpc.rpc_sync("worker3", torch.add, args=(1, 1), timeout=30)  # queued behind the hang: it has ended
            x = torch.randn(2, 4)
            torch.testing.assert_close(pipe(x).local_value(), model(x))
            report(after="ok")
    """)
    assert (v["stage"], v["worker"], v["hung"], v["after"]) == ("2", "worker3", "True", "ok")
    assert float(v["surfaced"]) < 6


def test_a_backward_hung_past_the_rpc_timeout_names_its_stage():
    """Backward runs on the autograd thread, so the hung stage's worker still answers pings: the driver
    asks each stage how long its unfinished backward has run (the error had named no stage)."""
    v = _run("backward hung past the RPC timeout", """
        class _Slow(torch.autograd.Function):  # the fault: the first backward blocks for 6 s
            calls = 0
            @staticmethod
            def forward(ctx, x):
                return x.clone()
            @staticmethod
            def backward(ctx, grad):
                _Slow.calls += 1
                if _Slow.calls == 1:
                    time.sleep(6)
                return grad
        class HangsInBackwardOnce(nn.Module):
            def forward(self, x):
                return _Slow.apply(x)
        model = nn.Sequential(nn.Linear(4, 4), HangsInBackwardOnce(), nn.Linear(4, 4))
        with Pipe(model, chunks=1, balance=[1, 1, 1], rpc_timeout=2, checkpoint="never") as pipe:
            try:
                with dist_autograd.context() as ctx:
                    pipe.backward(ctx, pipe(torch.randn(2, 4)).local_value().sum())
            except WorkerError as exc:
                report(stage=exc.stage, worker=exc.worker, hung="past the RPC timeout" in str(exc))
    """)
    assert (v["stage"], v["worker"], v["hung"]) == ("1", "worker2", "True")


# -- Faults that leave every worker up, run as cases of one script -----------------------------------
# Each of these tests ran a script of its own, which started its own stage workers: 10 drivers and 26
# workers, most of a minute of CPU in interpreter start-up alone. None of them kills, hangs or
# interrupts a worker, so they run as cases of one script (``_shared_run``, once per test process), one
# after the other on one group of four local workers: each case builds its own pipes, as a script of its
# own did, and closes them. The group is held by the embedded workers' own count (``acquire_embedded``),
# so a pipe built without ``workers=`` takes them as a script's first pipe would have started them (the
# first n), and one that names its workers finds them in the driver's RPC group, as with a LocalWorkers of
# its own. A case's lines carry its name; its traceback, if it raised, and the stage workers' stderr
# while it ran go to its own test, which fails on them alone (later cases run anyway).
# Kept in scripts of their own: the faults that kill, hang or interrupt, and the gradients in flight after
# a failed backward (which asserts on every context the workers retain, and once aborted its process).

SHARED_PRELUDE = PRELUDE + """
import sys, traceback
import torch.distributed.rpc as rpc
from rrefpipe import _rpc
from workers import launch
CASE = None
def report(**kv):
    for k, v in kv.items():
        print(f"{CASE}\\t{k}={v}", flush=True)
def run_case(name, case):
    global CASE
    CASE = name
    print(f"=== case {name} ===", file=sys.stderr, flush=True)
    try:
        case()
    except Exception:
        for line in traceback.format_exc().splitlines():
            print(f"{name}\\t!{line}", flush=True)
    report(ended=True)
"""

_SHARED: list[tuple[str, str]] = []  # (case name, body), run in this order
_SHARED_TIMEOUT = 100  # the script's, under the tests' 120 s (it runs in the first one's set-up): about 10 s here


def _shared_case(name: str, body: str) -> str:
    _SHARED.append((name, textwrap.dedent(body)))
    return name


class _SharedRun:
    """The shared script's output, by case."""

    def __init__(self, stdout: str, stderr: str, ended: str) -> None:
        self.ended = ended  # how the script ended
        self.values: dict[str, dict[str, str]] = {}
        self.tracebacks: dict[str, list[str]] = {}
        for line in stdout.splitlines():
            case, tab, rest = line.partition("\t")
            if not tab:
                continue
            if rest.startswith("!"):
                self.tracebacks.setdefault(case, []).append(rest[1:])
            else:
                key, _, value = rest.partition("=")
                self.values.setdefault(case, {})[key] = value
        self.stderr_tail = stderr[-3000:]
        self.stderr: dict[str, str] = {}
        for chunk in ("\n" + stderr).split("\n=== case ")[1:]:
            case, _, text = chunk.partition(" ===\n")
            self.stderr[case] = text

    def case(self, name: str, surfacing: str) -> dict[str, str]:
        """Case ``name``'s values; fails with its traceback if it raised, or if it did not end."""
        print(self.stderr.get(name, "")[-6000:])  # the workers' logs while it ran: shown if an assertion fails
        if name in self.tracebacks:
            pytest.fail(f"case {name!r} raised:\n" + "\n".join(self.tracebacks[name]), pytrace=False)
        v = self.values.get(name, {})
        if v.get("ended") != "True":
            pytest.fail(f"case {name!r} did not end: the shared script {self.ended}; it reported {v}, and its "
                        f"stderr ends:\n{self.stderr_tail}", pytrace=False)
        for key in ("surfaced", "closed", "exited"):
            if key in v:
                record_surfacing(surfacing, key, float(v[key]))
        return v

    def check_exit(self) -> None:
        """After a case's own checks: the script exited cleanly once every case had ended (a crash at exit
        fails them all; one before a case ended fails that case and those after it, which did not end)."""
        if all(self.values.get(name, {}).get("ended") == "True" for name, _ in _SHARED):
            assert self.ended == "exited with status 0", f"the shared script {self.ended} after its last case"


@pytest.fixture(scope="module")
def shared_run() -> _SharedRun:
    """Runs every case of ``_SHARED`` in one script, on one group of four local workers, before any of
    their tests asserts (under pytest-xdist, once in each test process that runs one of them)."""
    code = [SHARED_PRELUDE]
    for name, body in _SHARED:
        code.append("def _case():\n" + textwrap.indent(body, "    ") + f"run_case({name!r}, _case)\n")
        if name == _RETAINED_CASE:  # the first case: the group starts once it has run without one
            code.append("hold = launch.acquire_embedded(4, devices=None, rpc_timeout=_rpc.DEFAULT_RPC_TIMEOUT)\n")
    code.append("launch.release_embedded(hold)\n")
    try:
        proc = run_script("".join(code), timeout=_SHARED_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as exc:
        text = [s.decode(errors="replace") if isinstance(s, bytes) else s or "" for s in (exc.stdout, exc.stderr)]
        return _SharedRun(*text, f"was killed after {_SHARED_TIMEOUT} s")
    return _SharedRun(proc.stdout, proc.stderr, f"exited with status {proc.returncode}")


# The first case: it needs a process without an RPC group (the others start one).
_RETAINED_CASE = _shared_case("context kept past its release", """
    from unittest import mock
    dist_autograd._init(0)  # the context container, without an RPC group
    with mock.patch.object(_rpc.rpc, "get_rpc_timeout", return_value=0.2), \\
            mock.patch.object(_rpc, "_RETAIN_MARGIN", 0.0):
        with dist_autograd.context() as ctx:
            _rpc.retain_context(ctx)
        report(released=not _rpc.context_exists(ctx), kept=ctx in _rpc._retained)
        deadline = time.monotonic() + 20
        while ctx in _rpc._retained and time.monotonic() < deadline:  # a condition, with a deadline
            time.sleep(0.01)
        report(dropped=ctx not in _rpc._retained)
""")

_KEPT_CASES = {checkpoint: _shared_case(f"kept for backward after a failed backward, {checkpoint}", f"""
    from rrefpipe import memory
    model = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 4), layers.RaiseInBackward())
    pipe = Pipe(model, chunks=4, balance=[1, 2], checkpoint={checkpoint!r})
    names = [stage.worker for stage in pipe.stages]
    memory.track_workers(names)
    try:
        with dist_autograd.context() as ctx:
            loss = pipe(torch.randn(16, 4)).local_value().sum()
            report(during=[r.saved_now for r in memory.worker_reports(names)])
            try:
                pipe.backward(ctx, loss)
            except StageError as exc:
                report(failed=exc.stage)
        report(after=[r.saved_now for r in memory.worker_reports(names)])
        pipe.close()
    finally:  # the next case's workers count from nothing, as fresh ones would
        for name in names:
            rpc.rpc_sync(name, memory.stop_tracking)
""") for checkpoint in ["always", "except_last"]}

_RAISING = [
    ("RaiseInBackward()", "never", ("backward", "Error", "gradient of the wrong shape")),
    # a layer's own words for a connection are not TensorPipe's: still the layer's error, not a lost worker
    ("RaiseInBackward('timeout: the file was closed')", "never", ("backward", "Error", "timeout: the file was closed")),
    ("RaiseInRecompute()", "always", ("recompute", "IndexError", "only on recompute")),
    ("DiffersOnRecompute()", "always", ("recompute", "RuntimeError",
                                      "checkpointing: the recomputed forward saved 2 tensors for backward where the "
                                      "first saved 1, or of other shapes, dtypes or devices: the stage's forward must "
                                      "do the same work when run again")),
]
_RAISING_CASES = {(layer, checkpoint): _shared_case(f"stage raising {layer}, checkpoint={checkpoint}", f"""
    model = nn.Sequential(nn.Linear(4, 4), layers.{layer}, nn.Linear(4, 4))
    pipe = Pipe(model, chunks=2, checkpoint="{checkpoint}", balance=[1, 1, 1])
    t = time.monotonic()
    try:
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, pipe(torch.randn(4, 4)).local_value().sum())
    except StageError as exc:
        report(stage=exc.stage, worker=exc.worker, phase=exc.phase, type=exc.error_type,
               message=exc.error_message, lost=isinstance(exc, WorkerError), surfaced=time.monotonic() - t)
    with torch.no_grad():  # the same pipe keeps working
        x = torch.randn(4, 4)
        torch.testing.assert_close(pipe(x).local_value(), model(x))
    report(next_step="ok")
    pipe.close()
""") for layer, checkpoint, _ in _RAISING}

_ANOTHER_PIPE_CASES = {shared: _shared_case(f"another pipe's backward, {'shared' if shared else 'own'} workers", f"""
    from tests.distributed.probes import check_transparent
    a_model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    b_model = nn.Sequential(nn.Linear(4, 4), layers.RaiseInBackward("B's gradient is wrong"), nn.Linear(4, 2))
    b_workers = ["worker2", "worker1"] if {shared} else ["worker3", "worker4"]
    a = Pipe(a_model, chunks=2, balance=[1, 1], workers=["worker1", "worker2"])
    b = Pipe(b_model, chunks=2, balance=[1, 2], workers=b_workers)
    x = torch.randn(4, 4)
    t = time.monotonic()
    try:
        with dist_autograd.context() as ctx:
            a.backward(ctx, a(x).local_value().sum() + b(x).local_value().sum())
    except StageError as exc:
        held = (f"holds stage 0 of pipe {{a._driver.pipe_id}}, stage 1 of pipe {{b._driver.pipe_id}} in this "
                "backward; which one raised is not known")
        report(stage=exc.stage, worker=exc.worker, phase=exc.phase, cause="B's gradient is wrong" in str(exc),
               both=held in str(exc), surfaced=time.monotonic() - t)
    check_transparent(a, a_model, torch.randn(4, 4, requires_grad=True))
    with torch.no_grad():
        torch.testing.assert_close(b(x).local_value(), b_model(x))
    report(next_steps="ok")
    a.close()
    b.close()
""") for shared in [False, True]}

# The last case: it patches how a worker takes in skips (and undoes it).
_SKIP_CASE = _shared_case("skip that cannot be taken in", """
    from tests.distributed.probes import check_transparent, fail_skip_arrivals
    model = nn.Sequential(layers.StashInput(), nn.Linear(4, 4), nn.Linear(4, 4), layers.PopAdd())
    pipe = Pipe(model, chunks=2, balance=[2, 2], rpc_timeout=30)
    rpc.rpc_sync(pipe.stages[1].worker, fail_skip_arrivals, args=("no room for the skip",))
    t = time.monotonic()
    try:
        with dist_autograd.context() as ctx:
            pipe(torch.randn(4, 4))
    except StageError as exc:
        report(stage=exc.stage, worker=exc.worker, microbatch=exc.microbatch, phase=exc.phase,
               cause="no room for the skip" in str(exc), surfaced=time.monotonic() - t)
    rpc.rpc_sync(pipe.stages[1].worker, fail_skip_arrivals, args=(None,))
    check_transparent(pipe, model, torch.randn(4, 4, requires_grad=True))
    report(next_step="ok")
    pipe.close()
""")


@pytest.mark.parametrize("layer, checkpoint, expected", _RAISING)
def test_stage_raising_in_backward_names_it_and_the_next_step_works(shared_run, layer, checkpoint, expected):
    v = shared_run.case(_RAISING_CASES[layer, checkpoint], f"stage raising in {expected[0]}")
    assert (v["stage"], v["worker"]) == ("1", "worker2")
    assert (v["phase"], v["type"], v["message"], v["lost"]) == (*expected, "False")
    assert v["next_step"] == "ok"
    shared_run.check_exit()


@pytest.mark.parametrize("shared", [False, True], ids=["own workers", "shared workers"])
def test_a_stage_failing_in_another_pipes_backward_is_named(shared_run, shared):
    """Two pipes' losses in one backward, run by pipe A, where pipe B's stage 1 raises: the error named
    no stage (torch's "Error on Node ..." text). A layer's own error in backward names no stage, so on a
    worker that also holds A's stage 0 the error names that one and says that either may have raised
    (it named A's stage 0 alone). Both pipes go on. On four local workers of the shared script's own, as
    every failing backward here: the session's shared workers stay out of it."""
    v = shared_run.case(_ANOTHER_PIPE_CASES[shared], "stage raising in another pipe's backward")
    expected = ("0", "worker1", "True") if shared else ("1", "worker4", "False")
    assert (v["stage"], v["worker"], v["both"]) == expected
    assert (v["phase"], v["cause"], v["next_steps"]) == ("backward", "True", "ok")
    shared_run.check_exit()


def test_gradients_still_in_flight_after_a_failed_backward_harm_nothing(tmp_path):
    """Pipe B's stage raises while pipe A's backward is held on its last stage until the context has
    been released; then A's gradient reaches a stage that has dropped the context, and that error comes
    back to the driver. torch's callback for it pointed at the freed context: the script aborted
    (glibc's ``e != ESRCH``) or a later, healthy backward failed with the late error
    ("Could not find autograd context"). Now the failed contexts are kept until their RPCs end."""
    v = _run("gradients in flight after a failed backward", f"""
        import pathlib
        from workers import LocalWorkers
        import torch.distributed.rpc as rpc
        from tests.distributed.probes import check_transparent, retained_contexts
        folder = pathlib.Path({str(tmp_path)!r})
        with LocalWorkers(4) as workers:
            a_model = nn.Sequential(nn.Linear(4, 4), layers.AwaitsFiles(str(folder)), nn.Linear(4, 2))
            b_model = nn.Sequential(nn.Linear(4, 4), layers.RaiseInBackward("B's gradient is wrong"), nn.Linear(4, 2))
            a = Pipe(a_model, chunks=1, balance=[1, 2], workers=["worker1", "worker2"])
            b = Pipe(b_model, chunks=2, balance=[1, 2], workers=["worker3", "worker4"])
            failed, contexts = 0, []
            for step in range(8):  # a late error landed on the next context, if it did, at random
                x = torch.randn(4, 4)
                try:
                    with dist_autograd.context() as ctx:
                        contexts.append(ctx)
                        a.backward(ctx, a(x).local_value().sum() + b(x).local_value().sum())
                except StageError as exc:
                    failed += exc.worker == "worker4" and "B's gradient is wrong" in str(exc)
                (folder / f"released-{{step}}").touch()  # A's held backward goes on, into a released context
            report(failed=failed)
            for name in ["driver", "worker1", "worker2", "worker3", "worker4"]:
                report(**{{f"retained_{{name}}": rpc.rpc_sync(name, retained_contexts) == contexts}})
            for step in range(3):  # A's layer lets these through: their files are there
                (folder / f"healthy-{{step}}").touch()
                check_transparent(a, a_model, torch.randn(4, 4, requires_grad=True))
            report(next_steps="ok")
            for pipe in (a, b):
                pipe.close()
    """)
    assert (v["failed"], v["next_steps"]) == ("8", "ok")
    assert {k: v[k] for k in v if k.startswith("retained")} == {
        f"retained_{name}": "True" for name in ["driver", "worker1", "worker2", "worker3", "worker4"]}


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_failed_backward_keeps_no_checkpointed_activations(shared_run, checkpoint):
    """The contexts kept after a failed backward hold its graph, and with it what the stages keep for
    backward. Checkpointed runs give theirs up when the backward fails (a retry after running out of
    memory needs it back); what is not checkpointed (the last micro-batch with 'except_last') stays with
    the graph for the RPC timeout."""
    v = shared_run.case(_KEPT_CASES[checkpoint], "kept for backward after a failed backward")
    during, after = eval(v["during"]), eval(v["after"])
    assert v["failed"] == "1" and all(during)
    if checkpoint == "always":
        assert after == [0, 0]
    else:  # (stage 0's micro-batches are views of one input: its storage counts until the last one goes)
        assert all(0 < a <= d for a, d in zip(after, during)) and after[1] < during[1], (during, after)
    shared_run.check_exit()


def test_a_retained_context_outlives_its_release_by_the_rpc_timeout(shared_run):
    """The context of a failed backward (above) is kept past its release, and dropped once its RPCs
    have all ended: the RPC timeout (here 0.2 s) and a margin (here none) later."""
    v = shared_run.case(_RETAINED_CASE, "context kept past its release")
    assert (v["released"], v["kept"], v["dropped"]) == ("True", "True", "True")
    shared_run.check_exit()


def test_a_skip_that_cannot_be_taken_in_fails_the_step_at_once(shared_run):
    """The stage that pops a skip fails to take it in (a device copy out of memory, say): its
    micro-batch fails with that cause, naming the stage, at once. It waited for the skip until the RPC
    timeout. The pipe then trains on."""
    v = shared_run.case(_SKIP_CASE, "skip that cannot be taken in")
    assert (v["stage"], v["worker"], v["microbatch"]) == ("1", "worker2", "0")
    assert v["phase"].startswith("forward") and "skip" in v["phase"]
    assert (v["cause"], v["next_step"]) == ("True", "ok")
    assert float(v["surfaced"]) < 10
    shared_run.check_exit()


def test_a_remote_output_left_out_of_the_loss_is_named_when_backward_times_out():
    """With ``remote_output=True`` the driver cannot see which fetched outputs reach the loss, so a
    forward left out of it makes backward wait for the RPC timeout; the error then says so."""
    v = _run("remote output left out of the loss", """
        pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), chunks=2, balance=[1, 1],
                    remote_output=True, rpc_timeout=3)
        t = time.monotonic()
        try:
            with dist_autograd.context() as ctx:
                pipe(torch.randn(4, 4))  # a metric, say, computed with gradients on
                pipe.backward(ctx, pipe(torch.randn(4, 4)).to_here().sum())
        except RuntimeError as exc:
            report(explained="2 forward(s) of this pipe ran in this context" in str(exc)
                   and "remote_output=True" in str(exc), surfaced=time.monotonic() - t)
        with torch.no_grad():  # the pipe still works
            report(next_step=tuple(pipe(torch.randn(4, 4)).to_here().shape))
        pipe.close()
    """)
    assert v["explained"] == "True"
    assert v["next_step"] == "(4, 4)"


def test_ctrl_c_during_a_forward_interrupts_it_and_the_pipe_still_trains():
    """KeyboardInterrupt reaches the caller while stage 1 still computes; the workers finish the
    abandoned step on their own, and the next steps give the plain model's outputs and gradients."""
    v = _run("Ctrl-C during a forward", """
        from tests.distributed.probes import check_transparent
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), layers.InterruptDriver(), nn.Tanh(), nn.Linear(6, 2))
        pipe = Pipe(model, chunks=4, balance=[1, 2, 1])
        t = time.monotonic()
        try:
            with dist_autograd.context() as ctx:
                pipe.backward(ctx, pipe(torch.randn(8, 4)).local_value().sum())
            report(interrupted=False)
        except KeyboardInterrupt:
            report(interrupted=True, surfaced=time.monotonic() - t)
        for _ in range(2):
            check_transparent(pipe, model, torch.randn(8, 4, requires_grad=True))
        report(next_steps="ok")
        pipe.close()
    """)
    assert v["interrupted"] == "True"
    assert v["next_steps"] == "ok"


@pytest.mark.parametrize("remote_output", [False, True])
def test_ctrl_c_reaches_the_caller_while_the_step_is_still_held(tmp_path, remote_output):
    """The forward waits where Ctrl-C can interrupt it, also with the output kept on the last worker
    (there it waited in the RPC future, which KeyboardInterrupt reached only when the step ended)."""
    v = _run("Ctrl-C during a held step", f"""
        from pathlib import Path
        folder = {str(tmp_path)!r}
        model = nn.Sequential(nn.Linear(4, 6), layers.InterruptDriverAndHold(folder), nn.Linear(6, 2))
        pipe = Pipe(model, chunks=2, balance=[1, 2], remote_output={remote_output}, rpc_timeout=60)
        try:
            with torch.no_grad():
                pipe(torch.randn(4, 4))
            report(interrupted=False)
        except KeyboardInterrupt:
            held = not (Path(folder) / "left").exists()
            (Path(folder) / "released").touch()
            report(interrupted=True, held=held)
        with torch.no_grad():  # the abandoned step ends on the workers; the pipe goes on
            torch.testing.assert_close(pipe(torch.ones(2, 4)).to_here(), model(torch.ones(2, 4)))
        report(next_step="ok")
        pipe.close()
    """)
    assert (v["interrupted"], v["held"], v["next_step"]) == ("True", "True", "ok")


def test_ctrl_c_during_a_control_call_reaches_the_caller(tmp_path):
    """A control call (here ``state_dict()``) that a stage holds waits where Ctrl-C can interrupt it;
    it waited in torch's future, which KeyboardInterrupt reached only when the call ended (the RPC
    timeout, for a stage that never answers). The abandoned call ends on the worker; the pipe goes on."""
    v = _run("Ctrl-C during a control call", f"""
        from pathlib import Path
        folder = {str(tmp_path)!r}
        # one stage: the driver waits for its reply right after sending the call
        model = nn.Sequential(layers.InterruptDriverInStateDict(folder), nn.Linear(4, 6), nn.Linear(6, 2))
        pipe = Pipe(model, chunks=2, balance=[3], rpc_timeout=60)
        t = time.monotonic()
        try:
            pipe.state_dict()
            report(interrupted=False)
        except KeyboardInterrupt:
            held = not (Path(folder) / "left").exists()
            (Path(folder) / "released").touch()
            report(interrupted=True, held=held, surfaced=time.monotonic() - t)
        state = pipe.state_dict()
        report(same=state.keys() == model.state_dict().keys()
               and all(torch.equal(state[k], model.state_dict()[k]) for k in state))
        pipe.close()
    """)
    assert (v["interrupted"], v["held"], v["same"]) == ("True", "True", "True")


def test_ctrl_c_while_a_stage_is_built_leaves_no_stage_behind(tmp_path):
    """Ctrl-C while a worker builds a stage (a large factory, say): the pipe is not made, and the stage
    built after the driver gave up is dropped from that worker, which other pipes share."""
    v = _run("Ctrl-C while a stage is built", f"""
        from pathlib import Path
        import torch.distributed.rpc as rpc
        from tests.distributed.probes import stage_count
        folder = {str(tmp_path)!r}
        kept = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        keeper = Pipe(kept, chunks=1, balance=[1, 1])
        try:
            Pipe(nn.Sequential(layers.InterruptDriverWhenBuilt(folder), nn.Linear(4, 2)), chunks=1, balance=[1, 1])
            report(interrupted=False)
        except KeyboardInterrupt:
            held = not (Path(folder) / "left").exists()
            (Path(folder) / "released").touch()
            report(interrupted=True, held=held)
        report(stages=[rpc.rpc_sync(w, stage_count) for w in ("worker1", "worker2")])
        with torch.no_grad():
            torch.testing.assert_close(keeper(torch.ones(2, 4)).local_value(), kept(torch.ones(2, 4)))
        keeper.close()
    """)
    assert (v["interrupted"], v["held"], v["stages"]) == ("True", "True", "[1, 1]")


def test_interpreter_exit_with_a_dead_worker_is_prompt():
    start = time.monotonic()
    v = _run("exit with a dead worker", """
        import os, signal
        pipe = Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), balance=[1, 1])
        os.kill(pipe._local_workers.pids[0], signal.SIGKILL)
        report(pids=" ".join(map(str, pipe._local_workers.pids)))
        # no close(): the atexit hook must still return promptly
    """)
    exited = time.monotonic() - start
    record_surfacing("exit with a dead worker", "exited (whole script)", exited)
    from tests.conftest import pid_alive

    assert exited < 60
    assert not any(pid_alive(int(p)) for p in v["pids"].split())


def test_two_pipes_share_the_embedded_workers():
    v = _run("two pipes in one process", """
        a_model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        b_model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1))
        a = Pipe(a_model, chunks=2, balance=[1, 1])
        b = Pipe(b_model, chunks=3, balance=[2, 1])
        assert a._local_workers is b._local_workers
        x = torch.randn(6, 3)
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(a(x).local_value(), a_model(x))
                torch.testing.assert_close(b(x).local_value(), b_model(x))
            pids = b._local_workers.pids
            a.close()                                   # b keeps its workers
            torch.testing.assert_close(b(x).local_value(), b_model(x))
        try:
            Pipe(nn.Sequential(*[nn.Linear(3, 3) for _ in range(3)]), balance=[1, 1, 1])
        except ValueError as exc:
            report(too_many=str(exc))
        b.close()
        from tests.conftest import pid_alive
        report(workers_left=sum(pid_alive(p) for p in pids))
    """)
    assert "needs 3 local stage workers, but another open pipe started 2" in v["too_many"]
    assert v["workers_left"] == "0"
