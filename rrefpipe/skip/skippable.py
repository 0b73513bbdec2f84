"""The ``@skippable`` decorator and its ``stash``/``pop`` commands, and the checks that skips pair up."""
from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

from torch import Tensor, nn

from .namespace import DEFAULT, Namespace
from .tracker import SkipKey, current_tracker

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Skippable"]


class stash:  # noqa: N801 (the documented, PyTorch-compatible name)
    """The command ``yield stash(name, tensor)``: keep ``tensor`` (or None) for a later ``pop(name)``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Tensor | None) -> None:
        self.name = name
        self.tensor = tensor


class pop:  # noqa: N801
    """The command ``tensor = yield pop(name)``: take back the tensor stashed under ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """Base of the classes ``@skippable`` makes: declared skip names and their namespaces."""

    stashable_names: ClassVar[frozenset[str]] = frozenset()
    poppable_names: ClassVar[frozenset[str]] = frozenset()

    def isolate(self, ns: Namespace, *, only: Iterable[str] | None = None) -> Skippable:
        """Put this layer's skip names (or ``only`` these) in namespace ``ns``; returns self."""
        names = set(only) if only is not None else self.stashable_names | self.poppable_names
        unknown = names - (self.stashable_names | self.poppable_names)
        if unknown:
            raise ValueError(f"{type(self).__name__} declares no skip names {sorted(unknown)}")
        namespaces = dict(getattr(self, "_skip_namespaces", {}))
        namespaces.update(dict.fromkeys(names, ns))
        self._skip_namespaces = namespaces
        return self

    def __repr__(self) -> str:
        """As PyTorch's: the module's repr inside ``@skippable(...)``."""
        return f"@skippable({super().__repr__()})"

    def namespaced(self, name: str) -> SkipKey:
        return getattr(self, "_skip_namespaces", {}).get(name, DEFAULT), name

    def stashable(self) -> Iterator[SkipKey]:
        return (self.namespaced(name) for name in sorted(self.stashable_names))

    def poppable(self) -> Iterator[SkipKey]:
        return (self.namespaced(name) for name in sorted(self.poppable_names))

    def _drive(self, gen: Generator[Any, Tensor | None, Any]) -> Any:
        """Run a generator ``forward``: save stashes and answer pops through the current tracker."""
        tracker = current_tracker()
        reply: Tensor | None = None
        stashed: set[str] = set()
        popped: set[str] = set()
        while True:
            try:
                command = gen.send(reply)
            except StopIteration as stop:
                self._check_all_done(stashed, popped)
                return stop.value
            reply = None
            if isinstance(command, stash):
                self._check(command.name, self.stashable_names, "stash")
                tracker.save(self.namespaced(command.name), command.tensor)
                stashed.add(command.name)
            elif isinstance(command, pop):
                self._check(command.name, self.poppable_names, "pop")
                reply = tracker.load(self.namespaced(command.name))
                popped.add(command.name)
            else:
                raise TypeError(f"{type(self).__name__}.forward yielded {command!r}; yield stash(...) or pop(...)")

    def _check_all_done(self, stashed: set[str], popped: set[str]) -> None:
        """Every declared name must be stashed and popped in each forward: a later layer (on another
        stage, maybe) waits for the stash, and a pop left behind would pile up."""
        for verb, declared, done in (("stash", self.stashable_names, stashed), ("pop", self.poppable_names, popped)):
            missing = declared - done
            if missing:
                raise RuntimeError(f"{type(self).__name__} declares {verb}={sorted(declared)} in @skippable, "
                                   f"but its forward did not {verb} {sorted(missing)}")

    def _check(self, name: str, declared: frozenset[str], verb: str) -> None:
        if name not in declared:
            raise RuntimeError(f"{type(self).__name__} cannot {verb} {name!r}: it declares "
                               f"{verb}={sorted(declared)} in @skippable")


M = TypeVar("M", bound=nn.Module)


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[type[M]], type[M]]:
    """Declare the skip tensors a module class stashes and pops; its ``forward`` may then ``yield``
    ``stash(name, tensor)`` and ``pop(name)``. Works inside and outside a Pipe."""
    stashable, poppable = frozenset(stash), frozenset(pop)

    def decorate(cls: type[M]) -> type[M]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates nn.Module classes, got {cls!r}")
        original = cls.forward

        @functools.wraps(original)  # keeps the signature, which says how a tuple reaches the layer (``calling``)
        def forward(self: Skippable, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            if isinstance(result, Generator):
                return self._drive(result)
            self._check_all_done(set(), set())
            return result

        namespace = {"forward": forward, "stashable_names": stashable, "poppable_names": poppable,
                     "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        return type(cls.__name__, (cls, Skippable), namespace)

    return decorate


def skippable_layers(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, Skippable]]:
    """Every skippable inside ``module`` in definition (= forward) order; shared instances repeat."""
    for name, child in module._modules.items():
        if child is None:
            continue
        path = f"{prefix}{name}"
        if isinstance(child, Skippable):
            yield path, child
        yield from skippable_layers(child, path + ".")


def crossing_skips(module: nn.Module) -> Iterator[tuple[str, list[SkipKey], list[SkipKey]]]:
    """Every skippable inside ``module`` (as :func:`skippable_layers`) with the keys it stashes and pops
    that may cross a stage: the pairing checks and the routes deal with those alone.

    Stages are cut between ``module``'s children only, so a key kept inside its children
    (:func:`_internal_skips`) never crosses one: the stage's tracker keeps each such stash until its pop,
    as PyTorch's partition-local tracker did. Only the child's forward knows their order (registration
    order need not be it); a pop that really comes first fails there, as in the plain module.
    """
    internal = _internal_skips(module)
    for path, layer in skippable_layers(module):
        yield (path, [key for key in layer.stashable() if key not in internal],
               [key for key in layer.poppable() if key not in internal])


def _internal_skips(module: nn.Module) -> set[SkipKey]:
    """Keys that every child of ``module`` using them stashes and pops as often inside its subtree, none
    declared by a child itself (a top-level skippable pairs with other children, as in PyTorch's Pipe).
    A stash left for another child, or a pop of one, keeps the key model-wide, in every child, so no
    two children pair up silently."""
    counts: dict[SkipKey, dict[str, list[int]]] = {}  # key -> child's name -> [stashes, pops]
    top_level: set[SkipKey] = set()
    for path, layer in skippable_layers(module):
        child, _, nested = path.partition(".")
        if not nested:
            top_level.update(layer.stashable(), layer.poppable())
        for side, keys in enumerate((layer.stashable(), layer.poppable())):
            for key in keys:
                counts.setdefault(key, {}).setdefault(child, [0, 0])[side] += 1
    return {key for key, by_child in counts.items()
            if key not in top_level and all(stashes == pops for stashes, pops in by_child.values())}


def verify_skippables(module: nn.Sequential) -> None:
    """Check that every skip name crossing the module's children has exactly one stash and one later pop.

    A name that the children using it each stash and pop inside themselves, as often (a residual block
    repeated with its default names, say), stays inside each child and is left to its forward
    (:func:`crossing_skips`). Raises ``TypeError`` listing every problem at once, each naming the
    layers and the skip.
    """
    stashes: dict[SkipKey, list[tuple[int, str]]] = {}
    pops: dict[SkipKey, list[tuple[int, str]]] = {}
    for order, (path, stashed, popped) in enumerate(crossing_skips(module)):
        for key in stashed:
            stashes.setdefault(key, []).append((order, repr(path)))
        for key in popped:
            pops.setdefault(key, []).append((order, repr(path)))
    _check_pairs(stashes, pops, "layer", pop_in_place=False)


def verify_stage_skips(stage_skips: Sequence[tuple[Sequence[SkipKey], Sequence[SkipKey]]]) -> None:
    """:func:`verify_skippables` for stages known only by each one's (stashed, popped) names: stages
    built on their workers (``Pipe.from_factories``). Names kept inside one layer are not among them
    (:func:`crossing_skips`). A pop in the stash's own stage counts as later (that stage's forward
    says so if it is not)."""
    stashes: dict[SkipKey, list[tuple[int, str]]] = {}
    pops: dict[SkipKey, list[tuple[int, str]]] = {}
    for j, (stashed, popped) in enumerate(stage_skips):
        for key in stashed:
            stashes.setdefault(key, []).append((j, str(j)))
        for key in popped:
            pops.setdefault(key, []).append((j, str(j)))
    _check_pairs(stashes, pops, "stage", pop_in_place=True, hint=(
        "a Namespace is one object, compared across processes by its id: factories that make their own (or "
        "import a module that makes one) get a different one on each worker; make it in the driver's script "
        "and pass it to the factories"))


def _check_pairs(stashes: dict[SkipKey, list[tuple[int, str]]], pops: dict[SkipKey, list[tuple[int, str]]],
                 kind: str, pop_in_place: bool, hint: str = "") -> None:
    """Raise ``TypeError`` listing every skip name without exactly one stash and one later pop; places are
    (order, label) of the ``kind`` ("layer", "stage") that stashes or pops; ``pop_in_place``: a pop at
    the stash's own place is later. ``hint`` ends the message where an isolated name is in it."""
    problems: list[str] = []
    isolated = False
    for key in sorted(set(stashes) | set(pops), key=lambda k: (k[1], k[0])):
        problems_before = len(problems)
        name = f"{key[1]!r}" + ("" if key[0] == DEFAULT else f" in {key[0]}")
        by, at = stashes.get(key, []), pops.get(key, [])

        def who(place: tuple[int, str]) -> str:  # PyTorch's wording, kept after ours: its tests match it
            return place[1] if kind == "layer" else f"{kind} {place[1]}"

        if len(by) > 1:
            again = "; ".join(f"{who(p)} redeclared {key[1]!r} as stashable" for p in by[1:])
            problems.append(f"{name} is stashed by {len(by)} {kind}s {_names(by)}: one stash per name "
                            f"(isolate repeated blocks with layer.isolate(Namespace())) ({again})")
        if len(at) > 1:
            again = "; ".join(f"{who(p)} redeclared {key[1]!r} as poppable" for p in at[1:])
            problems.append(f"{name} is popped by {len(at)} {kind}s {_names(at)}: one pop per name ({again})")
        if by and not at:
            problems.append(f"{name} is stashed by {kind} {_names(by)} but never popped "
                            f"(no module declared {key[1]!r} as poppable but stashed)")
        if at and not by:
            problems.append(f"{name} is popped by {kind} {_names(at)} but never stashed "
                            f"({who(at[0])} declared {key[1]!r} as poppable but it was not stashed)")
        if len(by) == 1 and len(at) == 1 and at[0][0] == by[0][0] and not pop_in_place:
            problems.append(f"{name} is popped by {kind} {_names(at)} before it is stashed by {kind} {_names(by)} "
                            f"({who(at[0])} declared {key[1]!r} both as stashable and as poppable)")
        elif len(by) == 1 and len(at) == 1 and at[0][0] < by[0][0]:
            problems.append(f"{name} is popped by {kind} {_names(at)} before it is stashed by {kind} {_names(by)} "
                            f"({who(at[0])} declared {key[1]!r} as poppable but it was not stashed)")
        isolated = isolated or (len(problems) > problems_before and key[0] != DEFAULT)
    if problems:
        raise TypeError("skip connections do not pair up:\n" + "\n".join(f"  - {p}" for p in problems)
                        + (f"\n({hint})" if hint and isolated else ""))


def _names(places: list[tuple[int, str]]) -> str:
    return " and ".join(label for _, label in places)
