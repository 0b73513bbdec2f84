"""Code written for torch.distributed.pipeline.sync runs with an import change; documented errors hold."""
import pytest
import torch
from torch import nn


def test_public_module_paths():
    from rrefpipe import Pipe  # noqa: F401
    from rrefpipe.batchnorm import DeferredBatchNorm  # noqa: F401
    from rrefpipe.skip import Namespace, pop, skippable, stash, verify_skippables  # noqa: F401
    from rrefpipe.skip.skippable import pop as pop2, skippable as skippable2, stash as stash2  # noqa: F401
    from rrefpipe.skip.skippable import verify_skippables as verify2

    assert verify2 is verify_skippables and skippable2 is skippable


@pytest.mark.parametrize("module, kwargs, error, message", [
    (nn.Linear(2, 2), {}, TypeError, "Pipe expects an nn.Sequential module, got Linear"),
    (nn.Sequential(nn.Linear(2, 2)), {"chunks": 0}, ValueError, "chunks must be a positive int, got 0"),
    # torchgpipe's GPipe(module, balance, chunks): the balance lands in chunks here
    (nn.Sequential(nn.Linear(2, 2)), {"chunks": [1]}, ValueError,
     r"got \[1\] \(layers per stage go by keyword: Pipe\(module, chunks=\.\.\., balance=\[1\]\)\)"),
    (nn.Sequential(nn.Linear(2, 2)), {"checkpoint": "x"}, ValueError, "checkpoint must be one of"),
    # PyTorch 2.3's wordings, which its tests match
    (nn.Module(), {}, TypeError, "module must be nn.Sequential to be partitioned"),
    (nn.Sequential(nn.Linear(2, 2)), {"checkpoint": "INVALID_CHECKPOINT"}, ValueError,
     "checkpoint is not one of 'always', 'except_last', or 'never'"),
    (nn.Sequential(nn.Linear(2, 2)), {"chunks": -1}, ValueError, "number of chunks must be positive integer"),
    (nn.Sequential(nn.Linear(2, 2)), {"chunks": 2.5}, ValueError, "number of chunks must be positive integer"),
    (nn.Sequential(nn.Linear(2, 2)), {"chunks": True}, ValueError, "chunks must be a positive int, got True"),
    (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta")), {"balance": [2]}, ValueError,
     r"should have all parameters on a single device, please use \.to\(\) to place the module on a single device"),
    (nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta")), {"balance": [2]}, ValueError,
     "stage 0 has parameters on several devices"),
])
def test_documented_errors_before_any_worker_starts(module, kwargs, error, message):
    from rrefpipe import Pipe

    with pytest.raises(error, match=message):
        Pipe(module, **kwargs)


def test_duplicate_children_message():
    from rrefpipe import Pipe

    layer = nn.Linear(2, 2)
    model = nn.Sequential()
    model._modules["a"] = layer
    model._modules["b"] = layer
    with pytest.raises(ValueError, match="duplicate children is not supported: layers 'a' and 'b'"):
        Pipe(model)


def test_non_sequential_message_says_what_to_do():
    from rrefpipe import Pipe

    with pytest.raises(TypeError) as error:
        Pipe(nn.Linear(2, 2))
    message = str(error.value)
    assert "Pipe expects an nn.Sequential module, got Linear" in message
    assert "module must be nn.Sequential to be partitioned" in message
    assert "Pipe(nn.Sequential(a, b, c))" in message and "Pipe(nn.Sequential(*model.children()))" in message


class MyString:  # PyTorch's test_public_attrs: Pipe took str(checkpoint)
    def __init__(self, value):
        self.value = value

    def __str__(self):
        return self.value


class Mode(str):
    pass


@pytest.mark.parametrize("chunks", [42.0, 42, torch.tensor(3).item()])
def test_int_like_chunks_and_str_like_checkpoint(chunks):
    from rrefpipe.partition import check_checkpoint, check_chunks

    assert check_chunks(chunks) == int(chunks) and type(check_chunks(chunks)) is int
    for mode in (MyString("always"), Mode("never"), "except_last"):
        checked = check_checkpoint(mode)
        assert checked == str(mode) and type(checked) is str


def test_verify_skippables_wordings_of_pytorch_2_3():
    """PyTorch 2.3's test_verify_skippables cases: each message keeps rrefpipe's and includes PyTorch's."""
    from rrefpipe.skip import Namespace, skippable, verify_skippables

    @skippable(stash=["foo"])
    class Stash(nn.Module):
        pass

    @skippable(pop=["foo"])
    class Pop(nn.Module):
        pass

    @skippable(stash=["foo"], pop=["foo"])
    class Both(nn.Module):
        pass

    cases = [
        ([Stash()], ["'foo' is stashed by layer '0' but never popped",
                     "no module declared 'foo' as poppable but stashed"]),
        ([Pop()], ["'foo' is popped by layer '0' but never stashed",
                   "'0' declared 'foo' as poppable but it was not stashed"]),
        ([Pop(), Stash()], ["'0' declared 'foo' as poppable but it was not stashed"]),
        ([Stash(), Stash(), Pop()], ["is stashed by 2 layers", "'1' redeclared 'foo' as stashable"]),
        ([Stash(), Pop(), Pop()], ["is popped by 2 layers", "'2' redeclared 'foo' as poppable"]),
        ([Stash(), Pop(), Stash(), Pop()], ["'2' redeclared 'foo' as stashable", "'3' redeclared 'foo' as poppable"]),
        ([Both()], ["'0' declared 'foo' both as stashable and as poppable"]),
    ]
    for layers, wordings in cases:
        with pytest.raises(TypeError) as error:
            verify_skippables(nn.Sequential(*layers))
        for wording in wordings:
            assert wording in str(error.value), (layers, str(error.value))
    ns1, ns2 = Namespace(), Namespace()
    verify_skippables(nn.Sequential(Stash().isolate(ns1), Pop().isolate(ns1), Stash().isolate(ns2), Pop().isolate(ns2)))


def test_skip_tracker_api_of_pytorch():
    """PyTorch's test_tracker/test_stash_pop: SkipTracker is instantiable, each thread starts with one,
    use_skip_tracker installs one, and a pop of what was never stashed is a RuntimeError."""
    import threading

    from rrefpipe.skip import pop, skippable, stash
    from rrefpipe.skip.tracker import SkipTracker, current_skip_tracker, use_skip_tracker

    seen = []
    thread = threading.Thread(target=lambda: seen.append(current_skip_tracker()))
    thread.start()
    thread.join()
    assert type(seen[0]) is SkipTracker

    @skippable(stash=["foo"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("foo", x)
            return x * 2

    @skippable(pop=["foo"])
    class Pop(nn.Module):
        def forward(self, x):
            foo = yield pop("foo")
            return foo

    tracker = SkipTracker()
    with use_skip_tracker(tracker):
        assert current_skip_tracker() is tracker
        Stash()(torch.tensor(42.0))
        assert len(tracker.tensors) == 1
        assert Pop()(torch.tensor(0.0)).item() == 42.0
        assert len(tracker.tensors) == 0
        with pytest.raises(RuntimeError, match="popped before it was stashed"):
            Pop()(torch.tensor(0.0))


def test_skippable_repr_and_signature():
    import inspect

    from rrefpipe.skip import skippable, stash

    @skippable(stash=["hello"])
    class Hello(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x, mask):
            yield stash("hello", x)
            return self.conv(x)

    assert repr(Hello()) == "@skippable(Hello(\n  (conv): Conv2d(1, 1, kernel_size=(1, 1), stride=(1, 1))\n))"
    assert list(inspect.signature(Hello().forward).parameters) == ["x", "mask"]


def test_convert_deferred_batch_norm_returns_a_converted_module_itself():
    from rrefpipe.batchnorm import DeferredBatchNorm

    bn = DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm2d(3), chunks=2)
    assert isinstance(bn, DeferredBatchNorm)
    assert DeferredBatchNorm.convert_deferred_batch_norm(bn, chunks=2) is bn
    model = DeferredBatchNorm.convert_deferred_batch_norm(nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)), 2)
    converted = model[1]
    assert DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=2) is model and model[1] is converted


def test_convert_deferred_batch_norm_for_other_chunks_returns_a_new_module_sharing_the_state():
    """PyTorch 2.3 converts a DeferredBatchNorm built for another number of chunks again."""
    from rrefpipe.batchnorm import DeferredBatchNorm

    dbn = DeferredBatchNorm(3, chunks=2)
    again = DeferredBatchNorm.convert_deferred_batch_norm(dbn, chunks=3)
    assert again is not dbn and isinstance(again, DeferredBatchNorm)
    assert (again.chunks, dbn.chunks) == (3, 2)
    assert again.weight is dbn.weight and again.running_mean is dbn.running_mean
    untracked = nn.BatchNorm2d(3, track_running_stats=False)
    assert DeferredBatchNorm.convert_deferred_batch_norm(untracked, chunks=3) is untracked


@pytest.mark.parametrize("sequence, partitions, blocks", [
    ([1, 2, 3, 4, 5, 6], 2, [[1, 2, 3, 4], [5, 6]]),  # PyTorch's test_blockpartition
    ([0, 0], 2, [[0], [0]]),
    ([5], 1, [[5]]),
    ([3, 1, 1, 1], 2, [[3], [1, 1, 1]]),
    ([1, 1, 1, 1, 1, 1], 3, [[1, 1], [1, 1], [1, 1]]),
    ([9, 1, 1, 1, 1, 9], 3, [[9], [1, 1, 1, 1], [9]]),
])
def test_blockpartition_solve(sequence, partitions, blocks):
    from rrefpipe.balance import blockpartition

    assert blockpartition.solve(sequence, partitions=partitions) == blocks


def test_blockpartition_properties_and_errors():
    import itertools
    import random

    from rrefpipe.balance import blockpartition

    rng = random.Random(0)
    for _ in range(50):
        sequence = [rng.randint(0, 9) for _ in range(rng.randint(1, 8))]
        k = rng.randint(1, len(sequence))
        blocks = blockpartition.solve(sequence, k)
        assert len(blocks) == k and all(blocks) and [x for b in blocks for x in b] == sequence
        best = min(max(sum(sequence[i:j]) for i, j in zip((0, *cuts), (*cuts, len(sequence))))
                   for cuts in itertools.combinations(range(1, len(sequence)), k - 1))
        assert max(sum(b) for b in blocks) == best  # the optimum, by brute force
    for partitions in (0, -1):
        with pytest.raises(ValueError, match="partitions must be a positive integer"):
            blockpartition.solve([42], partitions=partitions)
    with pytest.raises(ValueError, match=r"sequence is shorter than intended partitions \(0 < 1\)"):
        blockpartition.solve([], partitions=1)
    with pytest.raises(ValueError, match=r"sequence is shorter than intended partitions \(1 < 2\)"):
        blockpartition.solve([42], partitions=2)


class Twin(nn.Module):
    def forward(self, x):
        return x, x.detach()


class AddPair(nn.Module):
    def forward(self, a, b):
        return a + b


def test_balancing_profiles_layers_that_take_and_return_tuples():
    """PyTorch's test_balance_by_time_tuple and ..._size_tuple (the latter on the CPU here): a pair out of
    Twin reaches AddPair, which requires two arguments, spread; and with spread=True (a pipe called with
    several inputs) the sample's tensors reach the first layer spread."""
    from rrefpipe.balance import balance_by_size, balance_by_time

    model = nn.Sequential(Twin(), AddPair(), nn.Linear(1, 1))
    sample = torch.rand(4, 1, requires_grad=True)
    assert balance_by_time(2, model, sample, device="cpu", timeout=0.01) in ([1, 2], [2, 1])
    assert sum(balance_by_size(3, model, sample)) == 3
    pair_first = nn.Sequential(AddPair(), Twin(), AddPair())
    assert balance_by_time(1, pair_first, (sample, sample), timeout=0.01, spread=True) == [3]
    assert balance_by_size(3, pair_first, (sample, sample), spread=True) == [1, 1, 1]


def test_balancing_already_has_gradient_wording():
    from rrefpipe.balance import balance_by_time

    model = nn.Sequential(nn.Conv2d(3, 3, 1))
    sample = torch.rand(1, 3, 4, 4)
    model(sample).norm().backward()
    with pytest.raises(ValueError, match="some parameter already has gradient"):
        balance_by_time(1, model, sample, device="cpu")


class Optional(nn.Module):
    def forward(self, x, y=None):
        return x


class Star(nn.Module):
    def forward(self, *xs):
        return xs


def test_call_rule():
    """How a value reaches a layer (rrefpipe.calling): a tuple is spread for a 2.x call (several inputs),
    or where the layer requires two or more arguments; else it goes whole, as does anything not a tuple."""
    from rrefpipe.calling import call_layer, needs_spread, run_layers

    a, b = torch.ones(2), torch.zeros(2)
    assert needs_spread(AddPair()) and needs_spread(nn.Bilinear(2, 2, 2))
    assert not any(needs_spread(m) for m in (nn.Linear(2, 2), Optional(), Star(), Twin(), nn.Sequential()))
    layer = nn.Linear(2, 2)
    layer.forward = lambda x, y: x + y  # an instance's own forward is read too
    assert needs_spread(layer)
    assert call_layer(AddPair(), (a, b), spread=False).tolist() == [1.0, 1.0]  # requires two: spread
    assert call_layer(Optional(), (a, b), spread=False) == (a, b)  # can take one: whole (1.8)
    assert call_layer(Optional(), (a, b), spread=True) is a  # 2.x: spread
    assert call_layer(Star(), (a, b), spread=True) == (a, b) and call_layer(Star(), (a, b), spread=False) == ((a, b),)
    assert call_layer(Star(), [a, b], spread=True) == ([a, b],)  # a list goes whole, as in 2.x
    assert call_layer(Optional(), a, spread=True) is a
    # 2.x flattens a nested nn.Sequential into the partition: its layers get spread pairs too
    nested = nn.Sequential(Twin(), nn.Sequential(Optional(), Star()))
    assert run_layers(nested, a, spread=True)[0] is a  # Optional(a, a'), then Star(a)
    whole = run_layers(nested, a, spread=False)[0]  # Optional((a, a')), then Star((a, a'))
    assert isinstance(whole, tuple) and whole[0] is a


class MySequential(nn.Sequential):
    pass


def test_call_rule_reads_through_wrappers_and_flattens_sequential_subclasses():
    """A torch.compile'd or checkpoint_wrapper'd layer's forward takes ``*args``: the rule reads the layer it
    wraps. In 2.x style a nested nn.Sequential subclass is flattened too, as 2.x did (isinstance)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from rrefpipe.calling import needs_spread, run_layers

    assert needs_spread(checkpoint_wrapper(AddPair())) and needs_spread(torch.compile(AddPair()))
    assert not needs_spread(checkpoint_wrapper(nn.Linear(2, 2))) and not needs_spread(torch.compile(Optional()))
    a = torch.ones(2)
    assert run_layers(nn.Sequential(Twin(), MySequential(Optional(), Star())), a, spread=True)[0] is a


def test_call_style_is_checked():
    from rrefpipe import Pipe

    for wrong in ("2", "1.8", None):
        with pytest.raises(ValueError, match=r"call_style must be 'auto' .* or '2.x'"):
            Pipe(nn.Sequential(nn.Linear(2, 2)), call_style=wrong)


def test_world_of_one_runs_both_styles_and_says_it_runs_in_process():
    """init_rpc with world size 1: stages run in the driver's process, for either call style, with outputs
    and gradients as the plain model's; one InProcessWarning says so, however many pipes are built."""
    from tests.conftest import run_script

    proc = run_script("""
        import os, warnings
        import torch
        import torch.distributed.rpc as rpc
        from rrefpipe import InProcessWarning, Pipe
        from tests.compat_models import loss_of, model_18, model_2x, reference

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
        rpc.init_rpc("solo", rank=0, world_size=1)
        inputs = (torch.randn(6, 4), torch.rand(6, 4))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for style, model, balance in (("2x", model_2x(), [2, 2, 2]), ("18", model_18(), [2, 2, 1]),
                                          ("18", model_2x(), [3, 3])):
                for checkpoint in ("always", "never"):
                    out_ref, input_grads_ref, params_ref = reference(model, style, inputs)
                    pipe = Pipe(model, chunks=3, checkpoint=checkpoint, balance=balance)
                    leaves = [t.clone().requires_grad_() for t in inputs]
                    out = (pipe(*leaves) if style == "2x" else pipe(tuple(leaves))).local_value()
                    loss_of(out).backward()
                    torch.testing.assert_close(out, out_ref)
                    for leaf, grad in zip(leaves, input_grads_ref):
                        torch.testing.assert_close(leaf.grad, grad)
                    for name, p in model.named_parameters():
                        torch.testing.assert_close(p.grad, params_ref[name])
                        p.grad = None
            empty = Pipe(torch.nn.Sequential(), chunks=42.0)
            assert empty.chunks == 42 and empty(torch.tensor(42)).local_value() == torch.tensor(42)
        mine = [w for w in caught if issubclass(w.category, InProcessWarning)]
        assert len(mine) == 1, [str(w.message) for w in caught]
        text = str(mine[0].message)
        assert "world size 1" in text and "runs its 3 stage(s) in this process" in text and "leave out" in text
        assert mine[0].filename.endswith("<string>"), mine[0].filename  # points at the user's Pipe(...) line
        print("ok")
        rpc.shutdown()
    """, timeout=100)
    assert "ok" in proc.stdout


@pytest.mark.timeout(150)
def test_port_from_torch_pipe_example_trains_like_the_plain_model(warm_python):
    proc = warm_python.run(["examples/port_from_torch_pipe.py", "--steps", "3"], timeout=140)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "ported: 3 steps on 2 stage workers, weights equal to the plain model's" in proc.stdout


def test_shared_parameters_across_stages_wording():
    from rrefpipe.partition import check_unshared

    shared = nn.Linear(2, 2)
    holder = nn.Module()
    holder.inner = shared
    with pytest.raises(ValueError, match="module with duplicate parameters on distinct devices is not supported"):
        check_unshared([nn.Sequential(shared), nn.Sequential(holder)])
    check_unshared([nn.Sequential(shared, holder)])  # in one stage: fine


def test_empty_pipe_without_rpc_gives_back_its_input():
    """PyTorch's test_empty_module, where rrefpipe starts the RPC group itself: the input comes back as
    the RRef's value, several inputs as their tuple, a non-tensor is refused; close() leaves RPC down."""
    from tests.conftest import run_script

    proc = run_script("""
        import pytest, torch
        from torch import nn
        from rrefpipe import Pipe, _rpc

        pipe = Pipe(nn.Sequential(), chunks=2)
        x = torch.tensor(42)
        assert pipe(x).local_value() is x and pipe.stages == [] and len(pipe) == 0
        a, b = torch.ones(2), torch.zeros(2)
        out = pipe(a, b).local_value()
        assert isinstance(out, tuple) and out[0] is a and out[1] is b
        with pytest.raises(TypeError):
            pipe(42)
        pipe.close()
        assert not _rpc.is_initialized()
        print("ok")
    """, timeout=60)
    assert "ok" in proc.stdout


def test_stage_layers_run_as_one_module_call():
    """A stage's nn.Sequential becomes a LayerSequence (the same object, keys and layers) called as a module,
    so its forward hooks, and module-wide ones such as memory tracking's, see the stage's input and output."""
    from rrefpipe.calling import LayerSequence, as_layer_sequence

    model = nn.Sequential(AddPair(), Twin(), AddPair())
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append((args, out)))
    same = as_layer_sequence(model)
    assert same is model and isinstance(model, LayerSequence) and list(model.state_dict()) == []
    x = torch.ones(2)
    pair = (x, x)
    torch.testing.assert_close(model(pair), 4 * x)
    torch.testing.assert_close(model(pair, spread=True), 4 * x)
    assert len(seen) == 2 and seen[0][0] == (pair,)
    other = as_layer_sequence(type("Mine", (nn.Sequential,), {})(nn.Linear(2, 2)))
    assert type(other) is LayerSequence and len(other) == 1
