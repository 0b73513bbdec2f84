"""GPU scenarios. Each runs in a fresh interpreter (its own RPC group and local stage workers), started
by ``tests/gpu/test_cuda.py``; the functions that run *on* a stage worker are here too, so that the
workers can import them."""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer

import rrefpipe.optim
from rrefpipe import GradScaler, Pipe, memory
from rrefpipe.optim import RemoteLRScheduler, load_optimizer_state_dict, optimizer_state_dict
from tests.distributed import probes
from tests.layers import UNREACHED_CASES, mlp, partly_unreached, skip_model
from tests.training import (batches_with_overflows, blobs, model_that_overflows, pipe_steps, plain_steps,
                            train_side_by_side)

#: The device of the GPU stages. Setting it to "cpu" dry-runs the scenarios on a machine without one.
GPU = os.environ.get("RREFPIPE_TEST_GPU", "cuda:0")

# Micro-batches run through other GPU kernels than the whole batch (another size, another reduction
# order), so results agree to rounding, not bit for bit.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def check_transparent(pipe: Pipe, model: nn.Module, x: Tensor) -> None:
    """The pipe against ``model`` run whole on the GPU (``probes.check_transparent``)."""
    probes.check_transparent(pipe, model, x, device=GPU, **TOLERANCE)


def transparency(checkpoint: str) -> None:
    model = mlp([5, 8, 8, 6, 3])  # 7 layers
    x = torch.randn(8, 5, requires_grad=True)
    with Pipe(model, chunks=4, checkpoint=checkpoint, balance=[3, 4], devices=[GPU, GPU]) as pipe:
        assert [s.device for s in pipe.stages] == [GPU, GPU]
        check_transparent(pipe, model, x)
        check_transparent(pipe, model, torch.randn(5, 5, requires_grad=True))  # uneven micro-batches


def skips_between_gpu_workers() -> None:
    """A skip from stage 0 popped on stage 2, passing stage 1's worker by (over a map that skips a
    worker), and one inside stage 1."""
    model = skip_model(width=6)
    x = torch.randn(9, 6, requires_grad=True)
    for checkpoint in ("always", "never"):
        with Pipe(model, chunks=3, checkpoint=checkpoint, balance=[2, 3, 2], devices=[GPU] * 3) as pipe:
            check_transparent(pipe, model, x)


def mixed_devices(devices: list[str]) -> None:
    model = mlp([5, 8, 8, 6, 3])
    x = torch.randn(8, 5, requires_grad=True)
    with Pipe(model, chunks=4, balance=[3, 4], devices=devices) as pipe:
        assert [s.device for s in pipe.stages] == devices
        check_transparent(pipe, model, x)


def stages_follow_the_layers_devices() -> None:
    """Layers already on the GPU: the stages go there, and the caller's module is left as it was."""
    model = mlp([5, 8, 8, 6, 3]).to(GPU)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 5, requires_grad=True)
    with Pipe(model, chunks=2, balance=[3, 4]) as pipe:
        assert [s.device for s in pipe.stages] == [GPU, GPU]
        check_transparent(pipe, model, x)
    with Pipe(model, chunks=2) as pipe:  # no balance: one stage per run of layers on one device
        assert pipe.balance == [7] and pipe.stages[0].device == GPU
        check_transparent(pipe, model, x)
    assert all(p.device == torch.device(GPU) for p in model.parameters())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])


def training_with_distributed_optimizer() -> None:
    """30 SGD-with-momentum steps: the same losses and final weights as plain training on the GPU."""
    model = mlp([10, 32, 32, 4], seed=7)
    reference = copy.deepcopy(model).to(GPU)
    with Pipe(model, chunks=4, balance=[2, 3], devices=[GPU, GPU]) as pipe:
        pipe_losses, plain_losses = train_side_by_side(pipe, reference, blobs(30, 32), device=GPU)
        trained = pipe.state_dict()
    assert pipe_losses[-1] < 0.5 * pipe_losses[0], pipe_losses  # it learned
    torch.testing.assert_close(torch.tensor(pipe_losses), torch.tensor(plain_losses), rtol=1e-3, atol=1e-4)
    for key, value in reference.state_dict().items():
        assert trained[key].device.type == "cpu"
        torch.testing.assert_close(trained[key], value.cpu(), rtol=1e-3, atol=1e-4)


def optimizer_state_and_schedule() -> None:
    """Adam with StepLR on GPU stages: saved after 2 steps (tensors on the CPU), loaded into a new pipe,
    2 more steps equal 4 plain ones on the GPU."""
    model = mlp([10, 16, 4], seed=4)
    batches = list(blobs(4, 12, seed=8))
    reference = copy.deepcopy(model).to(GPU)
    plain_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    plain_steps(reference, plain_opt, torch.optim.lr_scheduler.StepLR(plain_opt, step_size=2, gamma=0.5), batches,
                device=GPU)

    def build(pipe: Pipe) -> tuple[object, RemoteLRScheduler]:
        opt = DistributedOptimizer(rrefpipe.optim.Adam, pipe.parameter_rrefs(), lr=0.01)
        return opt, RemoteLRScheduler(opt, torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5)

    with Pipe(copy.deepcopy(model), chunks=3, balance=[1, 2], devices=[GPU, GPU]) as pipe:
        opt, sched = build(pipe)
        pipe_steps(pipe, opt, sched, batches[:2])
        saved = pipe.state_dict(), optimizer_state_dict(opt), sched.state_dict()
    moments = [t for saved_state in saved[1] for per_param in saved_state["state_dict"]["state"].values()
               for t in per_param.values()]
    assert moments and all(t.device.type == "cpu" for t in moments)
    with Pipe(copy.deepcopy(model), chunks=3, balance=[1, 2], devices=[GPU, GPU]) as pipe:
        pipe.load_state_dict(saved[0])
        opt, sched = build(pipe)
        load_optimizer_state_dict(opt, saved[1])
        sched.load_state_dict(saved[2])
        pipe_steps(pipe, opt, sched, batches[2:])
        resumed = pipe.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(resumed[key], value.cpu(), **TOLERANCE)


def autocast_and_clipping() -> None:
    """bfloat16 autocast around the forward on GPU stages, and gradients clipped across the stages
    before the optimizer's step: the same weights as plain training on the GPU, to bfloat16's rounding."""

    kind = torch.device(GPU).type
    model = mlp([10, 32, 32, 4], seed=7)
    reference = copy.deepcopy(model).to(GPU)
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    with Pipe(model, chunks=2, balance=[3, 2], devices=[GPU, GPU]) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.5)
        for x, y in blobs(3, 8):
            with dist_autograd.context() as ctx:
                with torch.autocast(kind, dtype=torch.bfloat16):
                    out = pipe(x).local_value()
                assert out.dtype == torch.bfloat16
                pipe.backward(ctx, nn.functional.cross_entropy(out.float(), y))
                total = pipe.clip_grad_norm_(ctx, 0.01)
                grads = probes.stage_gradients(pipe, ctx)
                opt.step(ctx)
            plain_opt.zero_grad()
            outs = []
            for part in x.to(GPU).chunk(2):  # a region per micro-batch, as on the stages
                with torch.autocast(kind, dtype=torch.bfloat16):
                    outs.append(reference(part))
            nn.functional.cross_entropy(torch.cat(outs).float(), y.to(GPU)).backward()
            torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01).cpu(),
                                       rtol=1e-2, atol=1e-3)
            for name, p in reference.named_parameters():  # clipped by the total norm (to 0.01 together)
                torch.testing.assert_close(grads[name], p.grad.cpu(), rtol=1e-2, atol=1e-5)
            plain_opt.step()
        trained = pipe.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value.cpu(), rtol=1e-2, atol=1e-3)


def float16_loss_scaling() -> None:
    """float16 autocast on GPU stages with rrefpipe.GradScaler: the scale of torch.amp.GradScaler on
    the plain model on the GPU after every step, and its weights, over steps where the last stage's
    gradients overflow (skipped on every stage)."""
    kind = torch.device(GPU).type
    model = model_that_overflows(stage=1)
    reference = copy.deepcopy(model).to(GPU)
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    plain_scaler = torch.amp.GradScaler(kind, init_scale=2.0**10, growth_interval=2)
    with Pipe(model, chunks=2, balance=[1, 5], devices=[GPU, GPU]) as pipe:
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.05)
        scaler = GradScaler(pipe, init_scale=2.0**10, growth_interval=2)
        for x, y in batches_with_overflows(8, bad=[2, 5]):
            with dist_autograd.context() as ctx:
                with torch.autocast(kind, dtype=torch.float16):
                    out = pipe(x).local_value()
                assert out.dtype == torch.float16
                pipe.backward(ctx, scaler.scale(nn.functional.cross_entropy(out.float(), y)))
                scaler.step(opt, ctx)
            scaler.update()
            plain_opt.zero_grad()
            outs = []
            for part in x.to(GPU).chunk(2):  # a region per micro-batch, as on the stages
                with torch.autocast(kind, dtype=torch.float16):
                    outs.append(reference(part))
            plain_scaler.scale(nn.functional.cross_entropy(torch.cat(outs).float(), y.to(GPU))).backward()
            plain_scaler.step(plain_opt)
            plain_scaler.update()
            assert scaler.get_scale() == plain_scaler.get_scale(), (scaler.get_scale(), plain_scaler.get_scale())
        assert scaler.get_scale() == 2.0**11  # two backoffs and three growths: the overflows happened
        trained = pipe.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value.cpu(), rtol=1e-2, atol=1e-3)


GPU_SLEEP = 200_000_000  # cycles of torch.cuda._sleep: about 0.1 s of an H100


def _sleep_on_the_gpu() -> None:
    """Queue about 0.1 s of GPU time on the current stream (nothing on the CPU dry run)."""
    if GPU.startswith("cuda"):
        torch.cuda._sleep(GPU_SLEEP)


class _LateGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        _sleep_on_the_gpu()
        return grad.clone()


class LateGradient(nn.Module):
    """The identity, whose backward queues GPU sleep first: the gradients of the layers before it are
    written late, long after the host has moved on."""

    def forward(self, x: Tensor) -> Tensor:
        return _LateGradient.apply(x)


class SlowSGD(torch.optim.SGD):
    """Runs on a stage worker (``DistributedOptimizer`` builds it there): SGD whose update is queued
    behind GPU sleep, so that whatever reads the weights unordered after the step reads them stale."""

    def step(self, closure=None):  # type: ignore[override]
        _sleep_on_the_gpu()
        return super().step(closure)


def optimizer_steps_are_ordered() -> None:
    """The step of ``DistributedOptimizer`` runs in an RPC body of its own on each worker. It must use
    the gradients backward left (written late here), and the stage must read the weights it wrote
    (written late here too) in the next forward and in ``state_dict``."""

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(10, 32), LateGradient(), nn.ReLU(), nn.Linear(32, 32), LateGradient(),
                          nn.ReLU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model).to(GPU)
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with Pipe(model, chunks=2, balance=[3, 4], devices=[GPU, GPU]) as pipe:
        opt = DistributedOptimizer(SlowSGD, pipe.parameter_rrefs(), lr=0.1)
        for step, (x, y) in enumerate(blobs(4, 16)):
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [nn.functional.cross_entropy(pipe(x).local_value(), y)])
                opt.step(ctx)
            plain_opt.zero_grad()
            nn.functional.cross_entropy(reference(x.to(GPU)), y.to(GPU)).backward()
            plain_opt.step()
            if step % 2 == 0:  # the next forward right after the step, then the state dict
                with torch.no_grad():
                    torch.testing.assert_close(pipe(x).local_value(), reference(x.to(GPU)).cpu(), **TOLERANCE)
            trained = pipe.state_dict()  # on odd steps right after the step
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(trained[key], value.cpu(), **TOLERANCE)


def automatic_balance() -> None:
    """balance='time' | 'size' profile on the GPU (CUDA events, memory_allocated) and still give a
    pipe equal to the plain model."""
    from rrefpipe.balance import balance_by_size, balance_by_time

    widths = [16, 256, 256, 16, 16, 16, 4]  # two heavy layers first
    model = mlp(widths)
    x = torch.randn(16, 16, requires_grad=True)
    on_gpu = copy.deepcopy(model).to(GPU)
    for balance in (balance_by_time(2, on_gpu, x[:4].to(GPU), timeout=0.3),
                    balance_by_size(2, on_gpu, x.to(GPU), chunks=4)):
        assert sum(balance) == len(model) and min(balance) >= 1, balance
    for mode in ("time", "size"):
        with Pipe(model, chunks=4, balance=mode, sample=x.detach(), devices=[GPU, GPU]) as pipe:
            assert sum(pipe.balance) == len(model) and min(pipe.balance) >= 1, pipe.balance
            check_transparent(pipe, model, x)


def world_size_one() -> None:
    """PyTorch 1.8 style: ``init_rpc`` with one process, modules on the GPU, plain ``backward``."""
    from workers import free_port

    rpc.init_rpc("solo", rank=0, world_size=1,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}"))
    try:
        model = mlp([5, 8, 8, 6, 3]).to(GPU)
        reference = copy.deepcopy(model)
        pipe = Pipe(model, chunks=4, balance=[3, 4], checkpoint="always")
        assert [s.device for s in pipe.stages] == [GPU, GPU]
        x = torch.randn(8, 5, device=GPU)
        out = pipe(x).local_value()
        assert out.device == torch.device(GPU)
        out.sum().backward()
        torch.testing.assert_close(out, reference(x), **TOLERANCE)
        reference(x).sum().backward()
        for p, q in zip(pipe.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOLERANCE)
    finally:
        rpc.shutdown()


def deferred_batch_norm() -> None:
    """Running statistics on a GPU stage equal those of plain BatchNorm over the whole batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Tanh(),
                          nn.Flatten())
    plain = copy.deepcopy(model).to(GPU)
    with Pipe(model, chunks=4, deferred_batch_norm=True, balance=[3, 3], devices=[GPU, GPU]) as pipe:
        for step in range(3):
            x = torch.randn(8, 3, 8, 8) * (1 + step)
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [pipe(x).local_value().sum()])
            plain(x.to(GPU))
        state = pipe.state_dict()
        pipe.eval()
        plain.eval()
        x = torch.randn(4, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), plain(x.to(GPU)).cpu(), **TOLERANCE)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value.cpu(), **TOLERANCE, msg=lambda m: f"{key}: {m}")


def remote_output_and_state_round_trip() -> None:
    """The output kept on the last GPU worker comes back with ``to_here()``; a state dict loaded into
    the GPU stages gives the loaded model's outputs."""
    model = mlp([5, 8, 8, 6, 3])
    other = mlp([5, 8, 8, 6, 3], seed=1)
    x = torch.randn(8, 5)
    with Pipe(model, chunks=4, balance=[3, 4], devices=[GPU, GPU], remote_output=True) as pipe:
        with torch.no_grad():
            out = pipe(x).to_here()
            torch.testing.assert_close(out, model(x), **TOLERANCE)
            pipe.load_state_dict(other.state_dict())
            torch.testing.assert_close(pipe(x).to_here(), other(x), **TOLERANCE)


def unreached_parameters() -> None:
    """Parameters the loss does not reach get no gradient on GPU stages either: a GPU last stage's copy
    of its output to the host passes "no gradient" back as such, not as zeros."""
    x, y = torch.randn(12, 10), torch.randint(0, 4, (12,))

    def loss_of(out: Tensor | tuple[Tensor, ...]) -> Tensor:
        first = out[0] if isinstance(out, tuple) else out
        return nn.functional.cross_entropy(first, y.to(first.device))

    for case in UNREACHED_CASES:
        model, balance = partly_unreached(case)
        with Pipe(model, chunks=3, balance=balance, devices=[GPU, GPU]) as pipe:
            probes.check_transparent(pipe, model, x, device=GPU, loss_of=loss_of, **TOLERANCE)


def gpu_input_is_refused() -> None:
    if GPU == "cpu":
        return  # a dry run has no CUDA input to refuse
    with Pipe(mlp([5, 8, 3]), chunks=2, balance=[1, 2], devices=[GPU, GPU]) as pipe:
        try:
            pipe(torch.randn(4, 5, device=GPU))
        except ValueError as exc:
            assert "pass CPU tensors" in str(exc), exc
        else:
            raise AssertionError("a CUDA input was accepted")
        with torch.no_grad():  # and the pipe still works
            torch.testing.assert_close(pipe(torch.ones(4, 5)).local_value(), pipe(torch.ones(4, 5)).local_value())


def missing_device_map() -> None:
    """GPU stages on workers given no device maps (as in an RPC group built without them): the first
    hop fails at once with a StageError naming the receiving worker and TensorPipe's cause."""
    from rrefpipe import StageError
    from workers import LocalWorkers

    with LocalWorkers(2, threads=1) as local:
        with Pipe(mlp([5, 8, 8, 6, 3]), chunks=2, balance=[3, 4], devices=[GPU, GPU], workers=local.names) as pipe:
            try:
                with torch.no_grad():
                    pipe(torch.randn(4, 5)).local_value()
            except StageError as exc:
                assert exc.worker == "worker2" and "device" in str(exc), exc
                print(f"refused: {exc}")
            else:
                assert GPU == "cpu", "a CUDA tensor went to a worker that has no device map"


def memory_on_gpu_stages() -> None:
    """'always' keeps only each stage's inputs for backward, counted on the GPU; CUDA peaks are reported."""
    model = mlp([64, 256, 256, 256, 64])
    x = torch.randn(32, 64)
    kept = {}
    for checkpoint in ("never", "always"):
        with Pipe(model, chunks=4, checkpoint=checkpoint, balance=[3, 4], devices=[GPU, GPU]) as pipe:
            names = [s.worker for s in pipe.stages]
            memory.track_workers(names)
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [pipe(x).local_value().sum()])
            reports = memory.worker_reports(names)
            if GPU.startswith("cuda"):
                assert all(r.cuda_allocated and r.cuda_allocated > 0 for r in reports), reports
            kept[checkpoint] = [r.saved_peak for r in reports]
    # 'always': stage 0 keeps its input (32 x 64 floats), stage 1 its input (32 x 256)
    assert kept["always"] == [32 * 64 * 4, 32 * 256 * 4], kept
    assert all(a < n for a, n in zip(kept["always"], kept["never"])), kept


def host_copies_do_not_wait_for_the_gpu() -> None:
    """``rrefpipe.stage_side.transfer``: copies between the GPU and pinned host memory are queued, not waited for
    (each call returns while the GPU still sleeps in a kernel queued before it) and carry gradients both
    ways; a stage's stream runs after the arrivals of another stream."""
    from rrefpipe.stage_side.transfer import StageStream, to_device, to_host

    device = torch.device(GPU)
    if device.type == "cpu":  # dry run: nothing to copy, nothing to order
        host, wait = to_host(torch.ones(3))
        wait()
        assert StageStream(device).stream is None and torch.equal(to_device(host, device), torch.ones(3))
        return
    stream = torch.cuda.current_stream(device)
    x = torch.randn(256, 64, device=device, requires_grad=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the copy
    host, wait = to_host(x)
    assert not stream.query(), "to_host waited for the GPU"
    wait()
    assert host.device.type == "cpu" and host.is_pinned()
    torch.testing.assert_close(host, x.detach().cpu())
    host.sum().backward()  # the gradient (expanded: overlapping strides) goes back to the GPU the same way
    torch.testing.assert_close(x.grad, torch.ones_like(x))

    y = torch.randn(256, 64, requires_grad=True)
    torch.cuda._sleep(200_000_000)
    on_gpu = to_device(y, device)
    assert not stream.query(), "to_device waited for the GPU"
    (on_gpu * 3).sum().backward()
    torch.testing.assert_close(on_gpu.detach().cpu(), y.detach())
    torch.testing.assert_close(y.grad, torch.full_like(y, 3.0))

    stage = StageStream(device)
    arrived = torch.cuda.Stream(device)  # where a body's arrivals become ready
    t = torch.zeros(1 << 16, device=device)
    with torch.cuda.stream(arrived):
        torch.cuda._sleep(200_000_000)
        t.fill_(1.0)  # "arrives" once the sleep is over
        stage.arrived()
    with stage.running():
        total = t.sum().item()
    assert total == t.numel(), total

    unordered = torch.cuda.Stream(device)  # the same read without the wait sees the zeros: the check can fail
    t.zero_()
    with torch.cuda.stream(arrived):
        torch.cuda._sleep(200_000_000)
        t.fill_(1.0)
    with torch.cuda.stream(unordered):
        early = t.sum().item()
    torch.cuda.synchronize(device)
    assert early == 0, early


def cuda_allocated() -> int:
    """Runs on a stage worker: bytes its tensors hold on the GPU (cuBLAS workspaces included)."""
    return torch.cuda.memory_allocated() if GPU.startswith("cuda") else 0


def stage_memory_is_steady() -> None:
    """A stage computes on one CUDA stream: its GPU memory stops growing after the first steps. On the
    streams of TensorPipe's pool it grew by a cuBLAS workspace for every new stream (2 GiB a worker)."""

    model = mlp([64, 256, 256, 256, 64])
    x = torch.randn(64, 64)
    with Pipe(model, chunks=4, checkpoint="except_last", balance=[3, 4], devices=[GPU, GPU]) as pipe:
        names = [s.worker for s in pipe.stages]
        opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.01, momentum=0.9)
        held = {}
        for step in range(1, 41):
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [pipe(x).local_value().square().mean()])
                opt.step(ctx)
            if step in (3, 40):
                held[step] = [rpc.rpc_sync(n, cuda_allocated) for n in names]
    assert all(late <= early + (1 << 20) for early, late in zip(held[3], held[40])), held


def torchrun_job() -> None:
    """Every rank of ``torchrun --nproc-per-node 4`` runs this: rank 0 drives three GPU stage workers
    whose device maps come from ``torchrun_group(devices=...)``, with a skip from the first stage to
    the last (a map that skips a worker)."""
    import workers

    devices = [GPU] * 3
    with workers.torchrun_group(devices=devices, threads=1, rpc_timeout=60) as stage_workers:
        model = skip_model(width=6)
        x = torch.randn(9, 6, requires_grad=True)
        with Pipe(model, chunks=3, balance=[1, 5, 1], workers=stage_workers, devices=devices) as pipe:
            assert [s.device for s in pipe.stages] == devices
            check_transparent(pipe, model, x)
        print("driver ok", flush=True)


if __name__ == "__main__":  # under torchrun: import by name, so pickled functions resolve on every rank
    from tests.gpu.scenarios import torchrun_job as job

    job()
