"""Streams that fail or stop early: a layer raising mid-stream, an iterable that raises or gives a bad
item, a loop left with ``break``, and a stream that is not finished. Each ends with a named error or a
clean stop, no thread left on the workers, and a pipe that works afterwards; what was fed before the
stop is finished and applied (the weights equal the rule's simulation over exactly those batches)."""
from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR

from rrefpipe import Pipe, StageError
from rrefpipe.optim import RemoteLRScheduler
from rrefpipe.driver_side.streaming import default_in_flight
from tests.distributed.probes import stream_threads
from tests.distributed.test_streams import batches, rule, simulate, stage_names
from tests.layers import SENTINEL, BoomOnHuge, RaiseInBackwardOn, twin

pytestmark = pytest.mark.timeout(120)


def model() -> nn.Sequential:
    torch.manual_seed(8)
    return nn.Sequential(RaiseInBackwardOn(BACKWARD_FAIL), nn.Linear(5, 8), nn.Linear(8, 8), BoomOnHuge(), nn.Tanh(),
                         nn.Linear(8, 3))


BACKWARD_FAIL = 123.25  # in a micro-batch's input: its backward on stage 0 raises
BALANCE = [2, 4]  # the forward's check on stage 1


@pytest.fixture(scope="module")
def pipe(cluster) -> Iterator[Pipe]:
    with Pipe(model(), chunks=2, balance=BALANCE, workers=cluster.names[:2], schedule="PipeDream-2BW") as p:
        yield p


def fresh(pipe: Pipe):
    """The pipe back at the model's initial weights, with a new optimizer."""
    pipe.load_state_dict(model().state_dict())
    return pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)


def assert_weights_after(pipe: Pipe, fed: list, optimizer=None) -> None:
    """The pipe's weights (and the optimizer's momentum, if given) are the rule's after exactly the
    batches ``fed``."""
    plain = model()
    forward, _ = rule("PipeDream-2BW", 2, 2)
    names = stage_names(plain, BALANCE)
    optimizers: list = []
    _, expected = simulate(plain, names, fed, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 2, forward,
                           optimizers_out=optimizers)
    state = pipe.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, msg=lambda m, name=name: f"{name}: {m}")
    if optimizer is not None:
        saved = optimizer.state_dict()["state"]
        for stage, opt in zip(names, optimizers):
            for name, p in zip(stage, opt.param_groups[0]["params"]):
                torch.testing.assert_close(saved[name]["momentum_buffer"], opt.state[p]["momentum_buffer"],
                                           msg=lambda m, name=name: f"momentum of {name}: {m}")


def assert_no_stream_threads(pipe: Pipe) -> None:
    for worker in dict.fromkeys(info.worker for info in pipe.stages):
        assert rpc.rpc_sync(worker, stream_threads, timeout=10) == [], worker


def test_a_layer_raising_mid_stream_names_stage_worker_batch_and_micro_batch(pipe):
    optimizer = fresh(pipe)
    data = batches(6, 4, seed=1)
    data[3][0][3] = SENTINEL  # batch 3, row 3: micro-batch 1 of 2
    seen = []
    with pytest.raises(StageError) as info:
        for loss in pipe.train_stream(data, F.cross_entropy, optimizer):
            seen.append(loss)
    error = info.value
    assert (error.stage, error.worker, error.microbatch) == (1, pipe.stages[1].worker, 1)
    assert "batch 3" in str(error) and "boom: sentinel" in str(error)
    assert len(seen) <= 3
    assert_no_stream_threads(pipe)
    # every stage was rolled back to the last update all had applied, and the note says which
    note = error.__notes__[-1]
    applied = int(re.search(r"after (\d+) update", note).group(1))
    assert 0 < applied <= 3, note
    assert_weights_after(pipe, data[:applied], optimizer)
    optimizer = fresh(pipe)  # usable afterwards: a clean stream follows the rule from the start
    clean = batches(3, 4, seed=2)
    assert len(list(pipe.train_stream(clean, F.cross_entropy, optimizer))) == 3
    assert_weights_after(pipe, clean)


def test_the_rollback_takes_back_the_update_only_the_last_stage_applied(pipe):
    """Stage 0's backward of batch 3's last micro-batch raises after stage 1 sent it that gradient and,
    with no wait in between, applied batch 3: stage 1 holds one update more, and is rolled back to 3,
    its LR schedule too. Two schedules are built on the optimizer and the second passed: each stage steps
    that one only (gamma 1: the learning rate, and so the rule's weights, stay as they are)."""
    optimizer = fresh(pipe)
    other = RemoteLRScheduler(optimizer, StepLR, step_size=1, gamma=1.0)
    scheduler = RemoteLRScheduler(optimizer, StepLR, step_size=1, gamma=1.0)
    data = batches(6, 4, seed=11)
    data[3][0][3] = BACKWARD_FAIL  # batch 3, micro-batch 1 of 2
    with pytest.raises(StageError, match="backward of a micro-batch holding") as info:
        list(pipe.train_stream(data, F.cross_entropy, optimizer, lr_scheduler=scheduler))
    assert (info.value.stage, info.value.microbatch) == (0, 1) and "batch 3" in info.value.phase
    assert "after 3 update(s)" in info.value.__notes__[-1], info.value.__notes__
    assert_weights_after(pipe, data[:3], optimizer)
    assert [state["last_epoch"] for state in scheduler.state_dict()] == [3, 3]
    assert [state["last_epoch"] for state in other.state_dict()] == [0, 0]
    assert_no_stream_threads(pipe)


def test_an_iterable_that_raises_finishes_what_was_fed_then_raises(pipe):
    optimizer = fresh(pipe)
    data = batches(5, 4, seed=3)

    def source():
        yield from data[:4]
        raise KeyError("the data loader broke")

    losses = []
    with pytest.raises(KeyError, match="the data loader broke"):
        for loss in pipe.train_stream(source(), F.cross_entropy, optimizer):
            losses.append(loss)
    assert_weights_after(pipe, data[:4])
    assert_no_stream_threads(pipe)


def test_a_bad_item_is_named_with_its_position(pipe):
    optimizer = fresh(pipe)
    data = batches(4, 4, seed=4)
    bad = data[:2] + [(data[2][0], data[2][1][:3])] + data[3:]  # a target one row short
    with pytest.raises(ValueError, match="item 2 of the stream.*3 rows and the input 4"):
        list(pipe.train_stream(bad, F.cross_entropy, optimizer))
    assert_weights_after(pipe, data[:2])  # the two before it were finished and applied
    with pytest.raises(TypeError, match="item 0 of the stream: expected a pair"):
        list(pipe.train_stream([data[0][0]], F.cross_entropy, optimizer))


def test_leaving_the_loop_applies_every_batch_fed(pipe):
    optimizer = fresh(pipe)
    data = batches(8, 4, seed=5)
    stream = pipe.train_stream(data, F.cross_entropy, optimizer)
    for t, _ in enumerate(stream):
        if t == 1:
            break
    stream.close()
    fed = 2 + default_in_flight(2, 2) - 1  # fed ahead of loss 1 when it was yielded
    assert_weights_after(pipe, data[:fed])
    assert_no_stream_threads(pipe)


def test_a_running_stream_owns_the_pipe(pipe):
    optimizer = fresh(pipe)
    stream = pipe.train_stream(batches(3, 4, seed=6), F.cross_entropy, optimizer)
    next(stream)
    with pytest.raises(RuntimeError, match="a stream of this Pipe is running"):
        pipe(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="a stream of this Pipe is running"):
        pipe.state_dict()
    stream.close()
    with torch.no_grad():
        assert pipe(torch.randn(2, 5)).local_value().shape == (2, 3)


def test_a_forward_stream_names_the_failing_input_and_recovers(pipe):
    inputs = [x for x, _ in batches(5, 4, seed=7)]
    inputs[2][1] = SENTINEL
    pipe.eval()
    try:
        with torch.no_grad():
            out = []
            with pytest.raises(StageError, match="batch 2") as info:
                for y in pipe.stream(inputs):
                    out.append(y)
            assert info.value.stage == 1 and info.value.microbatch == 0
            assert len(out) <= 2
            with pytest.raises(TypeError, match="item 1 of the stream"):
                list(pipe.stream([inputs[0], "not a tensor"]))
            plain = twin(model())
            plain.load_state_dict(pipe.state_dict())
            clean = [x for x, _ in batches(3, 4, seed=8)]
            for y, x in zip(pipe.stream(clean), clean):
                torch.testing.assert_close(y, plain.eval()(x))
            outputs = pipe.stream(x for x, _ in batches(50, 4, seed=10))
            for t, _ in enumerate(outputs):  # leaving a forward stream early: it ends, the pipe is free
                if t == 1:
                    break
            outputs.close()
            torch.testing.assert_close(pipe(clean[0]).local_value(), plain(clean[0]))
    finally:
        pipe.train()
    assert_no_stream_threads(pipe)


def test_without_rollback_each_stage_stays_where_it_was_and_the_note_says_so(pipe):
    optimizer = fresh(pipe)
    data = batches(6, 4, seed=9)
    data[4][0][0] = SENTINEL
    with pytest.raises(StageError, match="batch 4") as info:
        list(pipe.train_stream(data, F.cross_entropy, optimizer, rollback=False))
    note = info.value.__notes__[-1]
    assert "not rolled back (rollback=False)" in note, note
    counts = {int(j): int(u) for j, u in re.findall(r"(\d+): (\d+)", note)}
    assert sorted(counts) == [0, 1] and all(3 <= u <= 4 for u in counts.values()), note
    state, plain = pipe.state_dict(), model()
    names = stage_names(plain, BALANCE)
    for j, u in counts.items():  # stage j holds the rule's weights after its own u updates
        _, expected = simulate(model(), names, data[:u], lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 2,
                               rule("PipeDream-2BW", 2, 2)[0])
        for name in names[j]:
            torch.testing.assert_close(state[name], expected[name], msg=lambda m, name=name: f"{name}: {m}")
