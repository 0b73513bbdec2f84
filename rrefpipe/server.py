"""The stage side of the RPC protocol: a registry of stages on this worker and their RPC entry points.

Micro-batch ``i`` of a step reaches stage ``j`` in one message (``receive``). Its RPC body never waits
on another worker: it buffers the job and, if no other body is already running this stage, *drains*
the buffer strictly in micro-batch order, pushing each output to the next stage from the body. The
dist-autograd context is current only inside an RPC body, so pushing from the body is what makes
every hop part of the backward graph (see RPC_FACTS in the project notes). Failures travel back as
values (:class:`~rrefpipe.errors.Failure`) through the chain of futures, never as raised exceptions.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor, nn
from torch.futures import Future

from . import microbatch
from .errors import Failure
from .microbatch import TensorOrTensors
from .stage import Stage, StageInfo, StepMeta
from .trace import Event

__all__: list[str] = []

Status = Failure | None  # what a receive future resolves to: None when the micro-batch made it through


@dataclass
class StageSpec:
    """How to build a stage on its worker: a module, or a factory that builds it there."""

    index: int
    num_stages: int
    module: nn.Sequential | None
    factory: Any
    device: str
    next_worker: str | None  # None for the last stage
    send_device: str | None = None  # move outputs here before sending (no TensorPipe device map)
    layer_offset: int = 0  # index of this stage's first layer in the whole model (renumbers factory layers)


def _built(spec: StageSpec) -> nn.Sequential:
    """Call the stage's factory; number its layers as in the model that concatenates all stages."""
    module = spec.factory()
    if not isinstance(module, nn.Module):
        raise TypeError(f"the factory of stage {spec.index} returned {type(module).__name__}, not an nn.Module")
    layers = list(module.children()) if isinstance(module, nn.Sequential) else [module]
    return nn.Sequential(OrderedDict((str(spec.layer_offset + k), layer) for k, layer in enumerate(layers)))


@dataclass
class _Job:
    meta: StepMeta
    i: int
    value: TensorOrTensors
    phony: Tensor | None
    future: Future[Status] = field(default_factory=Future)


class StageServer:
    """Runs one stage's micro-batches in order and forwards each output to where it goes next."""

    def __init__(self, pipe_id: str, spec: StageSpec) -> None:
        module = spec.module if spec.module is not None else _built(spec)
        self.pipe_id = pipe_id
        self.spec = spec
        self.stage = Stage(spec.index, module, torch.device(spec.device), rpc.get_worker_info().name)
        self.is_last = spec.index == spec.num_stages - 1
        self._lock = threading.Lock()
        self._step = -1
        self._next_i = 0
        self._pending: dict[int, _Job] = {}
        self._draining = False
        self._failure: Failure | None = None
        self._kept: dict[int, dict[int, TensorOrTensors]] = {}

    # -- forward -----------------------------------------------------------------------------------
    def receive(self, meta: StepMeta, i: int, value: TensorOrTensors, phony: Tensor | None) -> Future[Status]:
        job = _Job(meta, i, value, phony)
        with self._lock:
            if meta.step < self._step:
                job.future.set_result(self._cancelled(i, "it belongs to an earlier step"))
                return job.future
            if meta.step > self._step:  # a new step: whatever is left of older ones is abandoned
                self._step, self._next_i, self._failure = meta.step, 0, None
                self._pending.clear()
                self._kept = {}
            self._pending[i] = job
            if self._draining:
                return job.future
            self._draining = True
        self._drain()
        return job.future

    def _drain(self) -> None:
        while True:
            with self._lock:
                job = self._pending.pop(self._next_i, None)
                if job is None:
                    self._draining = False
                    return
                self._next_i += 1
                failure = self._failure
            if failure is not None:
                job.future.set_result(self._cancelled(job.i, f"micro-batch {failure.microbatch} failed"))
            else:
                self._process(job)

    def _process(self, job: _Job) -> None:
        try:
            out, phony = self.stage.run(job.meta, job.i, job.value, job.phony)
        except Exception as exc:
            failure = Failure.capture(exc, stage=self.spec.index, worker=self.stage.worker, microbatch=job.i,
                                      phase="forward")
            with self._lock:
                self._failure = failure
            job.future.set_result(failure)
            return
        if self.is_last and job.meta.deliver_to is None:
            self._kept.setdefault(job.meta.step, {})[job.i] = out
            job.future.set_result(None)
            return
        self._push(job, out, phony)

    def _push(self, job: _Job, out: TensorOrTensors, phony: Tensor | None) -> None:
        if self.spec.send_device is not None:
            out = microbatch.apply(lambda t: t.to(self.spec.send_device), out)
        if self.is_last:
            target, stage = job.meta.deliver_to, None
            fn: Any = _driver_deliver
            args: tuple[Any, ...] = (self.pipe_id, job.meta.step, job.i, out, phony)
        else:
            target, stage = self.spec.next_worker, self.spec.index + 1
            fn = receive
            args = (self.pipe_id, stage, job.meta, job.i, out, phony)
        assert target is not None
        # A failed send names the receiving worker: it is the one that died, hung or could not unpickle.
        def blame(exc: BaseException) -> Failure:
            return Failure.capture(exc, stage=self.spec.index if stage is None else stage, worker=target,
                                   microbatch=job.i, transport=True,
                                   phase=f"forward (receiving from stage {self.spec.index} on worker {self.stage.worker!r})")

        try:
            sent = rpc.rpc_async(target, fn, args=args, timeout=job.meta.timeout)
        except Exception as exc:
            job.future.set_result(blame(exc))
            return

        def relay(done: Future[Any]) -> None:
            try:
                status = done.value()
            except Exception as exc:
                status = blame(exc)
            job.future.set_result(status)

        sent.add_done_callback(relay)

    def _cancelled(self, i: int, why: str) -> Failure:
        return Failure(self.spec.index, self.stage.worker, i, "forward", "Cancelled",
                       f"micro-batch {i} was not run because {why}", "", cancelled=True)

    def take_output(self, step: int) -> TensorOrTensors:
        kept = self._kept.pop(step)
        return microbatch.gather([kept[i] for i in sorted(kept)])


# -- registry and RPC entry points (run on the stage's worker) ---------------------------------------
_servers: dict[tuple[str, int], StageServer] = {}
_registry_lock = threading.Lock()


def _server(pipe_id: str, index: int) -> StageServer:
    try:
        return _servers[(pipe_id, index)]
    except KeyError:
        raise LookupError(f"stage {index} of pipe {pipe_id!r} is not on worker {rpc.get_worker_info().name!r} "
                          "(closed, or never created)") from None


def create_stage(pipe_id: str, spec: StageSpec) -> StageInfo:
    server = StageServer(pipe_id, spec)
    if spec.next_worker is not None:
        # Open the connection to the next stage now: the first message between two TensorPipe peers
        # pays the connection set-up, which would otherwise land on the first micro-batch.
        rpc.rpc_sync(spec.next_worker, _noop, timeout=30)
    with _registry_lock:
        _servers[(pipe_id, spec.index)] = server
    return server.stage.info()


def _noop() -> None:
    return None


def destroy_stage(pipe_id: str, index: int) -> None:
    with _registry_lock:
        _servers.pop((pipe_id, index), None)


@rpc.functions.async_execution
def receive(pipe_id: str, index: int, meta: StepMeta, i: int, value: TensorOrTensors,
            phony: Tensor | None) -> Future[Status]:
    try:
        server = _server(pipe_id, index)
    except LookupError as exc:
        future: Future[Status] = Future()
        future.set_result(Failure.capture(exc, stage=index, worker=rpc.get_worker_info().name, microbatch=i,
                                          phase="forward"))
        return future
    return server.receive(meta, i, value, phony)


def take_output(pipe_id: str, index: int, step: int) -> TensorOrTensors:
    return _server(pipe_id, index).take_output(step)


def parameter_rrefs(pipe_id: str, index: int) -> list[rpc.RRef]:
    return [rpc.RRef(p) for p in _server(pipe_id, index).stage.module.parameters()]


def set_training(pipe_id: str, index: int, mode: bool) -> None:
    _server(pipe_id, index).stage.module.train(mode)


def state_dict(pipe_id: str, index: int) -> dict[str, Tensor]:
    return {k: v.detach().cpu() for k, v in _server(pipe_id, index).stage.module.state_dict().items()}


def load_state_dict(pipe_id: str, index: int, state: dict[str, Tensor]) -> None:
    _server(pipe_id, index).stage.module.load_state_dict(state)


def events(pipe_id: str, index: int, clear: bool) -> list[Event]:
    return _server(pipe_id, index).stage.recorder.snapshot(clear)


def _driver_deliver(pipe_id: str, step: int, i: int, value: TensorOrTensors, phony: Tensor | None) -> None:
    from .driver import deliver  # runs on the driver; imported lazily to keep the module graph acyclic

    deliver(pipe_id, step, i, value, phony)
