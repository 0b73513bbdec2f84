"""The stage side of the RPC protocol's data path: a registry of stages on this worker and the entry points
that build them and move micro-batches, skips and outputs (the driver's calls between steps are in
:mod:`rrefpipe.stage_side.control`).

Micro-batch ``i`` of a step reaches stage ``j`` in a message (``receive``) that carries it alone or with
its neighbours (``Pipe(microbatches_per_message=)``: a stage holds outputs until a message is full or
the step's last micro-batch ran), plus one message per skip tensor that an earlier stage stashed for it
(``receive_skip``, sent straight from that stage, never held). No RPC body waits on another worker: each
buffers what it brought and, if no other body is running this stage, *drains* the buffer strictly in
micro-batch order, running every job whose inputs are complete and pushing its output (and its outgoing
skips) from the body. The dist-autograd context is current only inside an RPC body, so pushing from the
body is what keeps every hop in the backward graph. The last stage gathers every output of a step and
sends it to the driver in one message, from the body that ran the last one. Failures travel back as
values (:class:`~rrefpipe.errors.Failure`) through the chain of futures.
"""
from __future__ import annotations

import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor, nn
from torch.futures import Future

from .. import microbatch
from . import checkpoint, gradients
from ..batchnorm import defer_batch_norms
from ..dependency import arrival, hop
from ..errors import Failure
from ..microbatch import TensorOrTensors
from ..skip.layout import SkipRoutes
from ..skip.tracker import SkipKey
from .materialize import StageInit, materialize
from .stage import Stage, StageInfo, StageOutput, StepMeta
from .transfer import StageStream, to_device, to_host

__all__: list[str] = []

Status = Failure | None  # what a receive future resolves to: None when the micro-batch made it through
Arrival = tuple[int, TensorOrTensors, Tensor | None, frozenset[SkipKey]]  # (i, value, phony, skips sent as None)
# The driver's RPC targets for the last stage's outputs (``deliver`` and ``keep_phony`` of
# ``rrefpipe.driver_side.remote``), given to every stage by ``connect``: the driver sits above this module,
# which never imports it.
Deliver = Callable[[str, int, TensorOrTensors, Tensor | None, Tensor | None], None]
KeepPhony = Callable[[str, int, Tensor], None]


@dataclass
class StageSpec:
    """How to build a stage on its worker: a module, or a factory that builds it there."""

    index: int
    num_stages: int
    module: nn.Sequential | None
    factory: Any
    device: str
    next_worker: str | None  # None for the last stage
    stage_devices: list[str]  # every stage's device: what a GPU stage sends to a CPU one crosses to the CPU
    seed: int  # the worker's random seed from the stage's creation on (``rrefpipe.seeding``)
    layer_offset: int = 0  # index of this stage's first layer in the whole model (renumbers factory layers)
    deferred_chunks: int | None = None  # chunks: swap the factory's BatchNorms for DeferredBatchNorm
    init: StageInit | None = None  # a skeleton on the meta device and where its tensors come from


def _built(spec: StageSpec) -> nn.Sequential:
    """Call the stage's factory; number its layers as in the model that concatenates all stages."""
    module = spec.factory()
    if not isinstance(module, nn.Module):
        raise TypeError(f"the factory of stage {spec.index} returned {type(module).__name__}, not an nn.Module")
    layers = list(module.children()) if isinstance(module, nn.Sequential) else [module]
    built = nn.Sequential(OrderedDict((str(spec.layer_offset + k), layer) for k, layer in enumerate(layers)))
    return built if spec.deferred_chunks is None else defer_batch_norms(built, spec.deferred_chunks)


def _check_device(device: torch.device) -> None:
    """The stage's device must exist on this worker (the driver may have no GPU at all)."""
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device {device} does not exist on worker {rpc.get_worker_info().name!r} "
                         f"({torch.cuda.device_count()} CUDA devices)")


@dataclass
class _Job:
    """Everything micro-batch ``i`` needs on this stage; runnable once ``arrived`` and all skips are in."""

    i: int
    meta: StepMeta | None = None
    value: TensorOrTensors | None = None
    arrived: bool = False
    phonies: list[Tensor] = field(default_factory=list)
    sent_with: Tensor | None = None  # the phony of the previous stage's hop (``Stage.run``)
    skips: dict[SkipKey, Tensor | None] = field(default_factory=dict)
    nones: frozenset[SkipKey] = frozenset()
    refused: tuple[BaseException, str] | None = None  # an input that could not be taken in, and its phase
    future: Future[Status] = field(default_factory=Future)


@dataclass
class _Output:
    """A last-stage output on its way to the host, for the driver; readable once ``copied()`` returned."""

    value: TensorOrTensors
    phony: Tensor | None
    copied: Callable[[], None]


@dataclass
class _Held:
    """A micro-batch's output waiting for the rest of its message to the next stage."""

    job: _Job
    out: StageOutput
    nones: frozenset[SkipKey]
    skip_sends: list[Future[Status]]


def _count(value: Any) -> tuple[int, int]:
    tensors = [value] if isinstance(value, Tensor) else [t for t in value or () if isinstance(t, Tensor)]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


class StageServer:
    """Runs one stage's micro-batches in order and sends outputs and skips where they go next."""

    def __init__(self, pipe_id: str, spec: StageSpec) -> None:
        _check_device(torch.device(spec.device))
        with checkpoint.random_turns:  # another pipe's stage may be recomputing on this worker
            torch.manual_seed(spec.seed)  # before the factory: its initial weights repeat too
            if spec.init is not None:
                module = materialize(spec.init, torch.device(spec.device), f"stage {spec.index}")
            else:
                module = spec.module if spec.module is not None else _built(spec)
        self.pipe_id = pipe_id
        self.spec = spec
        self.is_last = spec.index == spec.num_stages - 1
        self.stage = Stage(spec.index, module, torch.device(spec.device), rpc.get_worker_info().name,
                           recompute_ahead=not self.is_last,  # the last stage's backward starts at once
                           last=self.is_last)
        self.stream = StageStream(self.stage.device)
        self.workers: list[str] = []
        self.deliver: Deliver | None = None  # set by ``connect``, as ``workers`` is
        self.keep_phony: KeepPhony | None = None
        self.traffic: dict[str, list[int]] = {"activation": [0, 0], "skip": [0, 0]}  # kind -> [tensors, bytes]
        self._lock = threading.Lock()
        self._step = -1
        self._next_i = 0
        self._pending: dict[int, _Job] = {}
        self._draining = False
        self._failure: Failure | None = None
        self._kept: dict[int, TensorOrTensors] = {}  # outputs that stay here (``StepMeta.keep_output``)
        self._kept_phonies: list[Tensor] = []  # of kept outputs that cannot carry a gradient, for the driver
        self._outputs: dict[int, _Output] = {}  # the last stage's outputs for the driver, until all are in
        self._held: list[_Held] = []  # outputs waiting to fill a message to the next stage

    # -- arrivals ----------------------------------------------------------------------------------
    def receive(self, meta: StepMeta, group: list[Arrival]) -> Future[Status]:
        """Consecutive micro-batches from the previous stage, ``meta.per_message`` (or fewer) per message."""
        tensors = [t for _, value, _, _ in group for t in microbatch.as_tensors(value)]
        jobs = self._arrive(meta, "activation", tensors,
                            {i: self._activation(value, phony, nones, from_stage=True)
                             for i, value, phony, nones in group})
        if len(jobs) == 1:
            return jobs[0].future
        done: Future[Status] = Future()
        _when_all([job.future for job in jobs] if jobs else [self._stale(group[0][0])], _first_failure, done)
        return done

    def receive_batch(self, meta: StepMeta, value: TensorOrTensors, phony: Tensor | None) -> Future[list[Failure]]:
        """The first stage's input for a whole step in one message: split here into micro-batches,
        saving the driver one message (and its reply, and its gradient) per micro-batch. It goes to the
        stage's device whole: one copy, not one per micro-batch."""
        with self.stream.running():
            value = microbatch.apply(lambda t: to_device(t, self.stage.device), value)
        batches = microbatch.scatter(value, meta.chunks)
        if len(batches) != meta.chunks:
            raise ValueError(f"the input split into {len(batches)} micro-batches, the driver expected {meta.chunks}")
        jobs = self._arrive(meta, "activation", value,
                            {i: self._activation(batch, phony, frozenset()) for i, batch in enumerate(batches)})
        done: Future[list[Failure]] = Future()
        _when_all([job.future for job in jobs] if jobs else [self._stale(0)], _failures, done)
        return done

    def receive_skip(self, meta: StepMeta, i: int, key: SkipKey, tensor: Tensor, phony: Tensor | None) -> None:
        def update(job: _Job) -> None:
            if phony is None:
                job.skips[key] = tensor
                return
            try:  # backward answers the phony with whether the popping layer used the tensor
                with torch.enable_grad():
                    arrived, joined = arrival(tensor, phony, None, self.stage.device)
            except Exception as exc:  # the micro-batch fails here, rather than wait for the skip for ever
                job.skips[key] = None
                job.refused = job.refused or (exc, f"forward (taking in skip {key[1]!r} ({key[0]}))")
                return
            job.skips[key] = arrived  # type: ignore[assignment]  # (one tensor in, one out)
            job.phonies.append(joined)

        self._arrive(meta, "skip", tensor, {i: update})

    def _activation(self, value: TensorOrTensors, phony: Tensor | None,
                    nones: frozenset[SkipKey], from_stage: bool = False) -> Callable[[_Job], None]:
        def update(job: _Job) -> None:
            job.value, job.arrived = value, True
            job.nones = nones
            if from_stage:  # its phony is answered in backward (``dependency.arrival``)
                job.sent_with = phony
            elif phony is not None:
                job.phonies.append(phony)
            for key in nones & self.stage.routes.incoming:
                job.skips[key] = None

        return update

    def _stale(self, i: int) -> Future[Status]:
        stale: Future[Status] = Future()
        stale.set_result(self._cancelled(i, "it belongs to an earlier step"))
        return stale

    def _arrive(self, meta: StepMeta, kind: str, payload: Any,
                updates: dict[int, Callable[[_Job], None]]) -> list[_Job]:
        """Record what arrived for micro-batches ``updates``, then drain unless a body already is.
        Returns their jobs, or nothing when the message belongs to an earlier step."""
        count, nbytes = _count(payload)
        self.stream.arrived()
        with self._lock:
            self.traffic[kind][0] += count
            self.traffic[kind][1] += nbytes
            if meta.step < self._step:
                return []
            if meta.step > self._step:  # a new step: whatever is left of older ones is abandoned
                self.stream.settle()  # after an optimizer step queued between the two on another stream
                self._step, self._next_i, self._failure = meta.step, 0, None
                self._pending.clear()
                self._kept, self._kept_phonies, self._outputs, self._held = {}, [], {}, []
            jobs = []
            for i, update in updates.items():
                job = self._pending.setdefault(i, _Job(i))
                job.meta = meta
                update(job)
                jobs.append(job)
            if self._draining:
                return jobs
            self._draining = True
        with self.stream.running():
            self._drain()
        return jobs

    # -- running -------------------------------------------------------------------------------------
    def _drain(self) -> None:
        incoming = self.stage.routes.incoming
        while True:
            with self._lock:
                job = self._pending.get(self._next_i)
                if job is None or not job.arrived or not incoming <= job.skips.keys():
                    self._draining = False
                    return
                del self._pending[self._next_i]
                self._next_i += 1
                failure = self._failure
            if failure is not None:
                job.future.set_result(self._cancelled(job.i, f"micro-batch {failure.microbatch} failed"))
                continue
            try:
                self._process(job)
            except BaseException as exc:  # past the stage's run (sending, say): fail the job, keep draining
                failure = self._fail(job, exc)
                if not job.future.done():
                    job.future.set_result(failure)

    def _fail(self, job: _Job, exc: BaseException, phase: str = "forward") -> Failure:
        """Record ``exc`` as the step's failure, at ``job``'s micro-batch: the later ones are cancelled."""
        failure = Failure.capture(exc, stage=self.spec.index, worker=self.stage.worker, microbatch=job.i,
                                  phase=phase)
        with self._lock:
            self._failure = failure
        return failure

    def _process(self, job: _Job) -> None:
        assert job.meta is not None and job.value is not None
        try:
            if job.refused is not None:
                raise job.refused[0]
            out = self.stage.run(job.meta, job.i, job.value, job.phonies, job.skips, job.sent_with)
        except BaseException as exc:  # SystemExit from a layer too: it fails the step, not the worker
            failure = self._fail(job, exc, job.refused[1] if job.refused else "forward")
            self._push()  # the micro-batches before it go on, as they would have one by one
            job.future.set_result(failure)
            return
        sends = self._send_skips(job, out)
        if not self.is_last:
            nones = job.nones | {k for k, t in out.skips.items() if t is None}
            self._held.append(_Held(job, out, nones, sends))
            if len(self._held) >= job.meta.per_message or job.i == job.meta.chunks - 1:
                self._push()
            if job.i == job.meta.chunks - 1:  # idle here until that micro-batch's gradient comes back
                self.stage.recompute_soon(job.meta.step, job.i)
            return  # the job completes when its message (and its skips) went through
        if job.meta.keep_output:
            self._kept[job.i] = out.value
            if out.phony is not None and not _carries_gradient(out.value):
                self._kept_phonies.append(out.phony)
            if job.i == job.meta.chunks - 1 and self._kept_phonies:  # (see ``_deliver``)
                phony, self._kept_phonies = torch.cat(self._kept_phonies), []
                sends.append(self._send(job, None, self.keep_phony, (self.pipe_id, job.meta.step, phony)))
        else:
            value, copied = to_host(out.value)  # the driver keeps its tensors on the CPU
            self._outputs[job.i] = _Output(value, out.phony, copied)
            if len(self._outputs) == job.meta.chunks:
                sends.append(self._deliver(job))
        _when_all(sends, _first_failure, job.future)

    def _send_skips(self, job: _Job, out: StageOutput) -> list[Future[Status]]:
        assert job.meta is not None
        sends = []
        for key, tensor in out.skips.items():
            if tensor is None:
                continue  # travels as a name on the activation message: no tensor, no RPC
            stage = self.stage.routes.outgoing[key]
            args = (self.pipe_id, stage, job.meta, job.i, key, self._outbound(tensor, stage), out.skip_phonies.get(key))
            sends.append(self._send(job, stage, receive_skip, args))
        return sends

    def _push(self) -> None:
        """Send the held outputs to the next stage in one message; each of their jobs completes once
        the message and the job's own skips went through."""
        if not self._held:
            return
        held, self._held = self._held, []
        last = held[-1].job
        assert last.meta is not None
        stage = self.spec.index + 1
        group = [(h.job.i, self._outbound(h.out.value, stage), h.out.phony, h.nones) for h in held]
        sent = self._send(last, stage, receive, (self.pipe_id, stage, last.meta, group))
        for h in held:
            _when_all(h.skip_sends + [sent], _first_failure, h.job.future)

    def _deliver(self, job: _Job) -> Future[Status]:
        """The step's output, gathered here, to the driver in one message of one tensor per output
        tensor (see ``driver_side.remote.deliver`` for why): each tensor of a message costs both sides again, and
        so does its gradient. The output reaches every micro-batch's hop node in backward through its
        first tensor that can carry a gradient (see ``dependency.hop``). Where none can (integer
        tensors only), one phony made of those micro-batches' phonies goes along: no loss reaches its
        receive node on the driver, and ``pipe.backward`` adds the phony's sum to the losses."""
        assert job.meta is not None
        outputs, self._outputs = self._outputs, {}
        ordered = [outputs[i] for i in range(job.meta.chunks)]
        for output in ordered:
            output.copied()
        values = [output.value for output in ordered]
        unreached = [output.phony for output in ordered
                     if output.phony is not None and not _carries_gradient(output.value)]
        try:
            gathered = microbatch.gather(values)
            phony = torch.cat(unreached) if unreached else None
        except Exception as exc:  # outputs that do not concatenate along dim 0
            done: Future[Status] = Future()
            done.set_result(Failure.capture(exc, stage=self.spec.index, worker=self.stage.worker, microbatch=None,
                                            phase="gather"))
            return done
        sent_with = None
        if any(t.requires_grad for t in microbatch.as_tensors(gathered)):  # the driver's backward answers
            with torch.enable_grad():  # which of these tensors the loss used (``dependency.arrival``)
                gathered, sent_with = hop(gathered, [], None, masked=True)
        return self._send(job, None, self.deliver, (self.pipe_id, job.meta.step, gathered, phony, sent_with))

    def _outbound(self, value: TensorOrTensors, stage: int | None) -> TensorOrTensors:
        """``value`` as sent to stage ``stage`` (None: the driver), ready to send. TensorPipe sends a CUDA
        tensor only over a device map, and maps join CUDA devices: what goes to a CPU stage, or to the
        driver (which keeps its tensors on the CPU and has no maps), goes as a CPU tensor."""
        receiver = "cpu" if stage is None else self.spec.stage_devices[stage]
        if receiver != "cpu" or self.stage.device.type == "cpu":
            return value
        host, copied = to_host(value)
        copied()
        return host

    def _send(self, job: _Job, stage: int | None, fn: Any, args: tuple[Any, ...]) -> Future[Status]:
        """An RPC to stage ``stage`` (None: the driver); a failed send names the receiving worker."""
        assert job.meta is not None
        target = job.meta.driver if stage is None else self.workers[stage]
        result: Future[Status] = Future()

        def blame(exc: BaseException) -> Failure:
            return Failure.capture(exc, stage=self.spec.index if stage is None else stage, worker=target,
                                   microbatch=job.i, transport=True,
                                   phase=f"forward (receiving from stage {self.spec.index} "
                                         f"on worker {self.stage.worker!r})")

        try:
            sent = rpc.rpc_async(target, fn, args=args, timeout=job.meta.timeout)
        except Exception as exc:
            result.set_result(blame(exc))
            return result

        def relay(done: Future[Any]) -> None:
            try:
                status = done.value()
            except Exception as exc:
                status = blame(exc)
            result.set_result(status)

        sent.add_done_callback(relay)
        return result

    def _cancelled(self, i: int, why: str) -> Failure:
        return Failure(self.spec.index, self.stage.worker, i, "forward", "Cancelled",
                       f"micro-batch {i} was not run because {why}", "", cancelled=True)

    def take_output(self, step: int) -> TensorOrTensors:
        if step != self._step:
            raise LookupError(f"the output of step {step} is gone (this stage is at step {self._step})")
        kept, self._kept = self._kept, {}
        try:
            with self.stream.running():
                gathered = microbatch.gather([kept[i] for i in sorted(kept)])
                return self._outbound(gathered, None)
        except Exception as exc:  # to_here() rebuilds the error from type and text: a plain type, naming the stage
            failure = Failure.capture(exc, stage=self.spec.index, worker=self.stage.worker, microbatch=None,
                                      phase="gather")
            raise RuntimeError(str(failure.to_exception())) from exc


def _when_all(futures: list[Future[Status]], combine: Callable[[list[Status]], Any], target: Future[Any]) -> None:
    """Once every future is done, complete ``target`` with ``combine`` of their results; if one of them
    raised (a raw RPC future), ``target`` raises too."""
    if not futures:
        target.set_result(combine([]))
        return
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[Status]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            target.set_result(combine([f.value() for f in futures]))
        except Exception as exc:
            target.set_exception(exc)

    for future in futures:
        future.add_done_callback(one_done)


def _first_failure(statuses: list[Status]) -> Status:
    return next((s for s in statuses if s is not None), None)


def _failures(statuses: list[Status]) -> list[Failure]:
    return [s for s in statuses if s is not None]


# -- registry and RPC entry points (run on the stage's worker) ---------------------------------------
_servers: dict[tuple[str, int], StageServer] = {}
_registry_lock = threading.Lock()
_destroyed_unbuilt: OrderedDict[tuple[str, int], None] = OrderedDict()  # the latest (a build may have failed)


def _server(pipe_id: str, index: int) -> StageServer:
    try:
        return _servers[(pipe_id, index)]
    except KeyError:
        raise LookupError(f"stage {index} of pipe {pipe_id!r} is not on worker {rpc.get_worker_info().name!r} "
                          "(closed, or never created)") from None


def has_stages(pipe_id: str) -> bool:
    """Whether a stage of the pipe is on this worker (closed pipes' leftovers can go)."""
    with _registry_lock:
        return any(key[0] == pipe_id for key in _servers)


def create_stage(pipe_id: str, payload: bytes) -> StageInfo:
    """Build a stage from its pickled :class:`StageSpec` (cloudpickle, see the driver). This process is
    a stage worker from now on: its optimizers drop their gradients after each step."""
    return build_stage(pipe_id, pickle.loads(payload))


def build_stage(pipe_id: str, spec: StageSpec) -> StageInfo:
    """Build a stage from its :class:`StageSpec` (:func:`create_stage`; a rebuild from a snapshot)."""
    gradients.drop_after_optimizer_steps()
    server = StageServer(pipe_id, spec)
    with _registry_lock:
        given_up = (pipe_id, spec.index) in _destroyed_unbuilt  # by its driver, while this was being built
        _destroyed_unbuilt.pop((pipe_id, spec.index), None)
        if not given_up:
            _servers[(pipe_id, spec.index)] = server
    return server.stage.info()


@rpc.functions.async_execution
def connect(pipe_id: str, index: int, workers: list[str], routes: SkipRoutes, deliver: Deliver,
            keep_phony: KeepPhony) -> Future[None]:
    """Tell a stage where every stage lives, where its skips go and which functions of the driver take
    the outputs; open those connections now (the first message between two TensorPipe peers pays the
    connection set-up). Never blocks an RPC thread."""
    server = _server(pipe_id, index)
    server.workers = list(workers)
    server.deliver, server.keep_phony = deliver, keep_phony
    server.stage.routes = routes
    peers = {workers[index + 1]} if index + 1 < len(workers) else set()
    peers |= {workers[k] for k in routes.outgoing.values()}
    pings = [rpc.rpc_async(peer, _noop, timeout=30) for peer in peers]
    done: Future[None] = Future()
    _when_all(pings, _first_failure, done)
    return done


def _noop() -> None:
    return None


def discard_stage(pipe_id: str, index: int) -> None:
    """Drop the stage if this worker has it (a rebuild replaces it: nothing is waiting to be built)."""
    with _registry_lock:
        _servers.pop((pipe_id, index), None)


def destroy_stage(pipe_id: str, index: int) -> None:
    """Drop the stage; one not built yet (its driver was interrupted while a worker with several RPC
    threads builds it) is dropped once built."""
    with _registry_lock:
        if _servers.pop((pipe_id, index), None) is None:
            _destroyed_unbuilt[(pipe_id, index)] = None
            while len(_destroyed_unbuilt) > 64:
                _destroyed_unbuilt.popitem(last=False)


@rpc.functions.async_execution
def receive(pipe_id: str, index: int, meta: StepMeta, group: list[Arrival]) -> Future[Status]:
    try:
        server = _server(pipe_id, index)
    except LookupError as exc:
        future: Future[Status] = Future()
        future.set_result(Failure.capture(exc, stage=index, worker=rpc.get_worker_info().name,
                                          microbatch=group[0][0], phase="forward"))
        return future
    return server.receive(meta, group)


@rpc.functions.async_execution
def receive_batch(pipe_id: str, index: int, meta: StepMeta, value: TensorOrTensors,
                  phony: Tensor | None) -> Future[list[Failure]]:
    """The driver's one message per step to the first stage; resolves to the micro-batches' failures."""
    future: Future[list[Failure]] = Future()
    try:
        return _server(pipe_id, index).receive_batch(meta, value, phony)
    except Exception as exc:
        future.set_result([Failure.capture(exc, stage=index, worker=rpc.get_worker_info().name, microbatch=None,
                                           phase="forward")])
        return future


def receive_skip(pipe_id: str, index: int, meta: StepMeta, i: int, key: SkipKey, tensor: Tensor,
                 phony: Tensor | None) -> Status:
    """A skip tensor straight from the stage that stashed it; the job runs when all its inputs are in."""
    try:
        _server(pipe_id, index).receive_skip(meta, i, key, tensor, phony)
    except LookupError as exc:
        return Failure.capture(exc, stage=index, worker=rpc.get_worker_info().name, microbatch=i, phase="forward")
    return None


def take_output(pipe_id: str, index: int, step: int) -> TensorOrTensors:
    return _server(pipe_id, index).take_output(step)


def _carries_gradient(value: TensorOrTensors) -> bool:
    return any(t.requires_grad for t in microbatch.as_tensors(value))
