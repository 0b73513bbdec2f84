import pickle
import re
from collections import OrderedDict

import pytest
import torch
from torch import nn

from rrefpipe.skip import Namespace, pop, skippable, stash, verify_skippables
from rrefpipe.skip.namespace import DEFAULT
from rrefpipe.skip.skippable import verify_stage_skips
from rrefpipe.skip.layout import route
from tests.layers import (NestedResidual, PopAB, PopAdd, PopRegisteredFirst, StashC, StashInput, StashStashPop,
                          nested_skip_models, skip_model)


def test_skippable_modules_work_outside_a_pipe():
    model = nn.Sequential(StashInput(), nn.Linear(3, 3), PopAdd())
    x = torch.randn(2, 3)
    torch.testing.assert_close(model(x), model[1](x) + x * 0.5)


def test_several_names_per_module_and_tuple_of_pops():
    model = nn.Sequential(StashC(), StashStashPop(4), PopAB())
    verify_skippables(model)
    x = torch.randn(2, 4)
    a, b = torch.tanh(x), model[1].fc(x)
    torch.testing.assert_close(model(x), (x + 2 * x) * a + b)


@pytest.mark.parametrize("layers, messages", [
    (lambda: [StashInput(), nn.ReLU()], ["'skip' is stashed by layer '0' but never popped"]),
    (lambda: [nn.ReLU(), PopAdd()], ["'skip' is popped by layer '1' but never stashed"]),
    (lambda: [PopAdd(), StashInput()], ["'skip' is popped by layer '0' before it is stashed by layer '1'"]),
    (lambda: [StashInput(), StashInput(), PopAdd()], ["'skip' is stashed by 2 layers '0' and '1'"]),
    (lambda: [StashInput(), PopAdd(), PopAdd()], ["'skip' is popped by 2 layers '1' and '2'"]),
    (lambda: [StashStashPop(2)], ["'a' is stashed by layer '0' but never popped",
                                  "'b' is stashed by layer '0' but never popped",
                                  "'c' is popped by layer '0' but never stashed"]),
])
def test_verify_skippables_lists_every_problem(layers, messages):
    with pytest.raises(TypeError) as info:
        verify_skippables(nn.Sequential(*layers()))
    for message in messages:
        assert message in str(info.value)


SKIP, OTHER = (DEFAULT, "skip"), (DEFAULT, "other")


@pytest.mark.parametrize("stage_skips, messages", [
    ([((), (SKIP,)), ((), ())], ["'skip' is popped by stage 0 but never stashed"]),
    ([((SKIP,), ()), ((), ())], ["'skip' is stashed by stage 0 but never popped"]),
    ([((SKIP,), ()), ((SKIP,), ()), ((), (SKIP,))], ["'skip' is stashed by 2 stages 0 and 1"]),
    ([((SKIP,), ()), ((), (SKIP,)), ((), (SKIP,))], ["'skip' is popped by 2 stages 1 and 2"]),
    ([((), (SKIP,)), ((SKIP,), ())], ["'skip' is popped by stage 0 before it is stashed by stage 1"]),
])
def test_stages_known_by_their_skip_names_are_checked_like_layers(stage_skips, messages):
    with pytest.raises(TypeError) as info:
        verify_stage_skips(stage_skips)
    for message in messages:
        assert message in str(info.value)


def test_stage_skips_that_pair_up_pass():
    verify_stage_skips([((SKIP, OTHER), (OTHER,)), ((), ()), ((), (SKIP,))])  # 'other' stays in its stage


def test_a_layer_used_twice_is_a_stash_twice():
    stasher = StashInput()
    model = nn.Sequential()
    model._modules["0"] = stasher
    model._modules["1"] = stasher  # the same instance twice (nn.Sequential(a, a) would hide it)
    model._modules["2"] = PopAdd()
    with pytest.raises(TypeError, match="'skip' is stashed by 2 layers '0' and '1'"):
        verify_skippables(model)


def test_namespaces_allow_repeated_blocks():
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(StashInput().isolate(ns1), PopAdd().isolate(ns1), StashInput().isolate(ns2),
                          PopAdd().isolate(ns2))
    verify_skippables(model)
    with pytest.raises(TypeError, match="stashed by 2 layers"):
        verify_skippables(nn.Sequential(StashInput(), PopAdd(), StashInput(), PopAdd()))
    copy = pickle.loads(pickle.dumps(ns1))
    assert copy == ns1 and hash(copy) == hash(ns1) and copy != ns2


def test_a_block_may_register_its_pop_before_its_stash():
    """Stages are cut between the model's children only, so a name a child stashes and pops inside itself
    is left to its forward, which alone knows the order (registration said "popped before it is stashed")."""
    block = PopRegisteredFirst(4)
    model = nn.Sequential(block, nn.Tanh())
    verify_skippables(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x), torch.tanh(torch.tanh(block.fc(x)) + x * 0.5))
    verify_skippables(nested_skip_models()["pop registered first"])  # two such blocks, one default name


def test_repeated_blocks_keep_their_default_names_inside_themselves():
    """As in PyTorch's Pipe, repeated nested blocks need no namespace, and a skip crossing them still pairs."""
    verify_skippables(nn.Sequential(NestedResidual(4), NestedResidual(4), nn.ReLU()))
    verify_skippables(nested_skip_models()["repeated blocks"])


@pytest.mark.parametrize("layers, message", [
    # a name a child leaves for another (or takes from one) is checked model-wide, blocks and all
    (lambda: [NestedResidual(4), PopAdd()], "'skip' is popped by 2 layers '0.add' and '1'"),
    (lambda: [NestedResidual(4), nn.Sequential(PopAdd())], "'skip' is popped by 2 layers '0.add' and '1.0'"),
    (lambda: [StashInput(), NestedResidual(4)], "'skip' is stashed by 2 layers '0' and '1.fork'"),
    (lambda: [PopRegisteredFirst(4), nn.Sequential(StashInput())], "'skip' is stashed by 2 layers '0.fork' and '1.0'"),
    # a child that stashes a name more often than it pops it would leave a stash for the next one
    (lambda: [nn.Sequential(StashInput(), NestedResidual(4))], "'skip' is stashed by 2 layers '0.0' and '0.1.fork'"),
])
def test_names_that_leave_a_block_are_checked_model_wide(layers, message):
    verify_skippables(nn.Sequential(NestedResidual(4), NestedResidual(4)))  # inside: fine
    with pytest.raises(TypeError, match=re.escape(message)):
        verify_skippables(nn.Sequential(*layers()))


def test_stages_report_only_the_skips_that_leave_their_layers():
    """The driver routes (and checks) what Stage.info reports: skips kept inside a layer stay off it,
    and the stage's router keeps each one until its pop, block after block."""
    from rrefpipe.stage_side.stage import Stage, StepMeta

    model = nested_skip_models()["repeated blocks"]
    ns = model[0].namespaced("skip")[0]
    stages = [Stage(j, nn.Sequential(OrderedDict(list(model.named_children())[a:b])), torch.device("cpu"), "w")
              for j, (a, b) in enumerate([(0, 2), (2, 5)])]
    infos = [stage.info() for stage in stages]
    assert [(info.stashes, info.pops) for info in infos] == [(((ns, "skip"),), ()), ((), ((ns, "skip"),))]
    verify_stage_skips([(info.stashes, info.pops) for info in infos])
    for stage, routes in zip(stages, route([(info.stashes, info.pops) for info in infos])):
        stage.routes = routes
    meta = StepMeta(step=0, chunks=1, checkpoint_stop=0, grad_enabled=False, driver="driver", timeout=1.0)
    x = torch.randn(3, 6)
    first = stages[0].run(meta, 0, x)
    assert list(first.skips) == [(ns, "skip")]  # the crossing skip only
    out = stages[1].run(meta, 0, first.value, received=first.skips)
    torch.testing.assert_close(out.value, model(x))


def test_undeclared_names_and_bad_yields_are_errors():
    @skippable(stash=["x"])
    class Wrong(nn.Module):
        def forward(self, x):
            yield stash("y", x)
            return x

    @skippable()
    class Odd(nn.Module):
        def forward(self, x):
            yield 3
            return x

    with pytest.raises(RuntimeError, match="cannot stash 'y'.*stash=\\['x'\\]"):
        Wrong()(torch.zeros(1))
    with pytest.raises(TypeError, match="yielded 3"):
        Odd()(torch.zeros(1))
    with pytest.raises(ValueError, match="declares no skip names"):
        Wrong().isolate(Namespace(), only=["zzz"])
    with pytest.raises(TypeError, match="decorates nn.Module classes"):
        skippable()(int)


def test_every_declared_name_must_be_stashed_and_popped():
    """A later layer (on another stage, maybe) waits for a declared stash: one left out is an error at
    once, in the layer that left it out, as in PyTorch's Pipe."""
    @skippable(stash=["s"])
    class ReturnsOnly(nn.Module):  # not even a generator
        def forward(self, x):
            return x * 2

    @skippable(stash=["s", "t"])
    class StashesOne(nn.Module):
        def forward(self, x):
            yield stash("s", x)
            return x

    @skippable(pop=["s"])
    class NeverPops(nn.Module):
        def forward(self, x):
            return x
            yield  # a generator that pops nothing

    with pytest.raises(RuntimeError, match=r"ReturnsOnly declares stash=\['s'\].*did not stash \['s'\]"):
        ReturnsOnly()(torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"did not stash \['t'\]"):
        StashesOne()(torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"NeverPops declares pop=\['s'\].*did not pop \['s'\]"):
        NeverPops()(torch.zeros(1))


def test_routes_send_each_skip_to_its_pop_stage():
    model = skip_model()  # stash@0 (ns1), stash@2 (ns2), pop@4 (ns2), pop@6 (ns1)
    ns1, ns2 = model[0].namespaced("skip"), model[2].namespaced("skip")
    assert ns1 != ns2 and model[6].namespaced("skip") == ns1
    routes = route([([ns1], []), ([ns2], [ns2]), ([], [ns1])])
    assert routes[0].outgoing == {ns1: 2} and routes[0].incoming == frozenset()
    assert routes[1].outgoing == {} and routes[1].incoming == frozenset()  # stashed and popped locally
    assert routes[2].incoming == frozenset({ns1})


def test_stage_lines_tell_isolated_skips_of_one_name_apart():
    from rrefpipe.skip import Namespace
    from rrefpipe.skip.namespace import DEFAULT
    from rrefpipe.stage_side.stage import StageInfo

    a, b = Namespace(), Namespace()
    info = StageInfo(0, "worker1", "cpu", ("0: Stash",), 0, stashes=((a, "x"), (b, "x"), (DEFAULT, "y")))
    assert f"stash ['x ({a.id[:8]})', 'x ({b.id[:8]})', 'y'] pop []" in str(info)


def test_stages_whose_namespaces_were_made_apart_are_told_why_they_do_not_pair():
    """Factories that import a module making a Namespace get one per worker: the names look paired but
    are not, and the error says where a namespace must come from."""
    on_worker1, on_worker2 = Namespace(), Namespace()
    with pytest.raises(TypeError, match="make it in the driver's script and pass it to the factories"):
        verify_stage_skips([([(on_worker1, "s")], []), ([], [(on_worker2, "s")])])
    with pytest.raises(TypeError) as info:  # default names: nothing about namespaces
        verify_stage_skips([([(DEFAULT, "s")], []), ([], [(DEFAULT, "t")])])
    assert "Namespace is one object" not in str(info.value)


def test_namespaces_sort_as_torchs_did():
    first, second = sorted([Namespace("b"), Namespace("a")])
    assert (first.id, second.id) == ("a", "b")
