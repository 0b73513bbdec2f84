"""The driver side of the RPC protocol: feeds a mini-batch to stage 0 and collects the outputs.

Per forward pass the driver sends one message, the whole mini-batch, to the first stage, which splits it;
activations then flow worker to worker (see :mod:`rrefpipe.stage_side.server`). The last stage pushes all outputs
back here in one message (``deliver``), or keeps them when the pipe's output should stay on the last worker.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import cloudpickle
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

from .. import _rpc, autocast, microbatch, replicas
from ..stage_side import control, server
from . import contexts, diagnosis
from ..dependency import arrival, new_phony
from ..errors import Failure, StageError, WorkerError, is_transport_error, timed_out, warn_user
from ..microbatch import TensorOrTensors
from .output import PipeRRef, RemotePipeRRef
from ..loss import mean_loss, split_target
from ..schedule import check_schedule, checkpoint_stop
from ..stage_side.scheduled import StepPlan
from ..stage_side.server import StageSpec
from ..skip.layout import route
from ..skip.skippable import verify_stage_skips
from ..stage_side.stage import StageInfo, StepMeta
from ..trace import Event
from . import replica_recovery
from .training import run as training_run

__all__: list[str] = []


class _Collector:
    """The output of one forward pass, filled in by ``deliver`` on an RPC thread; ``done`` is set when it
    is in (or, from the driver, when the first stage reports the step finished or failed)."""

    def __init__(self) -> None:
        self.output: TensorOrTensors | None = None
        self.phony: Tensor | None = None  # came with an output that cannot carry a gradient
        self.done = threading.Event()


_collectors: dict[tuple[str, int], _Collector] = {}
_pipe_ids = itertools.count()
_with_tied: weakref.WeakValueDictionary[str, RemoteDriver] = weakref.WeakValueDictionary()  # by pipe id


def deliver(pipe_id: str, step: int, value: TensorOrTensors, phony: Tensor | None = None,
            sent_with: Tensor | None = None) -> None:
    """Called (over RPC, by the last stage) with the step's output, its micro-batches gathered there.

    One message per step, not one per micro-batch: each delivery costs both sides a request, a reply
    and, in backward, a gradient message and its reply (4 of the last stage's 8 messages per
    micro-batch). The last stage then runs all micro-batches' backward as one autograd task, in the
    order of the nodes' sequence numbers; those are per thread, and a stage worker has one RPC thread
    (``workers.options.STAGE_RPC_THREADS``), so they follow the micro-batches and each input gradient
    still leaves as soon as it is computed. Tiny 2-stage model, m=32: 51-53 -> 31 ms per step. Gathered
    on the last stage, the message carries one tensor per output tensor instead of two per micro-batch
    (value and phony). ``sent_with``: the phony that the loss's backward answers with the output tensors
    it used (``dependency.arrival``), so that those it left out give no gradient, as in one process."""
    collector = _collector(pipe_id, step)
    if collector is not None:
        if sent_with is not None:
            with torch.enable_grad():
                value, _ = arrival(value, sent_with, None, torch.device("cpu"))
        collector.output, collector.phony = value, phony
        collector.done.set()


def keep_phony(pipe_id: str, step: int, phony: Tensor) -> None:
    """Called (over RPC, by the last stage) with the phony of a step whose output stays there
    (``remote_output``) and cannot carry a gradient (integer tensors only): no loss can use that output,
    and ``pipe.backward`` reaches the step's sends through the phony instead (see ``deliver``). It comes
    before the first stage reports the step done."""
    collector = _collector(pipe_id, step)
    if collector is not None:
        collector.phony = phony


def _collector(pipe_id: str, step: int) -> _Collector | None:
    """The collector of a step still running, or None for one the driver already gave up on (it timed
    out, say).

    A message of a step given up may come after the user left the step's dist_autograd.context():
    distributed autograd then created that context here again, to hold the message's receive node, and
    unless the last stage's own clean-up of it happens to come later, nothing releases it and it keeps
    the step's output for the life of the process (1 of 3 runs with two timed-out steps in a row). The
    user's own context holds a send node (the forward's message to the first stage), one made by the
    delivery none."""
    collector = _collectors.get((pipe_id, step))
    if collector is None:
        context_id = _rpc.current_context_id()
        if context_id is not None:
            _rpc.release_if_only_received(context_id)
    return collector


def _send_copy(t: Tensor) -> Tensor:
    # TensorPipe sends a view's whole storage (the input may be a slice of a dataset tensor).
    return t.clone() if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.nbytes else t


def _generation() -> int | None:
    """The replicas' group generation a step is planned for (None without replicas)."""
    membership = replicas.current()
    return None if membership is None else membership.generation


def _ended_contexts(by_context: dict[int, Any], current: int) -> list[int]:
    """The contexts ``by_context`` keeps something for that distributed autograd has let go of (other
    than ``current``): what the driver's per-context records drop, as contexts end without telling it."""
    return [c for c in by_context if c != current and not _rpc.context_exists(c)]


class RemoteDriver:
    """Places a pipe's stages on RPC workers and runs forward passes through them."""

    def __init__(self, specs: Sequence[StageSpec], workers: Sequence[str], *, chunks: int, checkpoint: str,
                 remote_output: bool, rpc_timeout: float, microbatches_per_message: int, schedule: str = "GPipe",
                 stages_per_worker: int = 1) -> None:
        self.pipe_id = f"{_rpc.self_name()}/{next(_pipe_ids)}"
        self.workers = list(workers)  # per stage: a worker holds several under Interleaved1F1B
        self.schedule = schedule
        self.stages_per_worker = stages_per_worker
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.remote_output = remote_output
        self.rpc_timeout = rpc_timeout
        self.microbatches_per_message = microbatches_per_message
        self.peers: Any = None  # spares with replicas: a replica_spares.PeerGuard (set by the Pipe)
        self._steps = itertools.count()
        self._lock = threading.Lock()
        self._warned_no_context = False
        self._warned_no_gradient_output = False
        self._closed = False
        self.streaming = False  # a stream (``Pipe.stream``, ``Pipe.train_stream``) owns the stages until it ends
        self.infos: list[StageInfo] = []
        self.tied: list[dict[int, str]] = []  # per tied parameter: the name of its copy on each stage holding one
        self._tied_totals: dict[int, dict[int, Tensor]] = {}  # by context: the sums last written, by tied parameter
        self._unaveraged: dict[int, int] = {}  # by context: rows of train_steps run under no_sync, not yet averaged
        self._placed = 0  # stages asked for: one interrupted (Ctrl-C) is still built on its worker
        try:
            for spec in specs:
                spec.layer_offset = sum(len(info.layers) for info in self.infos)
                self._placed = spec.index + 1
                # cloudpickle sends classes and factories defined in the user's script by value: a
                # worker cannot import the driver's __main__.
                self.infos.append(self._call(spec.index, server.create_stage, self.pipe_id, _pickled(spec, workers)))
            verify_stage_skips([(info.stashes, info.pops) for info in self.infos])  # factories: nothing checked them
            self._connect()
            if replicas.current() is not None:  # one replica of several: all must start as one model
                replicas.check_same(self._summary())
                self._call_per_worker(self.pipe_id, self.workers, control.take_first_replica_state)
        except BaseException:
            self.close()
            raise

    def reconnect(self, workers: Sequence[str], infos: Sequence[StageInfo]) -> None:
        """The stages were rebuilt (some on other workers, ``driver_side.recovery``): tell every stage where
        the others live now."""
        self.workers, self.infos = list(workers), list(infos)
        self._connect()

    def _connect(self) -> None:
        """Tell every stage where the others live, where its skips go and which driver functions take the
        outputs (``server.connect``)."""
        routes = route([(info.stashes, info.pops) for info in self.infos])
        for j, stage_routes in enumerate(routes):
            self._call(j, server.connect, self.pipe_id, j, self.workers, stage_routes, deliver, keep_phony,
                       reported=False)

    def tie(self, tied: list[dict[int, str]]) -> None:
        """Parameters several stages hold a copy of (a captured model's tied weights): their gradients are
        summed after each backward and training step (:meth:`sum_tied_gradients`)."""
        self.tied = tied
        _with_tied[self.pipe_id] = self

    def sum_tied_gradients(self, context_id: int, more_steps: bool = False) -> None:
        """Each tied parameter's gradient in the context, summed over the stages that hold a copy, given to
        every copy (as Megatron-LM does for the embedding shared with the output head), so that identical
        optimizer steps keep the copies identical. Called on the driver after the backward.

        ``more_steps``: more ``train_step`` calls may add to the context. Each copy then holds the sum
        written last plus what its own stage added since, and only those additions are summed onto it
        (summing the copies again would count the earlier sum once per copy); the sums are kept here
        (CPU copies) until the context ends. Gradients rewritten in between (clipping, unscaling) are
        not seen: clip and unscale after the context's last step."""
        for ended in _ended_contexts(self._tied_totals, context_id):
            del self._tied_totals[ended]
        previous = self._tied_totals.pop(context_id, {})
        names: dict[int, list[str]] = {}
        for tie in self.tied:
            for j, name in tie.items():
                names.setdefault(j, []).append(name)
        fetched = self._call_each(control.tied_gradients, {j: (context_id, ns) for j, ns in names.items()})
        got = {j: dict(zip(names[j], grads)) for j, grads in fetched.items()}
        totals: dict[int, dict[str, Tensor]] = {}
        written: dict[int, Tensor] = {}
        for k, tie in enumerate(self.tied):
            grads = [got[j][name] for j, name in tie.items() if got[j][name] is not None]
            if not grads:
                continue
            before = previous.get(k)  # every copy holds it (it was written to each), plus its stage's additions
            if before is None:
                total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0]
            else:
                total = before + torch.stack([g - before for g in grads]).sum(0)
            written[k] = total
            for j, name in tie.items():
                totals.setdefault(j, {})[name] = total
        self._call_each(control.set_tied_gradients,
                        {j: (context_id, list(by_name), list(by_name.values())) for j, by_name in totals.items()})
        if more_steps and written:
            self._tied_totals[context_id] = written

    def _summary(self) -> list[str]:
        """What must be the same on every replica: each stage's layers and device, and the settings."""
        return [f"stage {i.index}: layers {', '.join(i.layers)}, {i.num_parameters} parameters on {i.device}"
                for i in self.infos] + [f"chunks={self.chunks}, checkpoint={self.checkpoint!r}, schedule="
                                        f"{self.schedule!r}, stages_per_worker={self.stages_per_worker}"]

    def _call_per_worker(self, pipe_id: str, workers: Sequence[str], fn: Any, *args: Any,
                         per_worker: dict[str, tuple[Any, ...]] | None = None) -> dict[str, Any]:
        """``fn(pipe_id, [its stages], *args, *per_worker[worker])`` on each worker of a pipe (``workers``:
        per stage), all at once: a collective between replicas runs once per worker, whatever its stages;
        a failure names the worker's first stage. Returns each worker's result."""
        by_worker: dict[str, list[int]] = {}
        for j, worker in enumerate(workers):
            by_worker.setdefault(worker, []).append(j)
        sent = {}
        for worker, indices in by_worker.items():
            try:
                more = per_worker[worker] if per_worker is not None else ()
                sent[worker] = rpc.rpc_async(worker, control.reporting, args=(fn, pipe_id, indices, *args, *more),
                                             timeout=self.rpc_timeout)
            except Exception as exc:
                raise self._control_failure(indices[0], fn, exc) from exc
        results = {}
        for worker, call in sent.items():
            try:
                result = _rpc.wait(call)
            except Exception as exc:
                raise self._control_failure(by_worker[worker][0], fn, exc) from exc
            results[worker] = _raised_if_failed(by_worker[worker][0], result)
        return results

    def per_worker(self, fn: Any, *args: Any, per_worker: dict[str, tuple[Any, ...]] | None = None) -> dict[str, Any]:
        """``fn(pipe_id, [its stages], *args, ...)`` once on each of this pipe's workers (see
        :meth:`_call_per_worker`)."""
        self._check_open()
        return self._call_per_worker(self.pipe_id, self.workers, fn, *args, per_worker=per_worker)

    # -- control calls ---------------------------------------------------------------------------
    def _call(self, index: int, fn: Any, *args: Any, reported: bool = True) -> Any:
        """A synchronous control RPC to stage ``index``; failures name the stage and worker, and keep the
        type of what ``fn`` raised (``reported``; an ``async_execution`` function must be called bare)."""
        self._check_open()
        if reported:
            fn, args = control.reporting, (fn, *args)
        try:
            result = _rpc.wait(rpc.rpc_async(self.workers[index], fn, args=args, timeout=self.rpc_timeout))
        except Exception as exc:
            raise self._control_failure(index, args[0] if reported else fn, exc) from exc
        return _raised_if_failed(index, result)

    def _control_failure(self, index: int, fn: Any, exc: Exception) -> StageError:
        return Failure.capture(exc, stage=index, worker=self.workers[index], microbatch=None, phase=fn.__name__,
                               transport=is_transport_error(exc)).to_exception()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:  # its stages are gone: a state dict would come back empty, a forward fail obscurely
            raise RuntimeError("this Pipe is closed: its stages were dropped from their workers; build a new Pipe")
        if self.streaming:
            raise RuntimeError("a stream of this Pipe is running (pipe.stream or pipe.train_stream): it owns the "
                               "stages until it ends; finish or leave its loop (or call its close()) first")

    def _call_all(self, fn: Any, *args: Any) -> list[Any]:
        """``fn(pipe_id, j, *args)`` on every stage j, sent to all at once (a round trip each would add up
        per stage); a failure names the first stage, in stage order, that failed."""
        return list(self._call_each(fn, {j: args for j in range(len(self.infos))}).values())

    def _call_each(self, fn: Any, args: dict[int, tuple[Any, ...]]) -> dict[int, Any]:
        """``fn(pipe_id, j, *args[j])`` on each stage j of ``args``, sent to all at once, as ``_call_all``."""
        self._check_open()
        sent: dict[int, Future[Any] | Exception] = {}
        for j, more in args.items():
            try:
                sent[j] = rpc.rpc_async(self.workers[j], control.reporting, args=(fn, self.pipe_id, j, *more),
                                        timeout=self.rpc_timeout)
            except Exception as exc:  # refused before it left (a worker known to be gone)
                sent[j] = exc
        results = {}
        for j, call in sent.items():
            if isinstance(call, Exception):
                raise self._control_failure(j, fn, call) from call
            try:
                result = _rpc.wait(call)
            except Exception as exc:
                raise self._control_failure(j, fn, exc) from exc
            results[j] = _raised_if_failed(j, result)
        return results

    def parameter_rrefs(self) -> list[rpc.RRef]:
        rrefs = [rref for rrefs in self._call_all(control.parameter_rrefs) for rref in rrefs]
        try:
            for rref in rrefs:
                rref.owner()  # what DistributedOptimizer asks first
        except RuntimeError as exc:
            if "could not find destination id" not in str(exc):
                raise
            raise RuntimeError(
                "torch's RRef bookkeeping keeps the first RPC group this process started, and this pipe's group is "
                "larger: RRefs owned by its later workers cannot be used, so neither can DistributedOptimizer. Start "
                "the largest group first and share it (with workers.LocalWorkers(n) as w: Pipe(..., workers=w.names)), "
                "or run each pipe in its own process") from exc
        return rrefs

    def set_training(self, mode: bool) -> None:
        self._call_all(control.set_training, mode)

    def convert(self, dtype: torch.dtype | None, memory_format: torch.memory_format | None = None) -> None:
        self._call_all(control.convert, dtype, memory_format)

    def gradient_norms(self, context_id: int, norm_type: float) -> list[Tensor | None]:
        return self._call_all(control.gradient_norm, context_id, norm_type)

    def scale_gradients(self, context_id: int, factor: float) -> None:
        self._call_all(control.scale_gradients, context_id, factor)

    def unscale_gradients(self, context_id: int, inv_scale: float) -> list[bool]:
        return self._call_all(control.unscale_gradients, context_id, inv_scale)

    def state_shapes(self) -> list[dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        return self._call_all(control.state_shapes)

    def state_dict(self) -> dict[str, Tensor]:
        state: dict[str, Tensor] = {}
        for part in self._call_all(control.state_dict):
            state.update(part)
        return state

    def load_state_dict(self, parts: list[dict[str, Tensor]],
                        metadata: list[dict[str, Any]]) -> list[tuple[list[str], list[str], str]]:
        """Per stage: missing keys, unexpected keys, error text (``control.load_state_dict``)."""
        self._check_open()
        return [self._call(j, control.load_state_dict, self.pipe_id, j, part, meta)
                for j, (part, meta) in enumerate(zip(parts, metadata))]

    def traffic(self) -> list[dict[str, tuple[int, int]]]:
        return self._call_all(control.traffic)

    def events(self, clear: bool) -> list[Event]:
        return [e for part in self._call_all(control.events, clear) for e in part]

    def close(self) -> None:
        self._closed = True
        _with_tied.pop(self.pipe_id, None)
        for j, worker in enumerate(self.workers[:self._placed]):
            try:
                rpc.rpc_sync(worker, server.destroy_stage, args=(self.pipe_id, j), timeout=5)
            except Exception:
                pass  # a dead worker holds no stage any more
        self.infos, self._placed = [], 0

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, value: TensorOrTensors, *, training: bool, spread: bool = False) -> PipeRRef | RemotePipeRRef:
        self._check_open()
        batches = microbatch.scatter(value, self.chunks)
        for t in microbatch.as_tensors(value):
            if t.device.type != "cpu":
                raise ValueError(f"Pipe input is on {t.device}; stage workers receive the input from this process's "
                                 "CPU memory: pass CPU tensors (the first stage moves them to its device)")
        grad_enabled = torch.is_grad_enabled() and _rpc.current_context_id() is not None
        if torch.is_grad_enabled() and not grad_enabled and training and not self._warned_no_context:
            self._warned_no_context = True
            warn_user("Pipe forward in training mode outside dist_autograd.context(): stages run without autograd "
                      "and no gradients will reach them. To train, run forward, loss and backward in one context:\n"
                      "    with dist_autograd.context() as ctx:\n"
                      "        loss = loss_fn(pipe(x).local_value(), y)\n"
                      "        pipe.backward(ctx, loss)\n"
                      "For inference, run the forward under torch.no_grad() or after pipe.eval()")
        with self._lock:  # steps run one at a time: stages rely on it to order micro-batches
            step = next(self._steps)
            meta = StepMeta(
                step=step, chunks=len(batches),
                checkpoint_stop=checkpoint_stop(self.checkpoint, len(batches), enabled=training and grad_enabled),
                grad_enabled=grad_enabled,
                driver=_rpc.self_name(),
                keep_output=self.remote_output,
                timeout=self.rpc_timeout,
                per_message=self.microbatches_per_message,
                spread=spread,
                autocast=autocast.capture(),
            )
            collector = _Collector()
            _collectors[(self.pipe_id, step)] = collector
            try:
                self._run(meta, value, collector)
            except BaseException:
                context_id = _rpc.current_context_id()
                if grad_enabled and context_id is not None:  # its sends stay in the context
                    contexts.forward_failed(context_id, self.pipe_id)
                raise
            finally:
                del _collectors[(self.pipe_id, step)]
        context_id = _rpc.current_context_id() if grad_enabled else None
        forwards = None if context_id is None else contexts.forwards(context_id, self.pipe_id, self.workers)
        if forwards is not None:
            forwards.steps.append(step)
            forwards.rows += microbatch.as_tensors(value)[0].size(0)
        if collector.phony is not None and context_id is not None:  # an output no loss can use
            contexts.keep_unreached(context_id, collector.phony)
            self._warn_no_gradient_output()
        if self.remote_output:
            last = len(self.infos) - 1
            if forwards is not None and collector.phony is None:
                forwards.remote += 1
            return RemotePipeRRef(rpc.remote(self.workers[last], server.take_output, args=(self.pipe_id, last, step),
                                             timeout=self.rpc_timeout))
        if collector.output is None:
            raise RuntimeError(f"pipe {self.pipe_id}: the output of step {step} never arrived")
        if forwards is not None:
            nodes = [t.grad_fn for t in microbatch.as_tensors(collector.output) if t.grad_fn is not None]
            if nodes:
                forwards.outputs.append(nodes)
                _refuse_local_backward(collector.output)
        return PipeRRef(collector.output)

    def train_step(self, context_id: int, value: TensorOrTensors, target: TensorOrTensors, loss_fn: Any, *,
                   training: bool, spread: bool, loss_scale: float, average: bool = True) -> Tensor:
        """One training step under the pipe's schedule, the loss on the last stage (``Pipe.train_step``);
        the mini-batch loss, detached. ``average=False`` (``Pipe.no_sync()``): with replicas, the gradients
        stay this replica's until a step that averages in the same context takes them along with its own."""
        self._check_open()
        rows = split_target(value, target, self.chunks)  # (checks their types first)
        for t in (*microbatch.as_tensors(value), *microbatch.as_tensors(target)):
            if t.device.type != "cpu":
                raise ValueError(f"train_step got a tensor on {t.device}; stage workers receive the input and the "
                                 "target from this process's CPU memory: pass CPU tensors (the stages move them)")
        contexts.check_train_step(context_id, self.pipe_id)
        n = len(self.infos)
        try:
            check_schedule(self.schedule, n, len(rows), self.stages_per_worker)
        except ValueError as exc:
            if len(rows) == self.chunks:
                raise
            raise ValueError(f"the batch of {sum(rows)} rows splits into only {len(rows)} micro-batches (torch.chunk "
                             f"into chunks={self.chunks}), which {self.schedule} cannot run ({exc}): pass a batch "
                             f"of at least {self.chunks} rows") from None
        payload = _pickled_loss(loss_fn)
        stashed_at = {key: j for j, info in enumerate(self.infos) for key in info.stashes}
        replicated = replicas.current() is not None
        if replicated:
            self._warn_unaveraged(context_id)
        # the rows of this context's steps left unaveraged: this step averages them, or adds its own
        earlier = self._unaveraged.pop(context_id, 0)
        with self._lock:
            step = next(self._steps)
            plan = StepPlan(
                step=step, schedule=self.schedule, stages=n, stages_per_worker=self.stages_per_worker,
                chunks=len(rows), rows=rows,
                checkpoint_stop=checkpoint_stop(self.checkpoint, len(rows), enabled=training),
                workers=tuple(self.workers), skip_sources=stashed_at, driver=_rpc.self_name(),
                timeout=self.rpc_timeout, context_id=context_id, loss_scale=loss_scale, spread=spread,
                autocast=autocast.capture(), average=average, unaveraged_rows=earlier if average else 0,
                replica_generation=_generation())
            p = n // self.stages_per_worker
            try:
                losses = training_run(self.pipe_id, self.workers[:p], plan, microbatch.apply(_send_copy, value),
                                      microbatch.apply(_send_copy, target), payload, self.rpc_timeout)
            except Exception as exc:
                failed: Exception | None = exc
            else:
                failed = None
        if failed is not None:
            if replicated and self.peers is not None:  # spares with replicas (driver_side.replica_spares)
                self.peers.recover(failed, updating=False)
            elif replicated:  # (outside the pipe's lock: rebuilding the groups waits for the other replicas)
                replica_recovery.after_failure(failed)
            raise failed
        if replicated and average:
            replica_recovery.step_averaged()
        contexts.trained(context_id, self.pipe_id)
        if replicated and not average:
            self._unaveraged[context_id] = earlier + sum(rows)
        elif self.tied:  # after the averaging, as the averaged gradients are the ones to sum
            self.sum_tied_gradients(context_id, more_steps=True)
        return mean_loss(losses, rows)

    def _warn_unaveraged(self, context_id: int) -> None:
        """Warn about each other context that ended holding gradients that train_step left under
        ``no_sync()`` and no later step there averaged over the replicas.

        Distributed autograd keeps gradients per context, so the step that averages must come in the same
        context; an optimizer step on a context that ended without it moved this replica apart from the
        others. ``DistributedDataParallel.no_sync`` does not check; this check costs nothing, but sees it
        only afterwards, at the next step."""
        for ended in _ended_contexts(self._unaveraged, context_id):
            rows = self._unaveraged.pop(ended)
            warn_user(f"autograd context {ended} ended holding gradients of {rows} rows that train_step left under "
                      "pipe.no_sync(), which no later step in that context averaged over the replicas: an optimizer "
                      "step on them moved this replica apart from the others. Run the last train_step of each "
                      "context outside no_sync()")

    def _warn_no_gradient_output(self) -> None:
        if not self._warned_no_gradient_output:
            self._warned_no_gradient_output = True
            warn_user("Pipe output that cannot carry a gradient (integer tensors only) from a forward run with "
                      "gradients in a dist_autograd.context(): pipe.backward(ctx, loss) reaches its sends, but a plain "
                      "dist_autograd.backward would wait for them for ever. Run such forwards under torch.no_grad()")

    def backward(self, context_id: int, losses: list[Tensor], average: bool = True) -> None:
        """``dist_autograd.backward`` whose failures name the stage and worker. ``average=False``
        (``Pipe.no_sync()``) is refused with replicas: nothing could average its gradients later."""
        self._check_open()
        if not average and replicas.current() is not None:
            raise RuntimeError(
                "pipe.backward under pipe.no_sync(): a dist_autograd context takes one backward, and no train_step "
                "after it, so nothing could average these gradients over the replicas later, and an optimizer "
                "step on them would move this replica apart from the others. To accumulate, sum the losses of "
                "several forwards into one pipe.backward outside no_sync() (averaged once, weighted by all their "
                "rows), or run train_step under no_sync() with the context's last one outside")
        _check_losses(losses)
        if replicas.current() is not None:
            self._warn_unaveraged(context_id)
        by_pipe, unreached = contexts.begin_backward(context_id, self.pipe_id, losses)
        try:
            dist_autograd.backward(context_id, losses + unreached)
        except BaseException as exc:
            retained = self._retain_context(context_id, by_pipe)
            try:
                if isinstance(exc, RuntimeError):
                    raise diagnosis.explain(exc, "backward", self.pipe_id, self.workers, by_pipe) from exc
                raise
            finally:
                for call in retained:
                    with contextlib.suppress(Exception):
                        call.wait()
        if replicas.current() is not None:  # every pipe in the context, as each replica's driver does
            for pipe_id, record in by_pipe.items():
                self._call_per_worker(pipe_id, record.workers, control.average_replica_gradients, context_id,
                                      record.rows)
        for pipe_id in by_pipe:  # a tied parameter's copies: their gradients summed
            tied = _with_tied.get(pipe_id)
            if tied is not None:
                tied.sum_tied_gradients(context_id)

    def _retain_context(self, context_id: int, by_pipe: dict[str, contexts.Forwards]) -> list[Future[None]]:
        """Keep a failed backward's context alive here and on every stage worker of the pipes in it
        until the gradient RPCs still in flight there have ended (:func:`_rpc.retain_context`), and
        have each stage drop what its checkpoints keep for the failed steps, which the context's graph
        holds meanwhile. The calls must be answered before the caller's ``with`` block releases the
        context."""
        _rpc.retain_context(context_id)
        calls = []
        for pipe_id, record in by_pipe.items():
            for j, worker in enumerate(record.workers):
                with contextlib.suppress(Exception):  # a worker known to be gone
                    calls.append(rpc.rpc_async(worker, control.reporting, timeout=2,
                                               args=(control.abandon_backward, pipe_id, j, context_id, record.steps)))
        return calls

    def _run(self, meta: StepMeta, value: TensorOrTensors, collector: _Collector) -> None:
        """Send the whole input to the first stage in one message (it splits it into micro-batches)
        and wait until the step's output is here, or the first stage reports the step over (failed, or
        done when the output stays on the last worker).

        The output usually arrives before that report, which travels back stage by stage once the last
        stage's delivery is acknowledged: not waiting for it saves one reply per stage per step.
        Once the output is here nothing of the step can fail any more (skips and activations have
        all arrived where they were going)."""
        first = self.workers[0]
        phony = new_phony() if meta.grad_enabled else None
        try:
            report = rpc.rpc_async(first, server.receive_batch, timeout=self.rpc_timeout,
                                   args=(self.pipe_id, 0, meta, microbatch.apply(_send_copy, value), phony))
        except Exception as exc:
            raise diagnosis.first_cause([Failure.capture(exc, stage=0, worker=first, microbatch=None,
                                                         phase="forward", transport=True)]) from None
        # Wait on an Event, which Ctrl-C interrupts, not in the future's own wait, which it does not.
        report.add_done_callback(lambda _: collector.done.set())
        collector.done.wait()
        if not meta.keep_output and not report.done():
            return  # the output is in; the report is still on its way
        try:
            failures = report.wait()
        except Exception as exc:
            failures = [Failure.capture(exc, stage=0, worker=first, microbatch=None, phase="forward", transport=True)]
        if failures:
            cause = diagnosis.first_cause(failures)
            if isinstance(cause, WorkerError) and timed_out(cause.error_message):
                # Every stage before a hung one times out waiting for the next: find the one that is busy.
                busy = diagnosis.unresponsive(self.workers,
                                              "did not answer within 2 s, hung or still busy in its layers")
                if busy is not None:
                    raise busy from cause
            raise cause



def _check_losses(losses: list[Tensor]) -> None:
    """Refuse what ``dist_autograd.backward`` would, before the context records its one backward: a
    corrected retry may then follow in the same context."""
    for loss in losses:
        if not isinstance(loss, Tensor):
            raise TypeError(f"loss must be a Tensor or a sequence of Tensors, got a {type(loss).__name__}")
        if not loss.requires_grad:
            raise RuntimeError("the loss does not require grad (computed under torch.no_grad(), or from "
                               "outputs of forwards run outside the dist_autograd context?)")
        if loss.numel() != 1:
            raise RuntimeError(f"the loss must be a scalar (one element), got shape {tuple(loss.shape)}: reduce "
                               "it (.sum() or .mean()) first")


def _refuse_local_backward(output: TensorOrTensors) -> None:
    """Make a plain ``loss.backward()`` through ``output`` fail with a message that says what to call.

    The output came from the stage workers, so only distributed autograd can carry its gradient back;
    the local engine fails inside torch ("graphTask_ INTERNAL ASSERT FAILED"). Distributed autograd
    runs the driver's part of the graph on threads of its own, the local engine (for CPU tensors, as
    the driver's outputs are) on the caller's: a hook that finds itself on the forward's thread is
    in a local backward."""
    caller = threading.get_ident()

    def check(grad: Tensor) -> None:
        if threading.get_ident() == caller:
            raise RuntimeError("this pipe's output was computed on its stage workers, and a local backward "
                               "(loss.backward(), torch.autograd.grad) cannot reach them: run "
                               "pipe.backward(ctx, loss) or dist_autograd.backward(ctx, [loss]) inside the "
                               "dist_autograd.context() of the forward")

    for t in microbatch.as_tensors(output):
        if t.requires_grad:
            t.register_hook(check)


def _raised_if_failed(index: int, result: Any) -> Any:
    """A control call's result; raised where it is a :class:`Failure` (see ``control.reporting``)."""
    if isinstance(result, Failure):
        raise replace(result, stage=index).to_exception()
    return result


def _pickled_loss(loss_fn: Any) -> bytes:
    """``loss_fn`` by value, as factories travel: a function of the user's script is not importable on a worker."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
    try:
        return cloudpickle.dumps(loss_fn)
    except Exception as exc:
        raise TypeError(f"loss_fn cannot be sent to the last stage's worker: it does not pickle ({type(exc).__name__}: "
                        f"{exc}); pass a module-level function, a lambda or an nn.Module loss") from exc


def _pickled(spec: StageSpec, workers: Sequence[str]) -> bytes:
    try:
        return cloudpickle.dumps(spec)
    except Exception as exc:  # a lock, an open file, another Pipe held by a layer
        raise TypeError(f"stage {spec.index} cannot be sent to worker {workers[spec.index]!r}: its layers do not "
                        f"pickle ({type(exc).__name__}: {exc}); build it there with Pipe.from_factories") from exc
