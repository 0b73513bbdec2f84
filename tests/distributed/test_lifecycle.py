"""A pipe created, trained and closed 20 times: nothing accumulates (stages, RRefs, contexts, threads)."""
import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import Pipe
from tests.distributed.probes import all_counts
from tests.layers import mlp
from workers.options import STAGE_INTEROP_THREADS

pytestmark = pytest.mark.timeout(180)


def _train_once(names: list[str]) -> None:
    model = mlp([6, 8, 3], seed=0)
    with Pipe(model, chunks=2, checkpoint="always", balance=[2, 1], workers=names[:2]) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        for _ in range(2):
            with dist_autograd.context() as ctx:
                loss = F.cross_entropy(pipe(torch.randn(4, 6)).local_value(), torch.tensor([0, 1, 2, 0]))
                pipe.backward(ctx, loss)
                opt.step(ctx)


def test_twenty_create_use_close_cycles_leak_nothing(cluster):
    _train_once(cluster.names)  # warm: first-use allocations are not leaks
    before = all_counts(cluster.names)
    for _ in range(20):
        _train_once(cluster.names)
    after = all_counts(cluster.names)
    for process in before:
        b, a = before[process], after[process]
        assert a["stages"] == b["stages"] == 0, process
        assert a["contexts"] == 0, process
        # in flight at any moment: at most each worker's liveness ping and this probe; nothing piles up
        assert a["active_calls"] <= len(cluster.names) + 1, (process, b, a)
        assert a["owner_rrefs"] <= b["owner_rrefs"] + 2, (process, b, a)  # freed asynchronously, no growth
        assert a["threads"] <= b["threads"] + 2, (process, b, a)


def test_local_workers_environment_defaults(cluster):
    # torch.set_num_threads binds only the calling thread; OpenMP and MKL read these for the RPC and
    # autograd threads that run the stages (unset, each would start a team as large as the machine).
    # The malloc settings keep activations from page-faulting in afresh on every micro-batch.
    import torch.distributed.rpc as rpc

    from tests.distributed.probes import environment, interop_threads

    import os

    defaults = {"OMP_NUM_THREADS": str(cluster.threads), "MKL_NUM_THREADS": str(cluster.threads),
                "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
    expected = {key: os.environ.get(key, value) for key, value in defaults.items()}  # the user's setting wins
    for name in cluster.names:
        assert rpc.rpc_sync(name, environment, args=(list(expected),)) == expected
        assert rpc.rpc_sync(name, interop_threads) == STAGE_INTEROP_THREADS  # where backward runs


def test_workers_hide_their_start_up_objects_from_the_garbage_collector(cluster):
    # torch's modules and the RPC agent: a full collection would walk them all, stalling the stage
    import torch.distributed.rpc as rpc

    from tests.distributed.probes import frozen_objects

    for name in cluster.names:
        assert rpc.rpc_sync(name, frozen_objects) > 50_000


def test_a_closed_pipe_says_so(cluster):
    """Its stages are gone from the workers: a state dict must not come back empty, nor a forward fail
    obscurely."""
    pipe = Pipe(mlp([6, 8, 3]), chunks=2, balance=[2, 1], workers=cluster.names[:2])
    pipe.close()
    pipe.close()  # twice is fine
    for call in (lambda: pipe(torch.randn(4, 6)), pipe.state_dict, pipe.parameter_rrefs,
                 lambda: pipe.backward(0, torch.zeros(())), lambda: pipe.load_state_dict({})):
        with pytest.raises(RuntimeError, match="this Pipe is closed"):
            call()


def test_a_parent_of_a_closed_pipe_still_switches_modes(cluster):
    """``parent.eval()`` reaches every child, a closed pipe too: there it only sets the flag (it raised,
    so a parent module could not be switched after its pipe was closed)."""
    parent = torch.nn.Module()
    parent.pipe = Pipe(mlp([6, 8, 3]), chunks=2, balance=[2, 1], workers=cluster.names[:2])
    parent.pipe.close()
    parent.eval()
    assert not parent.pipe.training


def test_a_late_delivery_leaves_no_autograd_context_on_the_driver(cluster):
    """The output of a step the driver gave up on (a stage hung past the RPC timeout) can arrive after the
    user left the step's context. Distributed autograd creates that context on the driver again; the
    driver releases it, but never a context the user still holds."""
    import torch.distributed.rpc as rpc

    from rrefpipe import _rpc
    from tests.distributed.probes import (counts, deliver_late_in_a_new_context, deliver_late_in_the_callers_context,
                                          leave_late_context)

    me, worker = rpc.get_worker_info().name, cluster.names[0]
    rpc.rpc_sync(worker, deliver_late_in_a_new_context, args=(me, "no-such-pipe"))
    try:
        assert counts()["contexts"] == 0
    finally:
        rpc.rpc_sync(worker, leave_late_context)
    with dist_autograd.context() as ctx:
        rpc.rpc_sync(worker, deliver_late_in_the_callers_context,
                     args=(me, "no-such-pipe", torch.ones(2, requires_grad=True)))
        assert _rpc.context_exists(ctx)


def test_closing_a_pipe_from_two_threads_releases_its_share_of_the_workers_once(monkeypatch):
    """A second close() that starts while the first releases the embedded workers finds nothing left
    to release (it released them again: the shared group's count fell to zero, and another open pipe
    lost its workers)."""
    import threading
    import types

    import workers.launch as launch

    released = []
    pipe = types.SimpleNamespace(_local_workers="the pipe's share")

    def release(share):
        released.append(share)
        if len(released) == 1:  # the other close() runs now, in the middle of this one
            other = threading.Thread(target=Pipe._stop_local_workers, args=(pipe,))
            other.start()
            other.join(timeout=10)

    monkeypatch.setattr(launch, "release_embedded", release)
    Pipe._stop_local_workers(pipe)
    assert released == ["the pipe's share"] and pipe._local_workers is None
