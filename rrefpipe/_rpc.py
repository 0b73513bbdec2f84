"""The one thin wrapper around the private corners of ``torch.distributed.rpc`` that rrefpipe needs."""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api
from torch.distributed.rpc.internal import _internal_rpc_pickler

__all__: list[str] = []

#: Seconds an RPC may take. A dead peer fails at once ("eof"); only a hung one waits this long. The
#: driver's and the stage workers' default (``workers`` re-exports it).
DEFAULT_RPC_TIMEOUT = 120.0


def is_initialized() -> bool:
    """Whether this process has a current RPC agent (``init_rpc`` ran and no shutdown since)."""
    return rpc.is_available() and rpc_api._is_current_rpc_agent_set()


def current_agent() -> object | None:
    """This process's RPC agent, or None: the same object for as long as that group lasts, so a group
    started later (after ``rpc.shutdown()``) is told apart from it."""
    return rpc_api._get_current_rpc_agent() if is_initialized() else None


def wait(future: Any) -> Any:
    """``future.wait()`` that Ctrl-C interrupts: torch's own wait holds the thread in C++, where Python
    runs no signal handler until the call ends (the RPC timeout, for a worker that holds the call)."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    done.wait()
    return future.wait()


def pickle_rref_as(cls: type, rref_of: Callable[[Any], Any]) -> None:
    """Let instances of ``cls`` travel through RPC calls as the RRef ``rref_of(instance)``.

    torch's RPC pickler finds the reducer of an RRef by its exact type: an instance of a subclass (or
    a wrapper) would reach pickle's default, which refuses RRefs. Plain ``pickle`` still refuses them.
    These are torch internals: where a torch lacks them, ``cls`` stays usable everywhere but in RPC
    arguments (where its ``.rref``, or ``rpc.RRef(pipe_output)``, still goes), and importing rrefpipe works."""
    dispatch = getattr(_internal_rpc_pickler, "_dispatch_table", None)
    reducer = getattr(_internal_rpc_pickler, "_py_rref_reducer", None)
    if isinstance(dispatch, dict) and reducer is not None:
        dispatch[cls] = lambda obj: reducer(rref_of(obj))


def self_name() -> str:
    return rpc.get_worker_info().name


def worker_names() -> list[str]:
    """Names of every worker in the group, ordered by rank."""
    infos = rpc_api._get_current_rpc_agent().get_worker_infos()
    return [info.name for info in sorted(infos, key=lambda info: info.id)]


def current_context_id() -> int | None:
    """Id of the distributed-autograd context current on this thread, or None."""
    try:
        return int(dist_autograd._current_context()._context_id())
    except RuntimeError:
        return None


def context_exists(context_id: int) -> bool:
    """Whether this process holds the distributed-autograd context ``context_id`` (it is released at
    the end of its ``with dist_autograd.context()``)."""
    try:
        dist_autograd._retrieve_context(context_id)
    except RuntimeError:
        return False
    return True


def send_functions(context_id: int) -> list[Any]:
    """The autograd nodes of this process's sends in context ``context_id`` (none if it has no such
    context): roots of its backward besides the losses, as distributed autograd counts them."""
    try:
        return list(dist_autograd._retrieve_context(context_id)._send_functions().values())
    except RuntimeError:
        return []


def received(context_id: int) -> list[Any]:
    """The autograd nodes of every tensor message this process received in context ``context_id`` (none
    if it has no such context)."""
    try:
        return list(dist_autograd._retrieve_context(context_id)._recv_functions().values())
    except RuntimeError:
        return []


def received_from(context_id: int, worker: str) -> list[Any]:
    """The autograd nodes of what this process received from ``worker`` in context ``context_id``
    (none if it has no such context): a message's id carries its sender's worker id in its top 16 bits."""
    sender = rpc.get_worker_info(worker).id
    try:
        received = dist_autograd._retrieve_context(context_id)._recv_functions()
    except RuntimeError:
        return []
    return [node for message_id, node in received.items() if message_id >> 48 == sender]


def release_if_only_received(context_id: int) -> None:
    """Release this process's distributed-autograd context ``context_id`` if it holds no send node:
    nothing was sent from here in it, so an incoming message created it, not a ``dist_autograd.context()``
    here."""
    if not dist_autograd._retrieve_context(context_id)._send_functions():
        dist_autograd._release_context(context_id)


_retained: dict[int, Any] = {}  # context id -> the context object, kept past its release
_RETAIN_MARGIN = 5.0  # seconds past the RPC timeout
_retained_lock = threading.Lock()


def retain_context(context_id: int) -> None:
    """Keep this process's distributed-autograd context ``context_id`` alive past its release (by the
    driver's ``with`` block, or on a worker by the clean-up that follows) for the RPC timeout and a
    margin, counted from now: call it when a backward in the context has failed.

    A backward that fails returns while gradient RPCs of its context are still in flight (another
    pipe's, the other micro-batches'), and torch's callback for each one keeps a bare pointer to the
    context (``DistAutogradContext::addOutstandingRpc``): an RPC that failed after the release (its
    peer had already dropped the context) locked freed memory. That aborted the process (glibc's
    ``e != ESRCH || !robust``), or failed the next, healthy backward, whose context had taken the
    memory. Every such RPC ends within the RPC timeout (with none set, the context stays for good),
    unless a stage's backward goes on for longer than that after the failure and sends then. The
    context keeps its gradients and graph meanwhile. A context this process no longer has is left alone.
    """
    try:
        context = dist_autograd._retrieve_context(context_id)
    except RuntimeError:
        return
    with _retained_lock:
        _retained[context_id] = context
    timeout = rpc.get_rpc_timeout()
    if timeout > 0:
        timer = threading.Timer(timeout + _RETAIN_MARGIN, _forget_context, args=(context_id, context))
        timer.daemon = True
        timer.start()


def _forget_context(context_id: int, context: Any) -> None:
    with _retained_lock:
        if _retained.get(context_id) is context:
            del _retained[context_id]


def in_graceful_shutdown() -> bool:
    """Whether this process waits in a graceful ``rpc.shutdown()``: torch's ``_all_gather`` of every
    worker's name, which returns only once each member of the group has called it too. This process has
    given its own name to the gather (as leader), or is waiting for the leader's answer (as follower).
    The gather that ``init_rpc`` runs is over by the time anyone asks."""
    me = self_name()
    with rpc_api._all_gather_dict_lock:
        states = list(rpc_api._all_gather_sequence_id_to_states.values())
    return any(not state.proceed_signal.is_set() and (me in state.gathered_objects or not state.gathered_objects)
               for state in states)


def prepare_reinit() -> None:
    """Reset the module-global counters ``init_rpc`` keys its rendezvous by.

    ``init_rpc`` prefixes the store with a per-process counter and ``_all_gather`` numbers its rounds
    per worker-name set; after a shutdown a re-initialising driver would disagree with freshly started
    workers (whose counters are 0) and hang. Each local group uses a fresh store, so zero is right.
    """
    with rpc._init_counter_lock:
        rpc._init_counter = 0
    with rpc_api._all_gather_dict_lock:
        rpc_api._all_gather_sequence_id.clear()
