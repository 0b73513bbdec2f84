"""The public ``Pipe``: argument checks and the user-facing methods (where stages go:
:mod:`rrefpipe.driver_side.placement`)."""
from __future__ import annotations

import contextlib
import numbers
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor, nn

from . import _rpc, calling, microbatch, replicas
from .driver_side import clip, pipe_optimizer, placement, streaming
from .driver_side import recovery, replica_spares
from .driver_side import sharded as pipe_sharded
from ._rpc import DEFAULT_RPC_TIMEOUT
from .balance import balance_for_pipe
from .batchnorm import defer_batch_norms, plain_batch_norms
from .captured import CapturedPipeModel, StructuredLoss, wants_capture
from .driver_side.remote import RemoteDriver
from .errors import warn_user
from .driver_side.local import LocalDriver, warn_in_process
from .microbatch import TensorOrTensors
from .driver_side.output import PipeRRef, RemotePipeRRef
from .driver_side.pipe_optimizer import PipeOptimizer
from .schedule import PipeMareOptions, check_schedule, parse_schedule
from .partition import (balance_by_placement, check_balance, check_checkpoint, check_chunks, module_device,
                        check_unshared, split_module, split_state_dict, uniform_balance, verify_module)
from .seeding import driver_seed
from .stage_side.materialize import StageInit, meta_tensors
from .stage_side.server import StageSpec
from .driver_side.init_plan import plan_init
from .weights import InitSpec
from .skip.skippable import verify_skippables
from .stage_side.stage import StageInfo
from .trace import Event

__all__ = ["Pipe"]

_releasing = threading.Lock()


class Pipe(nn.Module):
    """Wrap an ``nn.Sequential``, or any ``nn.Module`` cut at ``split_points``, for synchronous
    pipeline-parallel training over RPC workers (GPipe, 1F1B or interleaved 1F1B schedules).

    Each stage runs on its own RPC worker process with its partition on its device; micro-batches
    pass worker to worker. Where the stages run:

    * RPC not initialised (the default): rrefpipe starts one local worker per stage on 127.0.0.1, shared
      by the open pipes; the last of them to :meth:`close` (or leave its ``with``) stops them, and so
      does interpreter exit.
    * RPC initialised with several workers (e.g. under ``torchrun``): stages go to ``workers`` (names),
      by default to the other workers of the group in rank order.
    * RPC initialised with world size 1 (PyTorch 1.8 style): stages follow the modules' devices and run
      in this process; the output's ``loss.backward()`` works as for any module.

    A stage built on a worker seeds that worker's random generator from the driver's generator state
    (read, not drawn from) and the stage index: seeded runs repeat, and stages draw different numbers.

    Args:
        module: an ``nn.Sequential``, cut between its layers (``balance``); or any ``nn.Module``, captured
            with ``torch.export`` on ``sample`` and cut at ``split_points`` or at its
            :func:`~rrefpipe.set_stage` marks (see the guide's "Any model"). All parameters of one stage
            on one device. A parameter shared by layers of two stages of an ``nn.Sequential`` is refused;
            a captured model's tied parameters get a copy per stage, whose gradients are summed.
        chunks: number of micro-batches per mini-batch (the input is split along dim 0).
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'``: which micro-batches recompute
            their forward for backward instead of keeping activations. CPU stages before the last
            recompute ahead of backward, while they wait for the gradient, one micro-batch at a time.
        deferred_batch_norm: replace every ``BatchNorm*d`` that tracks running statistics by
            :class:`~rrefpipe.batchnorm.DeferredBatchNorm`, whose running statistics are those of the
            whole mini-batch, committed once per mini-batch (one nested in a child module is
            replaced in that child, as PyTorch's Pipe did).
        balance: layers per stage, e.g. ``[2, 3]``; by default an even split when ``devices`` is given,
            else stages follow the layers' devices, and a model on the CPU is split evenly over
            ``workers`` when it names several. ``'time'``
            or ``'size'``: profile the layers on ``sample`` (:mod:`rrefpipe.balance`), one stage per
            entry of ``devices`` (else of ``workers``), before any worker starts.
        sample: an example mini-batch for ``balance='time' | 'size'`` (split into ``chunks`` as in training);
            with ``split_points`` or marks, the forward's positional arguments (a tensor or a tuple) the
            model is captured on: tensors with a batch dim 0 of 2 or more, which becomes dynamic (other
            dims and non-tensor arguments are fixed to the sample's).
        workers: names of existing RPC workers, one per stage.
        devices: device per stage (``"cpu"``, ``"cuda:1"``); by default where the layers are.
        remote_output: keep the output on the last stage's worker; ``forward`` then returns a
            remote RRef (``.to_here()`` fetches it).
        rpc_timeout: seconds each RPC may take before the step fails (a dead worker fails at once);
            a whole forward is one such call. Backward waits on the RPC group's default timeout.
        microbatches_per_message: micro-batches a stage sends to the next in one message of ``pipe(x)``
            (their gradients then come back in one message of ``pipe.backward``). More saves each hop a
            request, a reply and a gradient message per extra micro-batch, and delays the next stage's
            start by as many micro-batches: worth it with many small micro-batches (see the guide's
            Performance page). Stages in this process (RPC world of one) send no messages.
            :meth:`train_step` sends each micro-batch on its own and refuses a value above 1 (ValueError):
            under 1F1B a stage may follow a forward with a backward that waits on the next stage, which
            needs that very output, so it cannot be held for the micro-batch after it.
        call_style: how a tuple reaches a layer. ``'auto'``: a call with one input, ``pipe(x)`` or
            ``pipe((a, b))``, passes tuples whole (PyTorch 1.8), except to a layer whose ``forward``
            requires two or more arguments; a call with several, ``pipe(a, b)``, spreads every tuple
            (PyTorch 2.x). ``'2.x'``: every call spreads every tuple, as 2.x did, for 2.x models whose
            layers take ``*args`` or optional arguments.
        schedule: the order in which :meth:`train_step` runs each stage's forwards and backwards:
            ``'GPipe'`` (every forward, then every backward), ``'1F1B'`` (stage j holds at most n - j
            micro-batches' activations), ``'Interleaved1F1B'`` (several stages per worker, a smaller
            bubble), or a zero-bubble schedule, which splits each backward into the inputs' gradients
            and the weights' and runs the latter where a worker would wait: ``'InterleavedZeroBubble'``
            (ZB1P, any ``stages_per_worker``), ``'ZBVZeroBubble'`` and ``'DualPipeV'`` (two stages per
            worker in a V); in any case; see the guide's "Choosing a schedule". ``pipe(x)`` with
            ``pipe.backward`` always runs GPipe's order. The continuous schedules ``'PipeDream'``,
            ``'PipeDream-2BW'`` and ``'PipeMare'`` (one stage per worker) are for :meth:`train_stream`,
            which never flushes the pipeline and updates each stage's weights while later batches are
            in flight (the guide's "Asynchronous pipelines and streaming"); one ``train_step`` of them
            runs as ``'1F1B'``. ``'PipeMare'`` needs ``checkpoint='never'``.
        stages_per_worker: stages on each worker, for ``'Interleaved1F1B'`` and
            ``'InterleavedZeroBubble'`` (stage j runs on worker j mod p, p = stages / stages_per_worker),
            and 2 for the V-shaped ``'ZBVZeroBubble'`` and ``'DualPipeV'`` (stage j on worker j for
            j < p, on worker 2p - 1 - j after); p workers start (or are named in ``workers``).
        split_points: submodule paths (``named_modules()``'s, such as ``'blocks.2'``) in forward order: a
            stage begins at the first operation of each. ``pipe(*args)`` then takes the model's positional
            arguments and gives its output as it is (a tuple, dict or ``ModelOutput``); ``state_dict()``
            has the model's keys. A parameter several stages use (an embedding tied to the output head)
            has a copy on each, whose gradients ``pipe.backward`` and ``train_step`` sum.
        vertical_sync: ``schedule='PipeDream'`` only: every stage runs batch t on the weight version
            stage 0 uses (max(t - ceil((n - 1) / chunks), 0) updates), so that a batch sees one version
            throughout the pipeline.
        init: where each stage's weights come from, read on its worker (each worker reads only its
            stages' tensors, by the model's ``state_dict()`` keys): a safetensors file, a Hugging Face
            directory (``model.safetensors.index.json`` shards), a ``torch.save`` file, a DCP checkpoint
            (:meth:`save`'s), a mapping of tensors, or a callable run on each worker that is given
            ``{key: meta tensor}`` and returns those keys' values. With a model whose parameters are on the
            meta device (``with torch.device("meta"):``, or :func:`rrefpipe.meta_parameters`) the driver never
            holds the weights; ``None`` there runs each module's ``reset_parameters()`` on the worker (seeded
            from the driver's seed and the module's name). Checked before any worker starts: a missing,
            unexpected, misshapen or other-dtype key raises ``ValueError`` naming it (see the guide's "Large
            models").
        spares: idle workers kept to take the stages of a stage worker that dies: a count of local workers
            started with the stages, or the names of RPC workers (with ``workers=``). During
            :meth:`train_stream` (synchronous schedules, with ``pipe.optimizer``) a lost worker's stages move
            to a spare, every stage goes back to the last snapshot and the batches since are run again, so
            the run ends with the weights it would have had (:attr:`recoveries` lists what happened).
            With replicas (``workers.torchrun_group(replicas=R, spares=k)``, ``spares=stage_workers.spares``)
            no snapshot is kept: a lost worker's spare, and every stage of its replica, take their state
            from the same stages of a live replica (the guide's "Spares with replicas").
        snapshot_every: with spares (one replica), every stage's state (weights, optimizer and scheduler state, random
            state) is copied to a spare every this many updates of :meth:`train_stream` (the next step waits
            for each stage to copy its state, not for the transfer); a recovery replays at most this many
            batches.

    Raises:
        CaptureError: ``torch.export`` cannot capture the module (names the submodule, torch's reason and
            what to do); before any worker starts, as are the errors of split points and marks.
        TypeError: ``module`` is not an ``nn.Sequential`` and has no split points or marks, or its
            skippable layers do not match
            (:func:`~rrefpipe.skip.verify_skippables`).
        ValueError: invalid ``chunks``, ``checkpoint``, ``balance``, ``workers`` or ``devices``; an unknown
            ``schedule``, a ``stages_per_worker`` that does not divide the stages (or above 1 under a
            continuous schedule), or ``chunks`` that the schedule cannot run; ``vertical_sync`` without
            ``'PipeDream'``; ``'PipeMare'`` with checkpointing; an
            empty ``module``; a layer that appears twice; a stage whose parameters span devices; an
            ``init`` that does not fit the model, a meta tensor nothing initialises, ``init``/meta in an
            RPC world of one.
        StageError: a stage could not be built on its worker (names the stage and worker).
    """

    _spares: int | list[str] = 0  # (``from_factories`` pipes have none)
    snapshot_every = 10

    def __init__(
        self,
        module: nn.Module,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        *,
        balance: Sequence[int] | str | None = None,
        sample: TensorOrTensors | None = None,
        workers: Sequence[str] | None = None,
        devices: Sequence[str | torch.device] | None = None,
        remote_output: bool = False,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        microbatches_per_message: int = 1,
        call_style: str = "auto",
        schedule: str = "GPipe",
        stages_per_worker: int = 1,
        split_points: Sequence[str] | None = None,
        vertical_sync: bool = False,
        init: InitSpec = None,
        spares: int | Sequence[str] = 0,
        snapshot_every: int = 10,
    ) -> None:
        super().__init__()
        self._spares, self.snapshot_every = _check_spares(spares, snapshot_every)
        self._captured: CapturedPipeModel | None = None
        original = module
        if wants_capture(module, split_points):
            self._captured = self._capture(module, sample, split_points, balance, deferred_batch_norm, remote_output)
            assert self._captured.layers is not None
            module, balance, sample = self._captured.layers, [1] * len(self._captured.layers), None
        verify_module(module)
        assert isinstance(module, nn.Sequential)  # (verify_module raised otherwise; for mypy)
        verify_skippables(module)
        self._configure(chunks, checkpoint, remote_output, rpc_timeout, microbatches_per_message, call_style,
                        schedule, stages_per_worker, vertical_sync)
        if len(module) == 0:  # PyTorch's Pipe accepted it: forward returns the input
            self._build_empty()
            return
        if deferred_batch_norm:
            if not plain_batch_norms(module):
                warn_user("deferred_batch_norm=True, but the module has no BatchNorm layers to defer (none that "
                          "tracks running statistics)")
            module = defer_batch_norms(module, self.chunks)
        if isinstance(balance, str):  # 'time' | 'size': profile now, one stage per device (or worker)
            balance = balance_for_pipe(balance, module, sample, chunks=self.chunks, workers=workers, devices=devices,
                                       spread=self.call_style == "2.x")
        if balance is not None:
            balance = check_balance(balance, len(module))
            stage_devices = placement.stage_devices(devices, len(balance)) or [
                module_device(m, f"stage {j}") or torch.device("cpu")
                for j, m in enumerate(split_module(module, balance))]
        elif devices is not None:
            stage_devices = placement.stage_devices(devices, None) or []
            balance = uniform_balance(len(module), len(stage_devices))
        else:
            balance, stage_devices = balance_by_placement(module)
            stage_devices = [torch.device("cpu") if d.type == "meta" else d for d in stage_devices]
            if workers is not None and len(workers) > 1 and stage_devices == [torch.device("cpu")]:
                # A CPU model and several workers named (torchrun's stage workers): a stage on each, as
                # ``Pipe(model, workers=stage_workers)`` reads. (A model on one GPU keeps the count
                # check: which GPU each worker's stage belongs on is for ``devices=`` to say.)
                if len(workers) > len(module):
                    raise ValueError(f"{len(workers)} workers named for a model of {len(module)} layers: name at "
                                     "most one worker per layer")
                balance = uniform_balance(len(module), len(workers))
                stage_devices = stage_devices * len(balance)
        stage_devices = [torch.device("cpu") if d.type == "meta" else d for d in stage_devices]  # made on workers
        stages = split_module(module, balance)
        for j, stage in enumerate(stages):
            module_device(stage, f"stage {j}")
        check_schedule(self.schedule, len(stages), self.chunks, self.stages_per_worker)
        self.balance = list(balance)
        if _rpc.is_initialized() and len(_rpc.worker_names()) == 1:
            if init is not None or any(True for _ in meta_tensors(module)):
                raise ValueError("init= and models on the meta device build each stage on its worker, and this RPC "
                                 "group has only this process: start workers (or let rrefpipe start them, without "
                                 "init_rpc), or load the weights into the model before the Pipe")
            if workers:
                raise ValueError(f"workers {list(workers)} named, but this RPC group has only this process")
            placement.check_local_devices(stage_devices)
            for name, layer in module.named_children():  # so that state dicts, a parent's and DDP's
                if hasattr(self, name) and name not in self._modules:  # included, keep the plain keys
                    raise ValueError(f"layer name {name!r} is taken by an attribute of Pipe; rename the layer")
                self.add_module(name, layer)
            warn_in_process(len(stages))
            self._driver: LocalDriver | RemoteDriver = LocalDriver(stages, stage_devices, chunks=self.chunks,
                                                                   checkpoint=self.checkpoint)
        else:
            if self._captured is None:  # a captured model's tied parameters get a copy per stage (summed)
                check_unshared(stages)
            seed = driver_seed()
            inits = self._plan_init(init, stages, original, seed)
            specs = [placement.stage_spec(j, stage, None, stage_devices, seed, inits[j])
                     for j, stage in enumerate(stages)]
            self._driver = self._place(specs, workers, stage_devices)
            if self._captured is not None:
                self._captured.layers = None  # on the workers now: the driver keeps no copy
                if self._captured.tied:
                    self._driver.tie([{j: f"{j}.graph.{name}" for j, name in t.names.items()}
                                      for t in self._captured.tied])

    def _plan_init(self, init: InitSpec, stages: list[nn.Sequential], original: nn.Module,
                   seed: int) -> list[StageInit | None]:
        """How each worker makes its stage's tensors, where ``init`` is given or the model is on the meta
        device (checked against the source before any stage is sent)."""
        if self._captured is None:  # the model's keys; a tensor tied within a stage has several
            keys: list[dict[str, tuple[str, ...]]] = []
            for stage in stages:
                state = stage.state_dict(keep_vars=True)
                aliases: dict[int, tuple[str, ...]] = {}
                for key, tensor in state.items():
                    aliases[id(tensor)] = (*aliases.get(id(tensor), ()), key)
                keys.append({key: aliases[id(tensor)] for key, tensor in state.items()})
            return plan_init(init, stages, keys, original, seed)
        return plan_init(init, stages, self._captured.stage_keys(), original, seed,
                         also_expected=list(self._captured.unused))

    @staticmethod
    def _capture(module: nn.Module, sample: Any, split_points: Sequence[str] | None, balance: Any,
                 deferred_batch_norm: bool, remote_output: bool) -> CapturedPipeModel:
        """Any module cut at ``split_points`` (or its ``set_stage`` marks): checked, captured and made into
        one layer per stage, before any worker starts."""
        what = "split_points" if split_points is not None else "set_stage marks"
        if balance is not None:
            raise ValueError(f"balance= and {what}: the split points say where stages begin; drop balance")
        if deferred_batch_norm:
            raise ValueError(f"deferred_batch_norm=True with {what}: torch.export traces BatchNorm into plain "
                             "operations, which rrefpipe cannot defer; leave it False (running statistics are then "
                             "updated per micro-batch), or pipeline an nn.Sequential")
        if _rpc.is_initialized() and len(_rpc.worker_names()) == 1:
            raise ValueError(f"a model cut at {what} runs on stage workers, and this RPC group has only this "
                             "process: start workers (or let rrefpipe start them, without init_rpc)")
        captured = CapturedPipeModel.build(module, sample, split_points)
        if remote_output and not captured.outputs.plain:
            raise ValueError("remote_output=True needs a model whose output is a tensor or a tuple of tensors; this "
                             f"one returns {captured.captured.out_spec.type.__name__}: leave remote_output False")
        return captured

    @classmethod
    def from_factories(
        cls,
        factories: Sequence[placement.StageFactory],
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        *,
        workers: Sequence[str] | None = None,
        devices: Sequence[str | torch.device] | None = None,
        remote_output: bool = False,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        microbatches_per_message: int = 1,
        call_style: str = "auto",
        schedule: str = "GPipe",
        stages_per_worker: int = 1,
        vertical_sync: bool = False,
    ) -> Pipe:
        """Build each stage's layers *on its worker* by calling ``factories[j]()`` there.

        The weights never exist on the driver. Factories travel by value (cloudpickle), so lambdas and
        functions of your script work; what they import must be importable on the workers. State-dict
        keys are those of the ``nn.Sequential`` that concatenates the stages' layers. ``devices``
        defaults to the CPU for every stage; the other arguments are ``Pipe``'s (``deferred_batch_norm``
        converts the BatchNorm layers of each stage on its worker, once its factory has built them).

        Raises:
            TypeError: ``factories`` is empty or holds something that is not callable; the stages' skip
                names do not pair up, one stash and one pop in the same or a later stage each
                (:func:`~rrefpipe.skip.verify_skippables` at stage level).
            StageError: a factory raised on its worker (names the stage and worker).
        """
        if not factories or not all(callable(f) for f in factories):
            raise TypeError("from_factories expects a non-empty list of callables, one per stage")
        pipe = cls.__new__(cls)
        nn.Module.__init__(pipe)
        pipe._captured = None
        pipe._configure(chunks, checkpoint, remote_output, rpc_timeout, microbatches_per_message, call_style,
                        schedule, stages_per_worker, vertical_sync)
        stage_devices = placement.stage_devices(devices, len(factories)) or [torch.device("cpu")] * len(factories)
        seed = driver_seed()
        specs = [placement.stage_spec(j, None, f, stage_devices, seed) for j, f in enumerate(factories)]
        for spec in specs:
            spec.deferred_chunks = pipe.chunks if deferred_batch_norm else None
        pipe._driver = pipe._place(specs, workers, stage_devices)
        pipe.balance = [len(info.layers) for info in pipe._driver.infos]
        return pipe

    def _configure(self, chunks: int, checkpoint: str, remote_output: bool, rpc_timeout: float,
                   microbatches_per_message: int, call_style: str, schedule: str, stages_per_worker: int,
                   vertical_sync: bool = False) -> None:
        self.chunks = check_chunks(chunks)
        self.schedule = parse_schedule(schedule)
        if vertical_sync and self.schedule != "PipeDream":
            raise ValueError(f"vertical_sync=True is PipeDream's option (every stage uses the same weight version), "
                             f"not {self.schedule}'s")
        if self.schedule == "PipeMare" and checkpoint != "never":
            raise ValueError(f"PipeMare with checkpoint={checkpoint!r}: a recomputation in backward would run on the "
                             "weights current then, not on those the forward used; pass checkpoint='never'")
        self.vertical_sync = bool(vertical_sync)
        self.stages_per_worker = check_chunks(stages_per_worker, "stages_per_worker")
        self._warned_schedule = False
        self._averaging = True  # False inside no_sync()
        self.checkpoint = check_checkpoint(checkpoint)
        real = isinstance(rpc_timeout, numbers.Real) and not isinstance(rpc_timeout, bool)
        if not real or not rpc_timeout > 0:
            raise ValueError(f"rpc_timeout must be positive seconds, got {rpc_timeout!r}")
        self.microbatches_per_message = check_chunks(microbatches_per_message, "microbatches_per_message")
        self.call_style = calling.check_call_style(call_style)
        self.remote_output = remote_output
        self.rpc_timeout = float(rpc_timeout)
        self._local_workers: Any = None
        self._finalizer: weakref.finalize | None = None
        self._guard: recovery.Guard | None = None  # with spares: snapshots and recovery

    def _build_empty(self) -> None:
        """An empty ``nn.Sequential``: no stage; forward hands back its input as an RRef, which needs this
        process in an RPC group (local workers are started for it where RPC is not initialised)."""
        self.balance = []
        if not _rpc.is_initialized():
            _, self._local_workers = placement.stage_workers(1, None, [torch.device("cpu")], [], self.rpc_timeout)
        self._driver = LocalDriver([], [], chunks=self.chunks, checkpoint=self.checkpoint)
        if self._local_workers is not None:
            self._release_when_dropped(self._driver)

    def _place(self, specs: list[StageSpec], workers: Sequence[str] | None,
               devices: Sequence[torch.device]) -> RemoteDriver:
        n, v = len(specs), self.stages_per_worker
        check_schedule(self.schedule, n, self.chunks, v)
        p = n // v  # workers; stage j < p on worker j, the others as the schedule lays them out
        layout, how = placement.worker_layout(self.schedule, n, v)
        named = placement.interleaved_workers(workers, layout, how)
        held = placement.close_abandoned()  # their hold on the embedded workers ends once this pipe has its own
        spares = self._spares
        extra = spares if isinstance(spares, int) else 0
        try:
            workers, self._local_workers = placement.stage_workers(
                p + extra, named, placement.worker_devices(devices, layout, how) + [devices[0]] * extra, held,
                self.rpc_timeout)
        finally:
            placement.release(held)
        spare_names = list(spares) if not isinstance(spares, int) else list(workers[p:p + extra])
        if isinstance(spares, int) and spares and self._local_workers is None:
            raise ValueError(f"spares={spares} starts local spare workers, and this pipe's workers are named: name the "
                             "spares too (spares=['worker5', ...], idle workers of the RPC group)")
        workers = list(workers[:p]) if extra and self._local_workers is not None else workers
        if spare_names:  # checked before any stage is built
            try:
                spare_names = placement.check_spares(spare_names, workers)
            except BaseException:
                self._stop_local_workers()
                raise
        if len(workers) != p:
            raise ValueError(f"{len(workers)} workers named for {n} stages: {list(workers)}")
        workers = [workers[w] for w in layout]
        for spec in specs:
            spec.next_worker = workers[spec.index + 1] if spec.index + 1 < n else None
        try:
            driver = RemoteDriver(specs, workers, chunks=self.chunks, checkpoint=self.checkpoint,
                                  remote_output=self.remote_output, rpc_timeout=self.rpc_timeout,
                                  microbatches_per_message=self.microbatches_per_message, schedule=self.schedule,
                                  stages_per_worker=v)
        except BaseException:
            self._stop_local_workers()
            raise
        self._release_when_dropped(driver)
        if spare_names and replicas.current() is not None:  # the other replicas are the copy: no snapshots
            driver.peers = replica_spares.PeerGuard(driver, spare_names)
        elif spare_names:
            self._guard = recovery.Guard(driver, spare_names, self.snapshot_every)
        return driver

    def _release_when_dropped(self, driver: LocalDriver | RemoteDriver) -> None:
        """A pipe dropped without ``close()`` leaves its driver and workers to ``placement.abandoned``, closed
        at the next forward, pipe built or ``close()``."""
        self._finalizer = weakref.finalize(self, placement.abandoned.append, (driver, self._local_workers))
        self._finalizer.atexit = False  # at exit the workers rrefpipe started are stopped anyway

    # -- running -----------------------------------------------------------------------------------
    def forward(self, *inputs: Any, input: Any = None) -> PipeRRef | RemotePipeRRef:  # noqa: A002 (1.8's name)
        """Run one mini-batch through the pipeline; returns an ``RRef`` to the output.

        ``pipe(input=x)``, PyTorch 1.8's keyword, is ``pipe(x)``.

        ``pipe(x)`` or ``pipe((a, b))`` (one input, PyTorch 1.8's form): a tuple reaches a layer whole,
        except a layer whose ``forward`` requires two or more arguments, which gets it spread.
        ``pipe(a, b)`` (several tensors, PyTorch 2.x's form): the first layer is called as ``layer(a, b)``
        and every tuple between layers is spread, as 2.x did. Every input is split along dim 0 into
        ``chunks`` micro-batches (2.x's non-tensor inputs and ``NoChunk``, replicated to every
        micro-batch, are refused).

        The output is owned by this process (``.local_value()``) unless ``remote_output=True``,
        where it stays on the last stage's worker (``.to_here()``). The RRef is a
        :class:`~rrefpipe.driver_side.output.PipeRRef` (an ``rpc.RRef``), or a
        :class:`~rrefpipe.driver_side.output.RemotePipeRRef` that wraps the remote one; used as a tensor,
        either says which of the two calls to add. Train under ``dist_autograd.context()`` and call
        :meth:`backward`; outside a context a training-mode forward warns once, as no gradients could
        reach the stages.

        Raises:
            StageError: a stage raised (names stage, worker, micro-batch and cause; the pipe stays
                usable). ``WorkerError`` (a ``StageError``) when a worker is dead or unreachable.
            ValueError: the input is not on the CPU (stage workers receive it from this process).
            TypeError: no input; an input that is not a tensor or tuple of tensors; several inputs of which
                one is not a tensor.
        """
        if input is not None:
            if inputs:
                raise TypeError(f"Pipe got input= and {len(inputs)} positional input(s): pass the mini-batch once")
            inputs = (input,)
        if self._captured is not None:  # the model's own arguments, checked against the capture
            inputs = (self._captured.inputs(inputs),)
        value, spread = microbatch.call_inputs(inputs)
        if placement.abandoned:  # `pipe = Pipe(...)` again: the previous pipe was dropped after this one was built
            placement.release(placement.close_abandoned())
        if (self.schedule != "GPipe" and not self._warned_schedule and self.training and torch.is_grad_enabled()
                and _rpc.current_context_id() is not None):
            self._warned_schedule = True
            warn_user(f"Pipe(schedule={self.schedule!r}): pipe(x) followed by pipe.backward(ctx, loss) runs GPipe's "
                      "order (every forward, then the backward), as the loss is computed here after all outputs "
                      f"came back. {self.schedule} is followed by pipe.train_step(ctx, x, target, loss_fn), which "
                      "computes the loss on the last stage")
        output = self._driver.forward(value, training=self.training, spread=spread or self.call_style == "2.x")
        if self._captured is not None and not self._captured.outputs.plain and isinstance(output, PipeRRef):
            output = PipeRRef(self._captured.outputs.rebuild(output.local_value()))
        return output

    def train_step(self, context_id: int, input: Any, target: Any,  # noqa: A002 (Pipe's name for it)
                   loss_fn: Callable[[Any, Any], Tensor], *, scaler: Any = None) -> Tensor:
        """One training step under the pipe's ``schedule``: forward, loss and backward of every micro-batch.

        The input and ``target`` are split into micro-batches alike; ``loss_fn(output_i, target_i)`` runs on
        the last stage's worker for each micro-batch as soon as its output exists (it travels by value, as
        factories do: a lambda or a function of your script works), and each stage runs its forwards and
        backwards in the schedule's order. Returns the mini-batch loss, detached: the micro-batch losses'
        mean weighted by their rows, which for a loss that averages over samples (cross-entropy, MSE by
        default) is the loss of the whole batch. The gradients left in ``context_id`` are those of exactly
        that value, so call ``DistributedOptimizer.step(context_id)`` next (after ``clip_grad_norm_`` if you
        clip); several steps in one context add up their gradients, as several backwards do in one process.

        Args:
            context_id: the current ``dist_autograd.context()``; its gradients are where the optimizer reads them.
            input: the mini-batch, a CPU tensor or tuple of tensors (as ``pipe(input)`` takes it).
            target: a CPU tensor or tuple of tensors with the input's batch size.
            loss_fn: ``loss_fn(output, target) -> scalar tensor``, e.g. ``nn.functional.cross_entropy``.
            scaler: a :class:`rrefpipe.GradScaler`: backward runs on the scaled loss; then
                ``scaler.step(optimizer, context_id)`` and ``scaler.update()`` as usual.

        Raises:
            RuntimeError: ``context_id`` is not the current autograd context, or gradients are off.
            ValueError: the pipe was built with ``microbatches_per_message`` above 1 (it applies to
                ``pipe(x)``; refused before any stage runs); the target's batch size differs from the
                input's; a batch that splits into a micro-batch count the schedule cannot run
                (Interleaved1F1B); tensors not on the CPU.
            TypeError: ``loss_fn`` is not callable or does not pickle; input or target not tensors.
            StageError: a stage, or ``loss_fn`` (``phase='loss_fn'``), raised or returned something that is
                not a scalar tensor (names stage, worker and micro-batch); ``WorkerError`` for a dead or hung
                worker. The pipe stays usable: run the next step in a new context.
        """
        if self.microbatches_per_message > 1:
            # Not honoured: a held output could deadlock 1F1B (see the argument's docs), and GPipe's
            # train_step alone grouping messages would make the option mean something else per schedule.
            raise ValueError(f"Pipe(microbatches_per_message={self.microbatches_per_message}) groups the messages of "
                             "pipe(x) and its pipe.backward only: train_step sends each micro-batch's activation and "
                             "gradient on its own, as its schedules run forwards and backwards one micro-batch at a "
                             "time. Build the pipe with microbatches_per_message=1 (the default) to train it with "
                             "train_step, or train this one with pipe(x) and pipe.backward(ctx, loss)")
        if _rpc.current_context_id() != context_id:
            raise RuntimeError(f"train_step(context_id={context_id!r}) must run inside that context's block, "
                               "`with dist_autograd.context() as context_id:`, where its gradients are kept for "
                               "DistributedOptimizer.step(context_id)")
        if not torch.is_grad_enabled():
            raise RuntimeError("train_step under torch.no_grad(): a training step needs gradients; for evaluation "
                               "call pipe(x) under torch.no_grad()")
        if scaler is not None and not (callable(getattr(scaler, "is_enabled", None))
                                       and callable(getattr(scaler, "get_scale", None))):
            raise TypeError(f"scaler must be an rrefpipe.GradScaler, got {type(scaler).__name__}")
        scale = 1.0 if scaler is None or not scaler.is_enabled() else float(scaler.get_scale())
        if self._captured is not None:  # input: the model's positional arguments; loss_fn: its whole output
            input = self._captured.inputs(input if isinstance(input, tuple) else (input,))  # noqa: A001
            if not self._captured.outputs.plain:
                loss_fn = StructuredLoss(loss_fn, self._captured.outputs)
        if placement.abandoned:
            placement.release(placement.close_abandoned())
        # (in one process there are no replicas to average over)
        averaging = {"average": self._averaging} if isinstance(self._driver, RemoteDriver) else {}
        return self._driver.train_step(context_id, input, target, loss_fn, training=self.training,
                                       spread=self.call_style == "2.x", loss_scale=scale, **averaging)

    def optimizer(self, cls: type[torch.optim.Optimizer], /, **kwargs: Any) -> PipeOptimizer:
        """``cls(stage_parameters, **kwargs)`` built on every stage's worker, one per stage, and owned by
        the pipe (closed with it): ``step(context_id)`` and ``zero_grad()`` as ``DistributedOptimizer``'s,
        ``param_groups``, ``state_dict()`` with the model's parameter names, and LR schedules through
        :class:`rrefpipe.optim.RemoteLRScheduler`. :meth:`train_stream` needs it under an asynchronous
        schedule, whose stages step it inside the pipeline; see
        :class:`~rrefpipe.driver_side.pipe_optimizer.PipeOptimizer`."""
        return pipe_optimizer.build(self, cls, **kwargs)

    def train_stream(self, batches: Iterable[Any], loss_fn: Callable[[Any, Any], Tensor], optimizer: Any, *,
                     lr_scheduler: Any = None, pipemare: PipeMareOptions | None = None,
                     rollback: bool = True) -> Iterator[Tensor]:
        """Train on every ``(input, target)`` pair of ``batches``; yields each batch's loss (detached, the
        row-weighted mean of its micro-batch losses, as :meth:`train_step` returns it), in order.

        Under a synchronous schedule (GPipe, 1F1B, ...) this is exactly the loop of ``train_step``,
        ``optimizer.step(context_id)`` and ``lr_scheduler.step()`` per batch (``optimizer``: a
        :meth:`optimizer` or a ``DistributedOptimizer``). Under ``'PipeDream'``, ``'PipeDream-2BW'`` or
        ``'PipeMare'`` the pipeline never drains: batch t + 1 enters before batch t has finished its
        backward, and each stage updates its weights (with ``optimizer``, which must be this pipe's
        :meth:`optimizer`, and its ``lr_scheduler`` if given) as soon as its own backward of a batch is
        done; which weights each batch uses is the schedule's rule (the guide's "Asynchronous pipelines
        and streaming"). ``batches`` is pulled lazily, at most ``ceil((stages - 1) / chunks) + 2`` batches
        ahead of the losses yielded. When it ends, or the loop is left (``break``), every batch fed is
        finished and applied before the generator returns or closes. ``pipemare``: PipeMare's learning-rate
        rescheduling and discrepancy correction (:class:`rrefpipe.PipeMareOptions`, off by default).

        When a stage fails under an asynchronous schedule, every stage is rolled back to the last update
        all of them had applied (weights, optimizer and LR-scheduler state), and the error's note says
        which. For that each stage keeps the means to undo its last ``ceil(stages / chunks) + 1``
        updates: that many copies of its optimizer state, taken at each update; ``rollback=False``
        spares them, and a failure then leaves each stage where it was (the note says where).

        Raises:
            StageError: a stage or ``loss_fn`` failed (names the stage, worker, batch and micro-batch);
                ``WorkerError`` for a dead or hung worker (no rollback then: the stages of a dead worker are
                gone). The stream ends; the pipe stays usable.
            TypeError, ValueError: an item that is not a pair of CPU tensors (names its position; what
                was fed before it is finished first), an optimizer that is not the pipe's under an
                asynchronous schedule, a pipe in one process under one.
        """
        return streaming.train_stream(self, batches, loss_fn, optimizer, lr_scheduler, pipemare, rollback)

    def stream(self, inputs: Iterable[Any], *, in_flight: int | None = None) -> Iterator[Any]:
        """Forward every input of ``inputs`` (each as ``pipe(x)`` takes it, split into ``chunks``
        micro-batches) and yield the outputs on this process, in input order, while batch t + 1 enters
        before batch t has left. Call it under ``torch.no_grad()`` or in eval mode.

        At most ``in_flight`` inputs (default ``ceil((stages - 1) / chunks) + 2``) are in the pipeline at
        once, which bounds the memory; ``inputs`` is pulled lazily. While the stream runs it owns the
        pipe: ``pipe(x)``, ``train_step`` and control calls raise until its loop ends (or is left).

        Raises:
            RuntimeError: in training mode with gradients enabled.
            TypeError, ValueError: an input that is not a CPU tensor or tuple of them (names its position).
            StageError: a stage failed (names the stage, worker, input and micro-batch).
        """
        return streaming.stream(self, inputs, in_flight)

    def backward(self, context_id: int, loss: Tensor | Sequence[Tensor]) -> None:
        """``dist_autograd.backward(context_id, [loss])`` (``loss``: a tensor or a list of them), and what it
        does not do by itself:

        * failures that name the stage, worker and micro-batch, where distributed autograd's carry only
          text ("Error on Node 2: ...") or a bare "EOF" when a worker died;
        * refusals at once where it would wait (see Raises);
        * a captured model's tied parameters: every copy gets the sum of the copies' gradients;
        * replicas (``workers.torchrun_group(replicas=R)``): the gradients averaged over the replicas.

        Without tied parameters and replicas, a raw ``dist_autograd.backward(context_id, [loss])``
        computes the same gradients; with either, it leaves them apart, without an error. In a world of
        one process this is the raw call.

        Raises:
            StageError: a stage (or its recomputation) raised in backward; ``WorkerError`` for a dead
                worker.
            RuntimeError: at once, where distributed autograd would wait until the RPC timeout (or
                for ever) for sends of this context that no gradient reaches: a forward of any pipe of
                this process failed in it, a forward's output is not part of ``loss`` (with
                ``remote_output``: ``loss`` uses no fetched output at all), or a backward already ran
                in it (start a new context; run forwards you do not backpropagate under no_grad). With
                replicas, also inside :meth:`no_sync`, before anything runs (the context keeps its backward).
        """
        losses = [loss] if isinstance(loss, Tensor) else list(loss)
        if isinstance(self._driver, RemoteDriver):
            self._driver.backward(context_id, losses, average=self._averaging)
        else:
            dist_autograd.backward(context_id, losses)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over several :meth:`train_step` calls in one context and average them over
        the replicas once, as ``DistributedDataParallel.no_sync()`` does: inside, a step leaves its
        gradients in the context as this replica's own; the context's next ``train_step`` outside averages
        all of them with its own, in one all-reduce per worker instead of one per step::

            with dist_autograd.context() as ctx:
                with pipe.no_sync():
                    for x, y in batches[:-1]:
                        pipe.train_step(ctx, x, y, loss_fn)
                pipe.train_step(ctx, *batches[-1], loss_fn)  # averages the gradients of all of them
                opt.step(ctx)

        The weight of each replica is the rows of all its steps averaged together, so the result is that
        of averaging every step whenever the replicas' shares of each step keep the same proportions
        (equal shares, or a smaller last batch on every replica alike). A captured model's tied parameters
        are summed after that averaging. Nesting is allowed.

        Without replicas (a ``Pipe`` outside ``workers.torchrun_group(replicas=R)``) it changes nothing:
        steps in one context add up their gradients anyway.

        With replicas, as with DDP, every replica must run the same steps inside and outside, or the
        all-reduces pair up wrong and fail after ``collective_timeout``. A context whose last ``train_step``
        ran inside ends with gradients no step averaged: an optimizer step on them moves this replica
        apart from the others, with a warning only at this pipe's next step (DDP does not check).
        :meth:`backward` inside raises at once (before any backward): a context takes one backward and no
        ``train_step`` after it, so nothing could average its gradients; sum the losses of several
        forwards into one ``backward`` outside, which averages once, weighted by all their rows.
        """
        averaging, self._averaging = self._averaging, False
        try:
            yield
        finally:
            self._averaging = averaging

    def clip_grad_norm_(self, context_id: int, max_norm: float | Tensor, norm_type: float | str | Tensor = 2.0,
                        error_if_nonfinite: bool = False) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the stages' gradients in ``context_id``: call it after
        backward and before ``DistributedOptimizer.step(context_id)``, which reads the clipped ones.

        The norm is that of every stage's gradients taken together, and each stage scales its own on
        its worker (one round trip per stage for the norms, one more only when they are clipped).

        Returns:
            The total norm before clipping, a 0-dim tensor on the CPU, taken in float32 at least
            (float64 for float64 gradients); 0 where no stage has gradients in the context.

        Raises:
            TypeError, ValueError: ``max_norm`` not a number >= 0, ``norm_type`` not one > 0.
            RuntimeError: ``context_id`` is not a live context (its ``with`` block has ended), or
                ``error_if_nonfinite`` and the total norm is inf or nan.
            StageError: a stage failed.
        """
        max_norm = clip.as_number("max_norm", max_norm, positive=False)
        norm_type = clip.as_number("norm_type", norm_type, positive=True)
        if not _rpc.context_exists(context_id):
            raise RuntimeError(f"no dist_autograd context {context_id!r} in this process: call clip_grad_norm_ inside "
                               "the `with dist_autograd.context() as context_id:` block, after backward")
        total = clip.total_norm(self._driver.gradient_norms(context_id, norm_type), norm_type)
        factor = clip.clip_coefficient(total, max_norm, norm_type, error_if_nonfinite)
        if factor is not None:
            self._driver.scale_gradients(context_id, factor)
        return total

    def train(self, mode: bool = True) -> Pipe:
        super().train(mode)
        if isinstance(self._driver, RemoteDriver) and not self._driver.closed:  # (a parent's eval() after close)
            self._driver.set_training(mode)
        return self

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The layers' parameters in a world of one. Stages on workers keep theirs there: an optimizer
        built from an empty list trains nothing without a word, so iterating raises instead."""
        if isinstance(self._driver, RemoteDriver):
            raise TypeError("this Pipe's parameters live on its stage workers, so pipe.parameters() has none here: "
                            "train them with DistributedOptimizer(optimizer_class, pipe.parameter_rrefs(), ...) "
                            "and clip their gradients with pipe.clip_grad_norm_(context_id, max_norm)")
        return super().named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Tensor]]:
        """The layers' buffers in a world of one. Stages on workers keep theirs there: iterating raises, as
        for parameters, instead of finding none (``pipe.state_dict()`` has copies of them)."""
        self._refuse_remote_layers("buffers", "pipe.state_dict() has CPU copies of them")
        return super().named_buffers(*args, **kwargs)

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """The pipe and its layers in a world of one. Asked of a pipe whose stages are on workers
        (``pipe.modules()``), it raises instead of finding no layer, so that a loop over them (freezing
        BatchNorm, say) cannot do nothing without a word. A parent module walking its own modules passes
        over the remote layers, as it passes over their parameters."""
        if memo is None:
            self._refuse_remote_layers("layers", "pipe.stages lists them by stage; change them before wrapping, "
                                       "or in the factories of Pipe.from_factories")
        return super().named_modules(memo, prefix, remove_duplicate)

    def requires_grad_(self, requires_grad: bool = True) -> Pipe:
        """In a world of one, ``nn.Module.requires_grad_``. Stages on workers keep their parameters there."""
        if isinstance(self._driver, RemoteDriver):
            raise TypeError("this Pipe's parameters live on its stage workers, out of reach of requires_grad_: "
                            "freeze the layers before wrapping them (model.requires_grad_(False)), or run a pipe "
                            "you do not train under torch.no_grad()")
        return super().requires_grad_(requires_grad)

    def _refuse_remote_layers(self, what: str, instead: str) -> None:
        if isinstance(self._driver, RemoteDriver):
            raise TypeError(f"this Pipe's {what} live on its stage workers, so it has none here: {instead}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Stages on workers accumulate gradients in each ``dist_autograd`` context, never in
        ``.grad``: nothing to zero there. In a world of one, ``nn.Module.zero_grad``."""
        if isinstance(self._driver, LocalDriver):
            super().zero_grad(set_to_none)

    def parameter_rrefs(self) -> list[rpc.RRef]:
        """RRefs to every stage parameter, for ``torch.distributed.optim.DistributedOptimizer``."""
        if isinstance(self._driver, LocalDriver):
            return [rpc.RRef(p) for p in self.parameters()]
        return self._driver.parameter_rrefs()

    @property
    def stages(self) -> list[StageInfo]:
        """Which layers, worker and device each stage has."""
        return list(self._driver.infos)

    def traffic(self) -> list[dict[str, tuple[int, int]]]:
        """Per stage: ``{'activation': (tensors, bytes), 'skip': (tensors, bytes)}`` it has received.

        Counts are tensors, not messages. The first stage receives each step's whole input at once
        (it splits it into micro-batches itself); later stages receive each micro-batch's activation
        tensors, in one message per micro-batch (per ``microbatches_per_message`` of them)."""
        if isinstance(self._driver, LocalDriver):
            raise RuntimeError("traffic is counted on stage workers; this pipe runs in-process")
        return self._driver.traffic()

    def execution_record(self, clear: bool = False) -> list[Event]:
        """Every stage's forward/recompute/backward spans, oldest first (``clear`` empties the record)."""
        return sorted(self._driver.events(clear), key=lambda e: (e.start, e.stage))

    def timeline(self, path_prefix: str | Path, clear: bool = False) -> tuple[Path, Path]:
        """Write the execution record as ``PREFIX.json`` (Chrome/Perfetto trace) and ``PREFIX.png`` (one row per
        stage, needs matplotlib: ``pip install -e '.[plot]'`` in a checkout); returns both paths. See
        :mod:`rrefpipe.timeline`."""
        from .timeline import write_timeline

        return write_timeline(self.execution_record(clear), path_prefix)

    # -- state ---------------------------------------------------------------------------------------
    # Keys are the plain nn.Sequential's. In a world of one the layers are this module's children and
    # nn.Module does everything; stages on workers are saved and loaded through the two hooks below,
    # which nn.Module's state_dict/load_state_dict call here and in any module that contains this one.
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        if isinstance(self._driver, RemoteDriver):  # CPU copies of the workers' tensors
            if keep_vars:
                warn_user("state_dict(keep_vars=True) on a Pipe whose stages are on workers: the values are CPU "
                          "copies of the workers' tensors, not their Parameters")
            state = self._driver.state_dict()
            if self._captured is not None:
                state = self._captured.model_state(state)
            destination.update((prefix + key, value) for key, value in state.items())
        else:
            super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        if not isinstance(self._driver, RemoteDriver):
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
            return
        owners = [[layer.split(":")[0] for layer in info.layers] for info in self.stages]
        if self._captured is not None:  # the model's keys: each stage's part, tied copies included
            state_dict, missing_here, unexpected_here = self._captured.stage_state(state_dict, prefix)
            missing_keys.extend(missing_here)
            unexpected_keys.extend(unexpected_here)
            prefix = ""
        parts, metadata, unexpected_here = split_state_dict(state_dict, prefix, owners, local_metadata)
        unexpected_keys.extend(unexpected_here)
        for info, (missing, unexpected, error) in zip(self.stages, self._driver.load_state_dict(parts, metadata)):
            missing_keys.extend(prefix + key for key in missing)
            unexpected_keys.extend(prefix + key for key in unexpected)
            if error:
                error_msgs.append(f"stage {info.index} on worker {info.worker!r}: {error}")

    def snapshot(self, tag: Any = None) -> None:
        """Copy every stage's state (weights, buffers, ``pipe.optimizer`` states and their schedulers', random
        state) to a spare worker, for :meth:`recover` in a loop of your own (``train_stream`` takes its own
        every ``snapshot_every`` updates). Call it between steps; ``tag`` (a step number, say) is what
        ``recover()`` returns. Needs ``spares=``."""
        self._guarded_call("snapshot").snapshot(tag, required=True)

    def recover(self) -> Any:
        """After a step failed (a ``WorkerError`` from a dead stage worker, say), in a loop of your own: move
        the stages of dead workers to spares and put every stage back to the last :meth:`snapshot`; returns
        that snapshot's tag, the step to go on from (run your batches since then again, each in a new
        distributed autograd context). ``pipe.optimizer`` is restored with the stages; a
        ``DistributedOptimizer`` holds RRefs to the old parameters: build a new one over
        ``pipe.parameter_rrefs()`` (its state is not in the snapshot).

        Raises:
            RuntimeError: no snapshot was taken, or workers died and no spare is left to take their stages
                (nor the spare that holds the snapshots); the pipe is left as it was.
        """
        return self._guarded_call("recover").restore()

    def _guarded_call(self, what: str) -> recovery.Guard:
        if self._guard is None and getattr(self._driver, "peers", None) is not None:
            raise RuntimeError(f"pipe.{what}() is for a pipe that keeps snapshots: with replicas, spares take a lost "
                               "stage's state from a live replica when a step fails, and no snapshot is kept")
        if self._guard is None:
            raise RuntimeError(f"pipe.{what}() needs spare workers: build the pipe with spares=1 (or more)")
        return self._guard

    @property
    def recoveries(self) -> list[recovery.Recovery]:
        """The lost stage workers this pipe recovered from (``spares=``), oldest first: which worker, its
        stages, the spare that took them, the snapshot restored, the batches replayed and the time taken."""
        guard = getattr(self, "_guard", None)
        peers = getattr(getattr(self, "_driver", None), "peers", None)  # (spares with replicas)
        return list(guard.records) if guard is not None else list(peers.records) if peers is not None else []

    @property
    def snapshots(self) -> recovery.Snapshots | None:
        """What keeping this pipe recoverable holds and costs (``spares=``; ``None`` without, and with replicas,
        whose spares take a live replica's state and keep no snapshot): the holder, the bytes it keeps, and
        each snapshot's wait and transfer times."""
        guard = getattr(self, "_guard", None)
        return guard.stats() if guard is not None else None

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's state under its own keys, as CPU copies gathered from every stage into this process
        (``nn.Module.state_dict``'s arguments). Fine for models that fit one process; for larger ones use
        :meth:`save`, where each worker writes its own stages and this process holds none of them."""
        return super().state_dict(*args, **kwargs)

    def save(self, path: str | Path, *, optimizer: Any = None, lr_scheduler: Any = None,
             step: int | None = None) -> None:
        """Write a sharded checkpoint: every stage worker writes its stages' tensors (and their optimizer
        state) in parallel, in ``torch.distributed.checkpoint`` (DCP) format, under the model's
        ``state_dict()`` keys; the driver adds the metadata, the LR scheduler's state and ``step``. The
        driver never holds the model: use this rather than ``torch.save(pipe.state_dict())`` for models
        that do not fit one process.

        The checkpoint loads into a pipe of any balance, split, schedule or number of workers
        (:meth:`load`), into the plain model in one process (:func:`rrefpipe.load_model`, or DCP's
        ``dcp.load({"model": model.state_dict(), ...})``), and as ``Pipe(..., init=path)``. The format is
        in :mod:`rrefpipe.sharded`. With replicas, replica 0 writes; every replica's ``save`` returns once
        the checkpoint is whole.

        Args:
            path: a directory. The checkpoint is written beside it and put in its place once whole: an
                earlier checkpoint there is replaced then, and a save that fails leaves it as it was.
            optimizer: ``pipe.optimizer(...)``, or a ``DistributedOptimizer`` over ``pipe.parameter_rrefs()``
                built with an :mod:`rrefpipe.optim` class; its state is saved per parameter.
            lr_scheduler: a :class:`~rrefpipe.optim.RemoteLRScheduler` (its first stage's state is saved).
            step: an int saved with it, which :meth:`load` returns.
        """
        pipe_sharded.save(self, path, optimizer, lr_scheduler, step)

    def load(self, path: str | Path, *, optimizer: Any = None, lr_scheduler: Any = None) -> int | None:
        """Load a checkpoint of :meth:`save` (or :func:`rrefpipe.save_model`, or DCP's ``dcp.save`` of
        ``{"model": model.state_dict(), "optim": ...}``) into this pipe; each worker reads only its stages'
        tensors. Returns the step saved with it (None if none was).

        Raises:
            ValueError: the checkpoint does not fit this pipe: missing or unexpected keys, a shape or dtype
                that differs (named as ``load_state_dict`` names them), no optimizer state for a parameter or
                state of another optimizer class, no scheduler state; checked before anything is loaded.
        """
        return pipe_sharded.load(self, path, optimizer, lr_scheduler)

    # -- life cycle ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the stages from their workers; stop the workers rrefpipe started itself.

        A pipe garbage-collected without ``close()`` is closed by the next forward, pipe built or
        ``close()`` in this process."""
        if self._finalizer is not None:
            self._finalizer.detach()
        driver = getattr(self, "_driver", None)
        guard = getattr(self, "_guard", None)
        if guard is not None:
            guard.close()
        if driver is not None:
            if not getattr(driver, "streaming", False):  # (a stream's optimizers go with the next build)
                pipe_optimizer.close_all(self)  # first: freeing them takes control calls to the stages
            driver.close()
        self._stop_local_workers()
        placement.release(placement.close_abandoned())

    def _stop_local_workers(self) -> None:
        with _releasing:  # two threads closing one pipe release its share of the workers once
            workers, self._local_workers = self._local_workers, None
        if workers is not None:
            placement.worker_module("launch").release_embedded(workers)

    def __enter__(self) -> Pipe:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def __len__(self) -> int:
        """The number of layers, as PyTorch's Pipe counted them."""
        return sum(self.balance)

    def __iter__(self) -> Iterator[nn.Module]:
        """The layers in order, in a world of one, where they are this module's children. Stages on
        workers hold their layers there: ``pipe.stages`` says which worker has which."""
        if isinstance(self._driver, RemoteDriver):
            raise TypeError("this Pipe's layers live on its stage workers; pipe.stages lists them by stage")
        return iter(self._modules.values())  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> nn.Module:
        """The layer at ``index`` (negative counts from the end), as ``__iter__`` gives them."""
        return list(self)[index]

    @property
    def devices(self) -> list[torch.device]:
        """Each stage's device. The driver's own tensors stay on the CPU: pass CPU inputs."""
        return [torch.device(info.device) for info in self.stages]

    @property
    def partitions(self) -> nn.ModuleList:
        """Each stage's ``nn.Sequential`` in a world of one (PyTorch's name for them)."""
        if isinstance(self._driver, RemoteDriver):
            raise TypeError("this Pipe's stages live on its workers; pipe.stages describes them")
        return nn.ModuleList(stage.module for stage in self._driver.stages)

    # -- dtype and device ----------------------------------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> Pipe:
        """``pipe.to(dtype)`` converts every stage's floating-point parameters and buffers, and
        ``pipe.to(memory_format=torch.channels_last)`` their 4- and 5-D ones, as on one module (on workers: in
        place, so ``parameter_rrefs`` taken before still reach them). A device, or a tensor to take one
        from, is refused, as PyTorch's Pipe refused it: ``devices=`` places stages."""
        dtype = kwargs.pop("dtype", None)
        memory_format = kwargs.pop("memory_format", None)
        if args and isinstance(args[0], torch.dtype) and dtype is None:
            dtype, args = args[0], args[1:]
        if len(args) == 1 and isinstance(args[0], bool):  # to(dtype, non_blocking)
            kwargs["non_blocking"], args = args[0], ()
        if (dtype is None and memory_format is None) or args or set(kwargs) - {"non_blocking"}:
            self._refuse_to_move()
        if memory_format is not None and not isinstance(memory_format, torch.memory_format):
            raise TypeError(f"memory_format must be a torch.memory_format, got {memory_format!r}")
        if isinstance(self._driver, LocalDriver):
            kwargs.update(dtype=dtype, memory_format=memory_format)  # (memory_format is not in torch's stubs)
            return super().to(**kwargs)
        if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"Pipe.to only accepts floating point or complex dtypes, but got desired dtype={dtype}")
        self._driver.convert(dtype, memory_format)
        return self

    def half(self) -> Pipe:
        return self.to(torch.float16)

    def bfloat16(self) -> Pipe:
        return self.to(torch.bfloat16)

    def float(self) -> Pipe:
        return self.to(torch.float32)

    def double(self) -> Pipe:
        return self.to(torch.float64)

    def _refuse_to_move(self, *args: Any, **kwargs: Any) -> Pipe:
        raise TypeError("a Pipe places each stage on its device itself and cannot be moved: choose the devices "
                        "with Pipe(..., devices=[...]) or place the layers before wrapping them")

    cuda = cpu = _refuse_to_move

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Pipe:
        """What ``to``, ``share_memory`` or a parent module's conversion would do to the tensors; stages on
        workers are out of reach, and skipping them silently would leave them as they were."""
        if isinstance(self._driver, RemoteDriver):
            raise TypeError("this Pipe's stages live on their workers, out of reach of nn.Module's tensor "
                            "conversions: convert them with pipe.to(dtype) (or pipe.half(), pipe.double(), ...); a "
                            "device move is refused, devices=[...] places the stages")
        return super()._apply(fn, recurse)

    def apply(self, fn: Callable[[nn.Module], None]) -> Pipe:
        """``fn`` on every layer, in a world of one. Stages on workers are out of reach: initialise the
        layers before wrapping them, or in the factories of :meth:`from_factories`."""
        if isinstance(self._driver, RemoteDriver):
            raise TypeError("this Pipe's layers live on its stage workers, out of reach of pipe.apply(fn): apply fn "
                            "to the model before wrapping it, or build the stages with Pipe.from_factories")
        return super().apply(fn)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}, checkpoint={self.checkpoint!r}\n" + "\n".join(map(str, self.stages))


def _check_spares(spares: Any, snapshot_every: Any) -> tuple[int | list[str], int]:
    if isinstance(spares, bool) or not (isinstance(spares, int) and spares >= 0
                                        or isinstance(spares, (list, tuple)) and all(isinstance(s, str) for s in spares)):
        raise ValueError(f"spares must be a count of local spare workers or a list of worker names, got {spares!r}")
    if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 1:
        raise ValueError(f"snapshot_every must be a positive number of updates, got {snapshot_every!r}")
    return (spares if isinstance(spares, int) else list(spares)), snapshot_every
