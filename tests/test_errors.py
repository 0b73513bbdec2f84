"""What a failure is called: TensorPipe's connection errors against a layer's own words, and stage errors
that survive pickling (process pools, pytest-xdist) with their class and fields."""
import copy
import pickle

import pytest

from rrefpipe.errors import Failure, StageError, WorkerError, is_transport_error, lost_connection, timed_out

#: As torch 2.13's TensorPipe agent words them (seen in this suite's fault tests).
TENSORPIPE = [
    "EOF: end of file (this error originated at tensorpipe/transport/uv/connection_impl.cc:132)",
    "EPIPE: broken pipe (this error originated at tensorpipe/transport/uv/connection_impl.cc:157)",
    "pipe closed (this error originated at tensorpipe/core/pipe_impl.cc:356)",
    "ECONNREFUSED: connection refused",
    "Error on Node 0: EOF: end of file (this error originated at tensorpipe/transport/uv/connection_impl.cc:132)",
]
TIMEOUT = "RPCErr:1:RPC ran for more than set timeout (2000 ms) and will now be marked with an error"
#: A layer's or a factory's own messages: whatever they say, the worker answered.
OWN_WORDS = [
    "timeout: the file was closed",
    "gradient of the wrong shape",
    "python_error",
    "ERROR: gradient check failed",  # capitals and a colon, as errno names have
    "EXPECTED: a positive scale",
    "ValueError: On WorkerInfo(id=2, name=worker2):\nValueError('I/O operation on closed file')\nTraceback ...",
    "RuntimeError: On WorkerInfo(id=1, name=worker1):\nRuntimeError('EOF: end of file (this error originated at "
    "tensorpipe/transport/uv/connection_impl.cc:132)')",  # the remote function's own failed call, re-raised
]


@pytest.mark.parametrize("text", TENSORPIPE)
def test_tensorpipe_connection_errors_are_lost_connections(text):
    assert is_transport_error(text) and lost_connection(text) and not timed_out(text)


def test_the_rpc_timeout_is_a_transport_error_but_not_a_lost_connection():
    assert is_transport_error(TIMEOUT) and timed_out(TIMEOUT) and not lost_connection(TIMEOUT)


@pytest.mark.parametrize("text", OWN_WORDS)
def test_an_exceptions_own_words_are_never_a_transport_error(text):
    assert not is_transport_error(text) and not timed_out(text)


def test_a_captured_layer_error_keeps_its_type_whatever_its_words():
    failure = Failure.capture(ValueError("the file was closed"), stage=1, worker="worker2", microbatch=0,
                              phase="forward", transport=True)
    assert failure.error_type == "ValueError"


@pytest.mark.parametrize("failure", [
    Failure(1, "worker2", 3, "forward", "ValueError", "bad width", "Traceback (most recent call last): ..."),
    Failure(0, "worker1", None, "create_stage", "KeyError", "'w'", ""),
    Failure(0, "worker1", None, "forward", "WorkerError", "the worker is unreachable (EOF)", "", transport=True),
], ids=["mirrored", "plain", "worker"])
@pytest.mark.parametrize("copier", [lambda e: pickle.loads(pickle.dumps(e)), copy.deepcopy, copy.copy],
                         ids=["pickle", "deepcopy", "copy"])
def test_stage_errors_survive_pickling_and_copies(failure, copier):
    error = failure.to_exception()
    again = copier(error)
    assert type(again) is type(error)
    assert str(again) == str(error)
    fields = ("stage", "worker", "microbatch", "phase", "error_type", "error_message", "remote_traceback")
    assert [getattr(again, f) for f in fields] == [getattr(error, f) for f in fields]
    assert getattr(again, "__notes__", None) == getattr(error, "__notes__", None)
    assert isinstance(again, (StageError, WorkerError))
