"""What ran where and when: overlap of stages, order within a stage, recomputation, no deadlock."""
import copy

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import Pipe
from tests.distributed.probes import stage_gradients
from tests.layers import AwaitsFiles, SignalsRecompute, mlp, twin

pytestmark = pytest.mark.timeout(120)


def _forwards(events, stage):
    return sorted((e for e in events if e.stage == stage and e.kind == "forward"), key=lambda e: e.start)


def test_stages_overlap_and_each_runs_its_microbatches_in_order(cluster):
    torch.manual_seed(0)
    # ~30 ms of compute per micro-batch and stage: far longer than a hop (~1 ms), so overlap must show
    layers = [m for _ in range(6) for m in (nn.Linear(1024, 1024), nn.ReLU())]
    with Pipe(nn.Sequential(*layers), chunks=8, balance=[6, 6], workers=cluster.names[:2]) as pipe:
        x = torch.randn(1024, 1024)
        with torch.no_grad():
            pipe(x)
        events = pipe.execution_record()
    first, second = _forwards(events, 0), _forwards(events, 1)
    for stage in (first, second):
        assert [e.microbatch for e in stage] == list(range(8))  # in order
        assert all(a.end <= b.start for a, b in zip(stage, stage[1:]))  # one at a time
    # stage 1 computes while stage 0 does: some forward of one overlaps some forward of the other (not
    # necessarily micro-batch i beside i+1: stage 0 may run ahead by several, as it did once in CI)
    overlapping = [(a.microbatch, b.microbatch) for a in first for b in second if a.start < b.end and b.start < a.end]
    assert overlapping, f"no overlap between stages:\n{[(e.stage, e.microbatch, e.start, e.end) for e in events]}"
    assert all(second[i].start >= first[i].end for i in range(8))  # and never before its input exists


def test_64_microbatches_through_3_stages_with_default_thread_pool(cluster):
    model = mlp([4, 8, 8, 4], seed=1)
    x = torch.randn(128, 4, requires_grad=True)
    with Pipe(model, chunks=64, balance=[2, 2, 1], workers=cluster.names[:3]) as pipe:
        with dist_autograd.context() as ctx:
            out = pipe(x).local_value()
            dist_autograd.backward(ctx, [out.sum()])
            x_grad = dist_autograd.get_gradients(ctx)[x]
        events = pipe.execution_record()
    reference = twin(model)
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).sum().backward()
    torch.testing.assert_close(x_grad, x_ref.grad)
    assert sum(e.kind == "forward" for e in events) == 3 * 64
    assert sum(e.kind == "backward" for e in events) == 3 * 64


def test_last_stage_runs_backward_from_the_last_microbatch_one_at_a_time(cluster):
    # The last stage gets every gradient of a step in one message and runs them as one autograd task,
    # in the order of the nodes' sequence numbers; its single RPC thread makes that micro-batch order,
    # so each input gradient leaves for the previous stage before the next micro-batch starts.
    model = mlp([4, 8, 8, 4], seed=3)
    x = torch.randn(24, 4)
    with Pipe(model, chunks=6, balance=[2, 3], workers=cluster.names[:2]) as pipe:
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [pipe(x).local_value().sum()])
        events = pipe.execution_record()
    last = sorted((e for e in events if e.stage == 1 and e.kind == "backward"), key=lambda e: e.start)
    assert [e.microbatch for e in last] == [5, 4, 3, 2, 1, 0]
    assert all(a.end <= b.start for a, b in zip(last, last[1:])), [(e.microbatch, e.start, e.end) for e in last]


def test_first_stage_runs_one_microbatch_backward_at_a_time(cluster):
    # Each gradient message starts a backward task on the worker's inter-op pool; with one inter-op
    # thread (workers.options.STAGE_INTEROP_THREADS) they run one after another, as in GPipe, instead
    # of two at once taking a core from the other stages. Stage 0 is made the slow one in backward,
    # so gradients queue up there.
    model = nn.Sequential(*mlp([64, 512, 512, 512, 64], seed=4), nn.Linear(64, 4))
    x = torch.randn(96, 64)
    with Pipe(model, chunks=6, checkpoint="never", balance=[7, 1], workers=cluster.names[:2]) as pipe:
        for _ in range(2):
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [pipe(x).local_value().sum()])
        events = pipe.execution_record()
    for step in {e.step for e in events}:
        first = sorted((e for e in events if e.stage == 0 and e.kind == "backward" and e.step == step),
                       key=lambda e: e.start)
        assert len(first) == 6
        assert all(a.end <= b.start for a, b in zip(first, first[1:])), [(e.microbatch, e.start, e.end) for e in first]


@pytest.mark.parametrize("checkpoint, recomputed", [("always", 4), ("except_last", 3), ("never", 0)])
def test_checkpointing_recomputes_the_right_microbatches(cluster, checkpoint, recomputed):
    model = mlp([4, 8, 4], seed=2)
    with Pipe(model, chunks=4, checkpoint=checkpoint, balance=[1, 2], workers=cluster.names[:2]) as pipe:
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [pipe(torch.randn(8, 4)).local_value().sum()])
        events = pipe.execution_record(clear=True)
        assert pipe.execution_record() == []
    for stage in (0, 1):
        recomputes = sorted(e.microbatch for e in events if e.stage == stage and e.kind == "recompute")
        assert recomputes == list(range(recomputed))
        assert sum(e.stage == stage and e.kind == "forward" for e in events) == 4
        # the input needs no gradient: stage 0's backward still ends (after its forward's last node)
        backward = sorted(e.microbatch for e in events if e.stage == stage and e.kind == "backward")
        assert backward == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["eval", "no_grad"])
def test_eval_and_no_grad_keep_no_checkpoint_or_autograd_state(cluster, mode):
    model = mlp([4, 8, 4], seed=2)
    with Pipe(model, chunks=4, checkpoint="always", balance=[1, 2], workers=cluster.names[:2]) as pipe:
        x = torch.randn(8, 4)
        if mode == "eval":
            pipe.eval()
            with dist_autograd.context() as ctx:
                out = pipe(x).local_value()
                dist_autograd.backward(ctx, [out.sum()])  # gradients still flow in eval mode
        else:
            with dist_autograd.context(), torch.no_grad():
                out = pipe(x).local_value()
            assert out.grad_fn is None and not out.requires_grad
        kinds = {e.kind for e in pipe.execution_record()}
    assert "recompute" not in kinds
    assert ("backward" in kinds) == (mode == "eval")
    torch.testing.assert_close(out, model(x))


def test_seed_example(cluster):
    """The example of PyTorch's Pipe documentation, on CPU stage workers."""
    fc1, fc2 = nn.Linear(16, 8), nn.Linear(8, 4)
    model = nn.Sequential(fc1, fc2)
    with Pipe(model, chunks=8, balance=[1, 1], workers=cluster.names[:2]) as pipe:
        x = torch.rand(16, 16)
        with pytest.warns(UserWarning, match="outside dist_autograd.context"):  # as the documentation ran it
            output_rref = pipe(x)
        output = output_rref.local_value()
        assert output_rref.is_owner()
        torch.testing.assert_close(output, model(x))
        torch.testing.assert_close(output_rref.to_here(), output)
        assert [s.worker for s in pipe.stages] == cluster.names[:2]
        assert "stage 1: worker 'worker2' on cpu, layers 1: Linear" in str(pipe)


def test_remote_output_stays_on_last_worker(cluster):
    model = mlp([4, 8, 4], seed=5)
    x = torch.randn(6, 4, requires_grad=True)
    with Pipe(model, chunks=3, balance=[1, 2], workers=cluster.names[:2], remote_output=True) as pipe:
        with dist_autograd.context() as ctx:
            rref = pipe(x)
            assert rref.owner().name == "worker2" and not rref.is_owner()
            out = rref.to_here()
            dist_autograd.backward(ctx, [out.sum()])
            x_grad = dist_autograd.get_gradients(ctx)[x]
    x_ref = x.detach().clone().requires_grad_()
    reference = twin(model)
    torch.testing.assert_close(out, reference(x_ref))
    reference(x_ref).sum().backward()
    torch.testing.assert_close(x_grad, x_ref.grad)


def test_stages_built_on_workers_from_factories(cluster):
    from tests.layers import make_head, make_tail

    plain = nn.Sequential(*make_head(), *make_tail())
    with Pipe.from_factories([make_head, make_tail], chunks=2, workers=cluster.names[:2]) as pipe:
        assert list(pipe.state_dict()) == list(plain.state_dict())
        assert [len(s.layers) for s in pipe.stages] == [2, 3]
        x = torch.randn(4, 5)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), plain(x))


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_earlier_stages_recompute_ahead_of_their_gradients(cluster, tmp_path, checkpoint):
    """Stage 0 recomputes micro-batch i while stage 1 still runs i's backward: stage 1 holds i's
    gradient until stage 0 has recomputed i (so a recomputation left for backward would wait forever,
    and the test would fail on the layer's deadline), and the gradients are still those of the model."""
    torch.manual_seed(0)
    folder = str(tmp_path)
    offset = 1 if checkpoint == "except_last" else 0  # stage 0 does not recompute the last micro-batch
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4), nn.Identity())
    model = nn.Sequential(plain[0], SignalsRecompute(folder), plain[2], AwaitsFiles(folder, offset))
    x = torch.randn(16, 4)
    with Pipe(model, chunks=4, checkpoint=checkpoint, balance=[2, 2], workers=cluster.names[:2]) as pipe:
        with dist_autograd.context() as ctx:
            pipe.backward(ctx, pipe(x).local_value().square().sum())
            grads = stage_gradients(pipe, ctx)
        events = pipe.execution_record()
    recomputes = sorted(e.microbatch for e in events if e.stage == 0 and e.kind == "recompute")
    assert recomputes == list(range(4 - offset))  # once each
    plain(x).square().sum().backward()
    assert grads.keys() == {name for name, _ in plain.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name}: {m}")


def test_always_keeps_every_micro_batchs_input_until_backward(cluster):
    """What checkpointing keeps is what memory tracking counts: each stage's inputs, all micro-batches
    of the step at once (a checkpointed run keeps the input tensors themselves, so their lifetime is the
    memory's), and nothing once backward is done."""
    from rrefpipe import memory

    model = mlp([16, 64, 64, 8], seed=4)
    x = torch.randn(32, 16)
    with Pipe(model, chunks=4, checkpoint="always", balance=[2, 3], workers=cluster.names[:2]) as pipe:
        names = [s.worker for s in pipe.stages]
        memory.track_workers(names)
        try:
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [pipe(x).local_value().sum()])
            reports = memory.worker_reports(names, reset=True)
        finally:
            for name in names:
                rpc.rpc_sync(name, memory.stop_tracking)
    assert [r.saved_peak for r in reports] == [32 * 16 * 4, 32 * 64 * 4], reports
    assert [r.saved_now for r in reports] == [0, 0], reports


def test_dtype_conversions_reach_the_stages_and_device_moves_are_refused(cluster):
    """pipe.double() converts the stages on their workers (as model.double() would the layers), in place:
    RRefs taken before still reach the parameters. What cannot reach them raises instead of doing nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    plain = copy.deepcopy(model).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    with Pipe(model, chunks=2, balance=[2, 1], checkpoint="never", workers=cluster.names[:2]) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.1)
        assert pipe.double() is pipe
        assert {v.dtype for v in pipe.state_dict().values()} == {torch.float64}
        with dist_autograd.context() as ctx:
            out = pipe(x).local_value()
            pipe.backward(ctx, out.square().sum())
            opt.step(ctx)
        torch.testing.assert_close(out, plain(x))
        plain(x).square().sum().backward()
        with torch.no_grad():
            for p in plain.parameters():
                p -= 0.1 * p.grad
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(pipe.state_dict()[key], value, msg=lambda m: f"{key}: {m}")
        assert pipe.to(dtype=torch.float32) is pipe
        assert {v.dtype for v in pipe.state_dict().values()} == {torch.float32}
        for unreachable in (lambda: pipe.to("cpu"), lambda: pipe.to(torch.zeros(1)), pipe.cuda,
                            lambda: pipe.apply(lambda m: None), lambda: nn.Sequential(pipe).to(torch.float64),
                            lambda: pipe.to(torch.int64)):
            with pytest.raises(TypeError):
                unreachable()
        # Walks over the layers that would find none here raise too, rather than do nothing (a loop freezing
        # BatchNorm layers, say); a parent's own walk passes over them, as over their parameters.
        for walk, what in ((pipe.modules, "layers"), (pipe.named_modules, "layers"), (pipe.buffers, "buffers"),
                           (pipe.named_buffers, "buffers"), (lambda: [pipe.requires_grad_(False)], "requires_grad_")):
            with pytest.raises(TypeError, match=what):
                list(walk())
        assert list(nn.Sequential(pipe).modules())[1:] == [pipe]
        with pytest.warns(UserWarning, match="keep_vars=True.*CPU copies"):
            kept = pipe.state_dict(keep_vars=True)
        assert kept.keys() == plain.state_dict().keys()


def test_a_memory_format_reaches_the_stages_in_place(cluster):
    """pipe.to(memory_format=torch.channels_last) re-lays the stages' 4-D weights on their workers, as
    model.to(memory_format=...) would, keeping the Parameter objects that RRefs taken before reach."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
    plain = copy.deepcopy(model)
    x = torch.randn(4, 3, 6, 6)
    with Pipe(model, chunks=2, balance=[2, 1], checkpoint="never", workers=cluster.names[:2]) as pipe:
        weights = [r for r in pipe.parameter_rrefs() if r.rpc_sync().dim() == 4]
        assert len(weights) == 2
        def channels_last():
            return [w.rpc_sync().is_contiguous(memory_format=torch.channels_last) for w in weights]

        assert channels_last() == [False, False]
        assert pipe.to(memory_format=torch.channels_last) is pipe
        assert channels_last() == [True, True]
        with dist_autograd.context() as ctx:
            out = pipe(x).local_value()
            pipe.backward(ctx, out.square().sum())
            grads = stage_gradients(pipe, ctx)
        torch.testing.assert_close(out, plain(x))
        plain(x).square().sum().backward()
        assert set(grads) == {name for name, _ in plain.named_parameters()}
        for name, p in plain.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=lambda m: f"{name}: {m}")
        with pytest.raises(TypeError, match="memory_format"):
            pipe.to(memory_format="channels_last")
