"""Sharded checkpoints (``pipe.save`` / ``pipe.load``, ``rrefpipe.save_model`` / ``load_model``): a run saved
after k steps and resumed, in another split, schedule or in the plain model, ends where the uninterrupted
plain run ends; checkpoints that do not fit are refused before anything loads, naming the misfit.

CPU results are deterministic: resumed and uninterrupted runs are compared within 1e-6."""
from __future__ import annotations

import copy
import shutil
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.optim import DistributedOptimizer
from torch.optim.lr_scheduler import StepLR

import rrefpipe.optim
from examples.tiny_gpt import GPT
from rrefpipe import Pipe, StageError, load_model, save_model
from rrefpipe.optim import RemoteLRScheduler
from tests.training import blobs

pytestmark = pytest.mark.timeout(120)

Batches = Sequence[tuple[Tensor, Tensor]]
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def mlp(seed: int, width: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, 4))


BATCHES: Batches = list(blobs(6, 8, seed=3))


def plain_run(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, batches: Batches,
              loss: Callable[[Any, Any], Tensor] = F.cross_entropy) -> None:
    for x, y in batches:
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()


def pipe_run(pipe: Pipe, opt: Any, sched: Any, batches: Batches,
             loss: Callable[[Any, Any], Tensor] = F.cross_entropy) -> None:
    for x, y in batches:
        with dist_autograd.context() as ctx:
            pipe.train_step(ctx, x, y, loss)
            opt.step(ctx)
        if sched is not None:
            sched.step()


def assert_same(state: dict[str, Tensor], plain: nn.Module, what: str) -> None:
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0, msg=lambda m, name=name: f"{what}: {name}: {m}")


def uninterrupted(steps: int = 4) -> nn.Module:
    model = mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    plain_run(model, opt, StepLR(opt, step_size=2, gamma=0.5), BATCHES[:steps])
    return model


@pytest.fixture(scope="module")
def saved(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 stages, 1F1B, pipe.optimizer's AdamW and a StepLR after 2 steps, saved at step 2."""
    path = tmp_path_factory.mktemp("ckpt") / "step-2"
    with Pipe(mlp(0), chunks=4, balance=[3, 2, 2], workers=cluster.names[:3], schedule="1F1B") as pipe:
        opt = pipe.optimizer(torch.optim.AdamW, lr=0.01)
        sched = RemoteLRScheduler(opt, StepLR, step_size=2, gamma=0.5)
        pipe_run(pipe, opt, sched, BATCHES[:2])
        pipe.save(path, optimizer=opt, lr_scheduler=sched, step=2)
    return path


def test_workers_write_their_parts_and_the_driver_the_metadata(saved: Path):
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "driver", "rrefpipe.json", "worker-0", "worker-1",
                                                       "worker-2"]
    for k in range(3):
        assert any(f.suffix == ".distcp" for f in (saved / f"worker-{k}").iterdir())


def test_a_saved_run_resumes_in_another_split_and_schedule(cluster: Any, saved: Path):
    with Pipe(mlp(7), chunks=2, balance=[4, 3], workers=cluster.names[:2], schedule="GPipe") as pipe:
        opt = pipe.optimizer(torch.optim.AdamW, lr=0.01)
        sched = RemoteLRScheduler(opt, StepLR, step_size=2, gamma=0.5)
        assert pipe.load(saved, optimizer=opt, lr_scheduler=sched) == 2
        pipe_run(pipe, opt, sched, BATCHES[2:4])
        assert_same(pipe.state_dict(), uninterrupted(), "resumed in 2 stages")


def test_a_saved_run_resumes_in_the_plain_model(saved: Path):
    model = mlp(7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = StepLR(opt, step_size=2, gamma=0.5)
    assert load_model(saved, model, optimizer=opt, lr_scheduler=sched) == 2
    plain_run(model, opt, sched, BATCHES[2:4])
    assert_same(model.state_dict(), uninterrupted(), "resumed in the plain model")


def test_dcp_reads_it_as_a_checkpoint_of_the_plain_model(saved: Path):
    """torch's own recipe: get_optimizer_state_dict lists the keys once the optimizer has state."""
    model = mlp(7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(BATCHES[0][0]).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt, options=FLAT)}
    dcp.load(state, checkpoint_id=str(saved))
    reference = mlp(0)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    plain_run(reference, ref_opt, StepLR(ref_opt, step_size=2, gamma=0.5), BATCHES[:2])
    assert_same(state["model"], reference, "dcp.load")
    flat = get_optimizer_state_dict(reference, ref_opt, options=FLAT)
    assert any(key.endswith(".exp_avg") for key in state["optim"])
    for key, value in state["optim"].items():  # (the reference also has the scheduler's initial_lr)
        if isinstance(value, Tensor):
            torch.testing.assert_close(value, flat[key], atol=1e-6, rtol=0)
        else:
            assert value == flat[key], key


def test_a_plain_models_checkpoint_loads_into_a_pipe(cluster: Any, tmp_path: Path):
    """The reverse: rrefpipe.save_model, and DCP's own save of the plain model, load into a pipe."""
    model = mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = StepLR(opt, step_size=2, gamma=0.5)
    plain_run(model, opt, sched, BATCHES[:2])
    save_model(tmp_path / "ours", model, optimizer=opt, lr_scheduler=sched, step=2)
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt, options=FLAT),
              "lr_scheduler": sched.state_dict()}, checkpoint_id=str(tmp_path / "torch"))
    for path, schedule in ((tmp_path / "ours", "1F1B"), (tmp_path / "torch", "GPipe")):
        with Pipe(mlp(7), chunks=2, balance=[2, 5], workers=cluster.names[:2], schedule=schedule) as pipe:
            opt_p = pipe.optimizer(torch.optim.AdamW, lr=0.01)
            sched_p = RemoteLRScheduler(opt_p, StepLR, step_size=2, gamma=0.5)
            step = pipe.load(path, optimizer=opt_p, lr_scheduler=sched_p)
            assert step == (2 if path.name == "ours" else None)
            pipe_run(pipe, opt_p, sched_p, BATCHES[2:4])
            assert_same(pipe.state_dict(), uninterrupted(), f"plain checkpoint ({path.name}) into a pipe")


def test_distributed_optimizer_state_is_saved_per_parameter(cluster: Any, tmp_path: Path):
    with Pipe(mlp(0), chunks=2, balance=[2, 2, 3], workers=cluster.names[:3]) as pipe:
        opt = DistributedOptimizer(rrefpipe.optim.AdamW, pipe.parameter_rrefs(), lr=0.01)
        sched = RemoteLRScheduler(opt, StepLR, step_size=2, gamma=0.5)
        pipe_run(pipe, opt, sched, BATCHES[:2])
        pipe.save(tmp_path, optimizer=opt, lr_scheduler=sched, step=2)
    with Pipe(mlp(7), chunks=2, balance=[5, 2], workers=cluster.names[:2], schedule="1F1B") as pipe:
        opt = DistributedOptimizer(rrefpipe.optim.AdamW, pipe.parameter_rrefs(), lr=0.01)
        sched = RemoteLRScheduler(opt, StepLR, step_size=2, gamma=0.5)
        assert pipe.load(tmp_path, optimizer=opt, lr_scheduler=sched) == 2
        pipe_run(pipe, opt, sched, BATCHES[2:4])
        assert_same(pipe.state_dict(), uninterrupted(), "DistributedOptimizer resumed")


def lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def test_a_captured_model_with_a_tied_head_resumes_in_another_split(cluster: Any, tmp_path: Path):
    """The head tied to the embedding has a copy on the first and last stage: saved once under both keys,
    loaded into each copy of another split, into the plain model, and as init of a model on meta."""
    g = torch.Generator().manual_seed(5)
    tokens = [(t, t) for t in (torch.randint(0, 32, (4, 6), generator=g) for _ in range(4))]

    def gpt(seed: int) -> GPT:
        torch.manual_seed(seed)
        return GPT(vocab=32, d=16, heads=2, layers=2, context=6)

    plain = gpt(0)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain_run(plain, plain_opt, None, tokens, lm_loss)
    with Pipe(gpt(0), chunks=2, split_points=["blocks.1", "ln_f"], sample=tokens[0][0],
              workers=cluster.names[:3], schedule="1F1B") as pipe:
        opt = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
        pipe_run(pipe, opt, None, tokens[:2], lm_loss)
        pipe.save(tmp_path, optimizer=opt)
    with Pipe(gpt(3), chunks=2, split_points=["blocks.1"], sample=tokens[0][0], workers=cluster.names[:2]) as pipe:
        opt = pipe.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
        assert pipe.load(tmp_path, optimizer=opt) is None
        pipe_run(pipe, opt, None, tokens[2:], lm_loss)
        assert_same(pipe.state_dict(), plain, "captured GPT resumed in 2 stages")
    resumed = gpt(3)
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    load_model(tmp_path, resumed, optimizer=resumed_opt)
    assert resumed.head.weight is resumed.tok.weight
    plain_run(resumed, resumed_opt, None, tokens[2:], lm_loss)
    assert_same(resumed.state_dict(), plain, "captured GPT resumed in the plain model")
    with torch.device("meta"):
        empty = GPT(vocab=32, d=16, heads=2, layers=2, context=6)
    with Pipe(empty, chunks=2, split_points=["ln_f"], sample=tokens[0][0], workers=cluster.names[:2],
              init=tmp_path) as pipe:
        partway = gpt(0)
        partway_opt = torch.optim.SGD(partway.parameters(), lr=0.1, momentum=0.9)
        plain_run(partway, partway_opt, None, tokens[:2], lm_loss)
        assert_same(pipe.state_dict(), partway, "init from the checkpoint")


# -- what does not fit is refused before anything loads ------------------------------------------------------
@pytest.fixture(scope="module")
def target(cluster: Any) -> Any:
    with Pipe(mlp(1), chunks=2, balance=[3, 4], workers=cluster.names[:2]) as pipe:
        yield pipe


def refused(pipe: Pipe, path: Path, match: str, **kwargs: Any) -> None:
    before = pipe.state_dict()
    with pytest.raises((ValueError, StageError), match=match):
        pipe.load(path, **kwargs)
    after = pipe.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed by a refused load"
    with torch.no_grad():
        assert torch.isfinite(pipe(torch.randn(4, 10)).local_value()).all()  # still usable


def test_a_checkpoint_of_another_model_is_refused(target: Pipe, tmp_path: Path):
    save_model(tmp_path / "wider", mlp(0, width=24))
    refused(target, tmp_path / "wider", r"size mismatch for 0\.weight: copying a param with shape \[24, 10\]")
    save_model(tmp_path / "other", nn.Sequential(OrderedDict(inp=nn.Linear(10, 16), out=nn.Linear(16, 4))))
    refused(target, tmp_path / "other", r'(?s)Missing key\(s\) in state_dict: "0\.weight", "0\.bias", "2\.weight".*'
                                        r'Unexpected key\(s\) in state_dict: "inp\.weight", "inp\.bias"')
    save_model(tmp_path / "double", mlp(0).double())
    refused(target, tmp_path / "double", r"dtype mismatch for 0\.weight: the checkpoint holds torch\.float64")
    refused(target, tmp_path / "nothing", r"no checkpoint at")


def test_optimizer_and_scheduler_state_that_is_not_there_is_refused(target: Pipe, tmp_path: Path):
    save_model(tmp_path / "weights", mlp(0))
    opt = target.optimizer(torch.optim.AdamW, lr=0.01)
    try:
        refused(target, tmp_path / "weights", r"no optimizer state for '0\.weight'", optimizer=opt)
        model = mlp(0)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        plain_run(model, sgd, None, BATCHES[:1])
        save_model(tmp_path / "sgd", model, optimizer=sgd)
        refused(target, tmp_path / "sgd", r"saved with the settings .*this optimizer has", optimizer=opt)
        sched = RemoteLRScheduler(opt, StepLR, step_size=2)
        refused(target, tmp_path / "sgd", "holds no LR scheduler state", lr_scheduler=sched)
    finally:
        opt.close()


def test_a_truncated_part_names_the_worker_and_loads_nothing(target: Pipe, tmp_path: Path):
    target.save(tmp_path)
    part = next((tmp_path / "worker-1").glob("*.distcp"))
    part.write_bytes(part.read_bytes()[:100])
    with pytest.raises(StageError, match=r"(?s)worker 'worker2'.*cannot read the checkpoint"):
        target.load(tmp_path)
    with torch.no_grad():
        assert torch.isfinite(target(torch.randn(4, 10)).local_value()).all()


def test_a_save_replaces_an_earlier_checkpoint_only_once_whole(cluster: Any, saved: Path, tmp_path: Path):
    """A save over a 3-worker checkpoint from 2 workers leaves no third part; one that fails midway leaves
    the earlier checkpoint whole and nothing beside it."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    with Pipe(mlp(1), chunks=2, balance=[3, 4], workers=cluster.names[:2]) as pipe:
        pipe.save(path, step=5)
        assert sorted(p.name for p in path.iterdir()) == [".metadata", "driver", "rrefpipe.json", "worker-0",
                                                          "worker-1"]
        with pytest.raises(TypeError, match="optimizer= takes"):
            pipe.save(path, optimizer=object(), step=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    model = mlp(3)
    assert load_model(path, model) == 5
    assert_same(model.state_dict(), mlp(1), "the earlier checkpoint")


def test_a_plain_model_refuses_what_does_not_fit(tmp_path: Path):
    save_model(tmp_path, mlp(0))
    with pytest.raises(ValueError, match=r'Missing key\(s\) in state_dict: "7.weight", "7.bias"'):
        load_model(tmp_path, nn.Sequential(*mlp(0)[:5], nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4)))
    model = copy.deepcopy(mlp(1))
    with pytest.raises(ValueError, match="no checkpoint at"):
        load_model(tmp_path / "absent", model)
    with pytest.raises(ValueError, match=r"size mismatch for 0\.weight"):
        load_model(tmp_path, mlp(1, width=24))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no optimizer state for '0.weight'"):
        load_model(tmp_path, model, optimizer=sgd)
    assert_same(model.state_dict(), mlp(1), "a refused load_model")  # the weights were left as they were
