"""Models built on the meta device and made on their stage workers (``Pipe(model, init=...)``), each compared
with the real model:

* GPT-2 (transformers) built under ``torch.device("meta")``, cut into 2 stages and read from a safetensors
  file (``save_model``: the tied head stored once) and into 3 read from ``save_pretrained`` shards: eval
  logits and state, every gradient of ``pipe(x)`` + ``pipe.backward`` (the tied embedding/head on both
  ends), and a 1F1B ``train_step`` with a ``pipe.optimizer(SGD)`` step against the plain model's; read from
  its base model's checkpoint (keys without ``transformer.``), and from one with the old ``h.<i>.attn.bias``
  buffers that ``from_pretrained`` ignores;
* Llama under ``rrefpipe.meta_parameters()`` (its non-persistent rotary ``inv_freq`` stays real) from a
  state dict and a torch.save file; under ``torch.device("meta")`` the buffer is a ValueError;
* the tiny GPT (examples/tiny_gpt.py) on 3 stages with ``init=None``: every module reset on its worker,
  the tied copies on stages 0 and 2 equal (and after a step), seeded builds identical;
* ``nn.Sequential`` on meta: ``init=None`` (seeded, real layers kept, BatchNorm buffers reset), a callable
  (each worker asked for its stage's keys only), a mapping (training as the plain model), a parameter tied
  within a stage (from a mapping, and from ``save_model``'s file), ``deferred_batch_norm=True``, a DCP
  checkpoint of ``pipe.save`` and of ``rrefpipe.save_model``; ``balance='size'`` as for the real model,
  ``balance='time'`` refused;
* bad input, each named, nothing left on the workers, the next pipe fine;
* the driver's memory: a 1 GB model read from shards that this process never held leaves its RSS (and
  its peak) within 10% of the model's bytes.

The one-process checks of the sources are in tests/test_weights.py."""
from __future__ import annotations

import copy
import json
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file, save_model
from torch import Tensor, nn

import rrefpipe
from examples.tiny_gpt import GPT
from rrefpipe import Pipe, StageError
from rrefpipe.balance import balance_by_size
from rrefpipe.stage_side import control
from tests.distributed.probes import all_counts, stage_gradients
from tests.distributed.test_train_step import assert_same_state, train_side_by_side
from tests.test_any_model_hf import assert_model_gradients, model_gradients

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # isort: skip

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings(r"ignore:Pipe\(schedule='1F1B'\). pipe\(x\) followed by pipe.backward:UserWarning"),
]

VOCAB = 128


def _losses() -> tuple[Any, Any]:
    """The losses ``train_step`` runs on the last stage's worker, made in a function so that cloudpickle
    sends them by value: that worker imports no test module (nor transformers) to run them."""
    def lm_loss(out: Any, target: Tensor) -> Tensor:  # a Hugging Face ModelOutput
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    def logits_loss(logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    return lm_loss, logits_loss


lm_loss, logits_loss = _losses()


def tokens(seed: int, rows: int = 8, length: int = 8, vocab: int = VOCAB) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), generator=g), torch.randint(0, vocab, (rows, length), generator=g)


def stage_states(pipe: Pipe) -> list[dict[str, Tensor]]:
    """Each stage's own state dict, read on its worker (a captured stage's keys: ``'<j>.graph.<name>'``)."""
    driver = pipe._driver
    return [rpc.rpc_sync(w, control.state_dict, args=(driver.pipe_id, j)) for j, w in enumerate(driver.workers)]


def stages_on(cluster: Any) -> dict[str, int]:
    return {name: counts["stages"] for name, counts in all_counts(cluster.names).items()}


# -- GPT-2 from a safetensors file, from shards, from a base model's keys -----------------------------------
GPT2_CONFIG = dict(n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                   embd_pdrop=0.0, attn_pdrop=0.0)
GPT2_CASES = {  # id -> (split points, what init= names under the checkpoints' directory)
    "2stages-file": (["transformer.h.1"], "model.safetensors"),
    "3stages-shards": (["transformer.h.1", "transformer.h.2"], "shards"),
}


@pytest.fixture(scope="module")
def gpt2_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPT2LMHeadModel, Path]:
    """A real GPT-2 and, in one directory, its safetensors file (``save_model`` writes the tied head once),
    its ``save_pretrained`` shards, and its base model's checkpoint (keys ``h.0...``, no head)."""
    torch.manual_seed(0)
    real = GPT2LMHeadModel(GPT2Config(**GPT2_CONFIG))
    where = tmp_path_factory.mktemp("gpt2")
    save_model(real, str(where / "model.safetensors"))
    real.save_pretrained(where / "shards", max_shard_size="100KB")
    real.transformer.save_pretrained(where / "base")
    assert len(list((where / "shards").glob("model-*.safetensors"))) > 1  # the premises: shards, ...
    with safe_open(str(where / "base" / "model.safetensors"), "pt") as f:  # ...and keys without the prefix
        assert "h.0.attn.c_attn.weight" in f.keys() and not any(k.startswith("transformer.") for k in f.keys())
    return real, where


class Built(NamedTuple):
    pipe: Pipe
    plain: nn.Module  # the real model, stepped along with the pipe by the tests that step it


@pytest.fixture(scope="module", params=sorted(GPT2_CASES))
def gpt2(request: pytest.FixtureRequest, cluster: Any,
         gpt2_checkpoints: tuple[GPT2LMHeadModel, Path]) -> Iterator[Built]:
    real, where = gpt2_checkpoints
    split_points, source = GPT2_CASES[request.param]
    with torch.device("meta"):
        meta = GPT2LMHeadModel(GPT2Config(**GPT2_CONFIG))
    assert all(t.is_meta for t in meta.state_dict().values())
    pipe = Pipe(meta, chunks=4, split_points=split_points, sample=tokens(0)[0], schedule="1F1B",
                workers=cluster.names[:len(split_points) + 1], init=where / source)
    try:
        assert len(pipe.stages) == len(split_points) + 1
        yield Built(pipe, copy.deepcopy(real))
    finally:
        pipe.close()


def test_gpt2_eval_logits_and_state(gpt2):
    pipe, plain = gpt2
    x, _ = tokens(1)
    assert_same_state(pipe.state_dict(), plain)  # every key, both names of the tied embedding/head
    pipe.eval()
    plain.eval()
    try:
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value().logits, plain(x).logits)
    finally:
        pipe.train()
        plain.train()


def test_gpt2_gradients_of_one_backward(gpt2):
    pipe, plain = gpt2
    x, y = tokens(2)
    plain.zero_grad()
    lm_loss(plain(x), y).backward()
    with dist_autograd.context() as ctx:
        pipe.backward(ctx, lm_loss(pipe(x).local_value(), y))
        grads = model_gradients(pipe, stage_gradients(pipe, ctx))  # each tied copy: the sum
    assert_model_gradients(grads, plain)


def test_gpt2_train_step_and_sgd_step(gpt2):
    pipe, plain = gpt2
    x, y = tokens(3)
    opt = pipe.optimizer(torch.optim.SGD, lr=0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    head = plain.lm_head.weight.detach().clone()
    plain_opt.zero_grad()
    plain_loss = lm_loss(plain(x), y)
    plain_loss.backward()
    plain_opt.step()
    with dist_autograd.context() as ctx:
        loss = pipe.train_step(ctx, x, y, lm_loss)
        opt.step(ctx)
    torch.testing.assert_close(loss, plain_loss.detach())
    assert not torch.equal(plain.lm_head.weight, head)  # the premise: the step moved it
    assert_same_state(pipe.state_dict(), plain)  # the first copy of the tied weight...
    with torch.no_grad():  # ...and the last stage's, which computes the logits
        torch.testing.assert_close(pipe(x).local_value().logits, plain(x).logits)


def test_gpt2_from_its_base_models_checkpoint(cluster, gpt2_checkpoints):
    """A checkpoint of ``GPT2Model`` (keys ``h.0...``, no ``lm_head``: the hub's ``gpt2``) builds the LM
    head model as ``from_pretrained`` would: ``transformer.`` is dropped where the checkpoint lacks it, and
    the head is the tied embedding."""
    real, where = gpt2_checkpoints
    with torch.device("meta"):
        meta = GPT2LMHeadModel(GPT2Config(**GPT2_CONFIG))
    x, _ = tokens(5)
    with Pipe(meta, chunks=2, split_points=["transformer.h.2"], sample=x, workers=cluster.names[:2],
              init=where / "base") as pipe:
        assert_same_state(pipe.state_dict(), real)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value().logits, real(x).logits)


def test_gpt2_from_a_checkpoint_with_the_old_attention_mask_buffers(cluster, gpt2_checkpoints, tmp_path):
    """GPT-2 checkpoints written by older transformers (the hub's ``gpt2`` among them) hold each block's
    causal mask, ``h.<i>.attn.bias``, which GPT-2 no longer has: ``from_pretrained`` ignores those keys
    (``_keys_to_ignore_on_load_unexpected``) and loads the model; so must ``init=``."""
    real, where = gpt2_checkpoints
    with safe_open(str(where / "base" / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    mask = torch.tril(torch.ones(32, 32, dtype=torch.bool)).view(1, 1, 32, 32)
    state.update((f"h.{i}.attn.bias", mask.clone()) for i in range(GPT2_CONFIG["n_layer"]))
    shutil.copy(where / "base" / "config.json", tmp_path / "config.json")
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    x, _ = tokens(5)
    with torch.no_grad():
        expected = real(x).logits
        torch.testing.assert_close(GPT2LMHeadModel.from_pretrained(tmp_path)(x).logits, expected)  # the premise
    with torch.device("meta"):
        meta = GPT2LMHeadModel(GPT2Config(**GPT2_CONFIG))
    with Pipe(meta, chunks=2, split_points=["transformer.h.2"], sample=x, workers=cluster.names[:2],
              init=tmp_path) as pipe:
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value().logits, expected)


# -- Llama: meta parameters, real buffers ----------------------------------------------------------------------
LLAMA_CONFIG = dict(num_hidden_layers=2, num_key_value_heads=1, hidden_size=32, intermediate_size=64,
                    num_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=32)


@pytest.mark.parametrize("source", ["state dict", "torch.save file"])
def test_llama_with_meta_parameters(cluster, tmp_path, source):
    torch.manual_seed(1)
    real = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))
    with rrefpipe.meta_parameters():
        meta = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))
    assert all(p.is_meta for p in meta.parameters()) and not any(b.is_meta for b in meta.buffers())
    if source == "state dict":
        init: Any = real.state_dict()
    else:
        init = tmp_path / "llama.pt"
        torch.save(real.state_dict(), init)
    x, _ = tokens(4)
    with Pipe(meta, chunks=2, split_points=["model.layers.1"], sample=x, workers=cluster.names[:2], init=init) as pipe:
        assert pipe.state_dict().keys() == real.state_dict().keys()
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value().logits, real(x).logits)


def test_llama_on_the_meta_device_names_its_non_persistent_buffer(cluster):
    torch.manual_seed(1)
    real = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))
    before = stages_on(cluster)
    with pytest.raises(ValueError, match=r"stage 0: \['0.graph.model.rotary_emb.inv_freq'.* are on the meta device "
                                         r"and not in the model's state_dict\(\) \(non-persistent buffers\)"):
        Pipe(meta, chunks=2, split_points=["model.layers.1"], sample=tokens(4)[0], workers=cluster.names[:2],
             init=real.state_dict())
    assert stages_on(cluster) == before


# -- the tiny GPT with init=None: reset on the workers ---------------------------------------------------------
def meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(vocab=64, d=32, heads=2, layers=4, context=8)


@pytest.fixture(scope="module")
def reset_gpts(cluster: Any) -> Iterator[list[Pipe]]:
    """Two 3-stage pipes of the meta tiny GPT with init=None, each built right after torch.manual_seed(5)."""
    sample = tokens(0, vocab=64)[0]
    pipes = []
    try:
        for _ in range(2):
            model = meta_gpt()
            torch.manual_seed(5)
            pipes.append(Pipe(model, chunks=2, split_points=["blocks.1", "blocks.3"], sample=sample, schedule="1F1B",
                              workers=cluster.names[:3]))
        yield pipes
    finally:
        for pipe in pipes:
            pipe.close()


def tied_copies(pipe: Pipe) -> list[Tensor]:
    """Each stage's copy of the tied embedding/head (stages 0 and 2), read on its worker."""
    assert pipe._captured is not None
    (tied,) = pipe._captured.tied
    assert sorted(tied.names) == [0, 2]
    states = stage_states(pipe)
    return [states[j][f"{j}.graph.{name}"] for j, name in sorted(tied.names.items())]


def test_init_none_resets_every_module_and_seeded_builds_repeat(reset_gpts):
    first, second = (pipe.state_dict() for pipe in reset_gpts)
    assert first.keys() == GPT().state_dict().keys()
    for key, value in first.items():
        assert torch.isfinite(value).all(), key
        torch.testing.assert_close(second[key], value, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    for key, value in first.items():  # each module's reset_parameters ran: its values, not empty memory
        if key.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
            assert torch.equal(value, torch.ones(32)), key
        elif key.endswith(("ln1.bias", "ln2.bias", "ln_f.bias")):
            assert torch.equal(value, torch.zeros(32)), key
        elif key in ("tok.weight", "head.weight", "pos.weight"):  # nn.Embedding: N(0, 1)
            assert 0.8 < value.std() < 1.2, (key, value.std())
        else:  # nn.Linear: weight and bias uniform within 1/sqrt(fan_in)
            bound = first[key.rpartition(".")[0] + ".weight"].shape[1] ** -0.5
            assert 0 < value.abs().max() <= bound and value.std() > bound / 4, key
    # seeded per module path: the same module type and shape in two places gets other values
    assert not torch.equal(first["blocks.0.attn.qkv.weight"], first["blocks.3.attn.qkv.weight"])


def test_init_none_tied_copies_agree_across_stages_and_after_a_step(reset_gpts):
    pipe = reset_gpts[0]
    stage0, stage2 = tied_copies(pipe)
    assert torch.equal(stage0, stage2)
    state = pipe.state_dict()
    assert torch.equal(state["tok.weight"], stage0) and torch.equal(state["head.weight"], stage0)
    opt = pipe.optimizer(torch.optim.SGD, lr=0.5)
    x, y = tokens(6, vocab=64)
    with dist_autograd.context() as ctx:
        pipe.train_step(ctx, x, y, logits_loss)
        opt.step(ctx)
    after0, after2 = tied_copies(pipe)
    assert not torch.equal(after0, stage0)  # the premise: the step moved it
    torch.testing.assert_close(after0, after2)
    plain = GPT(vocab=64, d=32, heads=2, layers=4, context=8)  # a real model holding the pipe's state computes
    plain.load_state_dict(pipe.state_dict())  # what the pipe does (strict: both names of the tied weight)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x).local_value(), plain(x))


# -- nn.Sequential on meta: init=None, a callable, a mapping, DCP -----------------------------------------------
def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())


def meta_mlp() -> nn.Sequential:
    with torch.device("meta"):
        return mlp()


def test_sequential_init_none_is_seeded_by_the_drivers_seed(cluster):
    states = []
    for seed in (1, 1, 2):
        model = meta_mlp()
        torch.manual_seed(seed)
        with Pipe(model, chunks=2, balance=[2, 2], workers=cluster.names[:2]) as pipe:
            states.append(pipe.state_dict())
            with torch.no_grad():
                assert torch.isfinite(pipe(torch.randn(4, 4)).local_value()).all()
    assert all(p.is_meta for p in model.parameters())  # the model given is left as it was
    assert states[0].keys() == mlp().state_dict().keys()
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key
        assert not torch.equal(states[0][key], states[2][key]), key
    assert states[0]["0.weight"].abs().max() <= 0.5 and states[0]["2.weight"].abs().max() <= 8 ** -0.5


def test_sequential_init_none_keeps_real_layers_and_resets_buffers(cluster):
    """Only what is on the meta device is reset: a real stage travels with its values; a BatchNorm on meta
    gets its running statistics reset (mean 0, variance 1, no batches). Real and meta parameters in one
    stage are refused, as PyTorch's Pipe refused parameters on two devices."""
    torch.manual_seed(3)
    real_first = nn.Linear(4, 8)
    with torch.device("meta"):
        rest = [nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)]
    model = nn.Sequential(real_first, *rest)
    with pytest.raises(ValueError, match="stage 0 has parameters on several devices"):
        Pipe(model, balance=[2, 2], workers=cluster.names[:2])
    with Pipe(model, balance=[1, 3], workers=cluster.names[:2]) as pipe:
        state = pipe.state_dict()
    assert torch.equal(state["0.weight"], real_first.weight) and torch.equal(state["0.bias"], real_first.bias)
    assert torch.equal(state["1.running_mean"], torch.zeros(8)) and torch.equal(state["1.running_var"], torch.ones(8))
    assert state["1.num_batches_tracked"].item() == 0 and state["1.num_batches_tracked"].dtype == torch.int64
    assert torch.equal(state["1.weight"], torch.ones(8)) and torch.equal(state["1.bias"], torch.zeros(8))
    assert 0 < state["3.weight"].abs().max() <= 8 ** -0.5


def test_sequential_init_callable_asks_each_worker_for_its_stage(cluster):
    stage_keys = [{"0.weight", "0.bias"}, {"2.weight", "2.bias"}]

    def init(like: dict[str, Tensor]) -> dict[str, Tensor]:
        # runs on the worker: only one stage's keys, as meta tensors of the model's shapes
        assert set(like) in stage_keys, sorted(like)
        assert all(t.is_meta and t.dtype == torch.float32 for t in like.values())
        out = {}
        for key, t in like.items():
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            out[key] = torch.randn(t.shape, generator=g)
        return out

    model = meta_mlp()
    expected = init({k: torch.empty_like(v, device="meta") for k, v in model.state_dict().items() if k[0] == "0"})
    expected |= init({k: torch.empty_like(v, device="meta") for k, v in model.state_dict().items() if k[0] == "2"})
    plain = mlp()
    plain.load_state_dict(expected)
    x = torch.randn(6, 4)
    with Pipe(model, chunks=3, balance=[2, 2], workers=cluster.names[:2], init=init) as pipe:
        assert_same_state(pipe.state_dict(), plain)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), plain(x))


def test_sequential_init_mapping_trains_as_the_plain_model(cluster):
    torch.manual_seed(4)
    plain = mlp()
    init = copy.deepcopy(plain.state_dict())
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g)) for _ in range(2)]
    with Pipe(meta_mlp(), chunks=4, balance=[2, 2], schedule="1F1B", workers=cluster.names[:2], init=init) as pipe:
        train_side_by_side(pipe, plain, batches, F.mse_loss)  # SGD with momentum: loss, gradients, parameters
    assert not torch.equal(init["0.weight"], plain[0].weight)  # the premise: training moved the plain model


def tied_in_one_stage() -> nn.Sequential:
    embedding, head = nn.Embedding(10, 6), nn.Linear(6, 10, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, head, nn.Linear(10, 3))


def test_a_parameter_tied_within_a_stage_stays_one_parameter(cluster):
    """An embedding and a head sharing their weight on stage 0 (a Mapping gives both keys): one tensor on the
    worker, so gradients sum into it and training matches the plain model."""
    torch.manual_seed(6)
    plain = tied_in_one_stage()
    with torch.device("meta"):
        meta = tied_in_one_stage()
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, 10, (4, 5), generator=g), torch.randn(4, 5, 3, generator=g)) for _ in range(2)]
    init = copy.deepcopy(plain.state_dict())  # both names of the tied weight
    with Pipe(meta, chunks=2, balance=[2, 1], workers=cluster.names[:2], init=init) as pipe:
        train_side_by_side(pipe, plain, batches, F.mse_loss)
        state = pipe.state_dict()
    assert torch.equal(state["0.weight"], state["1.weight"])


def test_a_parameter_tied_within_a_stage_loads_from_save_models_file(cluster, tmp_path):
    """``safetensors.torch.save_model`` writes a tied tensor once, under one of its names (as it writes the
    GPT-2 head, which loads above); ``safetensors.torch.load_model`` loads the file back into the model. A
    ``Pipe`` whose stage 0 holds both names must load it too."""
    torch.manual_seed(6)
    plain = tied_in_one_stage()
    save_model(plain, str(tmp_path / "tied.safetensors"))
    with safe_open(str(tmp_path / "tied.safetensors"), "pt") as f:
        assert len({"0.weight", "1.weight"} & set(f.keys())) == 1  # the premise: one name stored
    with torch.device("meta"):
        meta = tied_in_one_stage()
    x = torch.randint(0, 10, (4, 5))
    with Pipe(meta, chunks=2, balance=[2, 1], workers=cluster.names[:2], init=tmp_path / "tied.safetensors") as pipe:
        assert_same_state(pipe.state_dict(), plain)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), plain(x))


@pytest.mark.parametrize("build", ["torch.device('meta')", "meta_parameters()"])
def test_deferred_batch_norm_on_a_meta_model(cluster, build):
    """``deferred_batch_norm=True`` swaps each BatchNorm for rrefpipe's DeferredBatchNorm, whose accumulators
    (``sum``, ``sum_squares``, ``counted``) are its own non-persistent buffers, zero at the start: a meta
    model (parameters, or all tensors, on meta) builds from a state dict and computes what the real model
    does in eval mode; a BatchNorm's running statistics come from the checkpoint."""
    def model() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))

    torch.manual_seed(11)
    real = model()
    with torch.no_grad():
        real[1].running_mean.uniform_(-1, 1)
        real[1].running_var.uniform_(0.5, 2)
    with torch.device("meta") if build.startswith("torch") else rrefpipe.meta_parameters():
        meta = model()
    x = torch.randn(6, 4)
    with Pipe(meta, chunks=2, balance=[2, 2], workers=cluster.names[:2], deferred_batch_norm=True,
              init=real.state_dict()) as pipe:
        assert_same_state(pipe.state_dict(), real)
        pipe.eval()
        real.eval()
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), real(x))


def test_dcp_checkpoints_of_pipe_save_and_save_model(cluster, tmp_path):
    """A checkpoint a 2-stage pipe saved builds a 3-stage meta pipe; so does ``rrefpipe.save_model`` of the
    plain model with its optimizer's state (only the model's keys are read)."""
    torch.manual_seed(8)
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.Adam(plain.parameters())
    plain(torch.randn(2, 4)).sum().backward()
    opt.step()
    rrefpipe.save_model(tmp_path / "plain", plain, optimizer=opt, step=1)
    with Pipe(copy.deepcopy(plain), balance=[3, 2], workers=cluster.names[:2]) as saver:
        saver.save(tmp_path / "pipe")
    x = torch.randn(5, 4)
    for where in ("plain", "pipe"):
        with torch.device("meta"):
            meta = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        with Pipe(meta, balance=[1, 2, 2], workers=cluster.names[:3], init=tmp_path / where) as pipe:
            assert_same_state(pipe.state_dict(), plain)
            with torch.no_grad():
                torch.testing.assert_close(pipe(x).local_value(), plain(x))


# -- balancing a meta model on workers -----------------------------------------------------------------------
def uneven() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 256), nn.ReLU(),
                         nn.Linear(256, 256))


def test_balance_by_size_of_a_meta_model_is_the_real_models(cluster):
    torch.manual_seed(9)
    real = uneven()
    x = torch.randn(8, 8)
    expected = balance_by_size(2, real, x, chunks=2)
    assert expected != [4, 3] and expected != [3, 4]  # the premise: not what counting layers gives
    with torch.device("meta"):
        meta = uneven()
    for placement in ({"workers": cluster.names[:2]}, {"devices": ["cpu", "cpu"], "workers": cluster.names[:2]}):
        with Pipe(meta, chunks=2, balance="size", sample=x, init=real.state_dict(), **placement) as pipe:
            assert pipe.balance == expected, placement
            with torch.no_grad():
                torch.testing.assert_close(pipe(x).local_value(), real(x))


def test_balance_by_time_of_a_meta_model_is_refused(cluster):
    before = stages_on(cluster)
    with pytest.raises(ValueError, match="balance='time' times each layer's forward and backward, which needs real "
                                         "weights, and this model is on the meta device: use balance='size'"):
        Pipe(meta_mlp(), balance="time", sample=torch.randn(4, 4), workers=cluster.names[:2])
    assert stages_on(cluster) == before


# -- bad input: each named, nothing built ------------------------------------------------------------------------
class Scale(nn.Module):
    """A layer with a parameter and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(8), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.inv_freq


def with_layer(layer_type: type[nn.Module]) -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 8), layer_type(), nn.Linear(8, 8))


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints that do not fit ``mlp()``: another model's, a truncated shard, float16, another shape."""
    where = tmp_path_factory.mktemp("bad")
    save_model(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8)), str(where / "other.safetensors"))  # 0.*, 1.*
    state = mlp().state_dict()
    (where / "shards").mkdir()
    save_file({k: v for k, v in state.items() if k.startswith("0.")}, str(where / "shards" / "a.safetensors"))
    save_file({k: v for k, v in state.items() if k.startswith("2.")}, str(where / "shards" / "b.safetensors"))
    (where / "shards" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "a.safetensors" if k.startswith("0.") else "b.safetensors" for k in state}}))
    shard = where / "shards" / "b.safetensors"
    shard.write_bytes(shard.read_bytes()[:-16])  # the end of 2.weight's data is gone
    save_file({k: v.half() for k, v in state.items()}, str(where / "half.safetensors"))
    torch.save(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6), nn.Tanh()).state_dict(), where / "shape.pt")
    return where


def _made_here() -> Any:
    """An init callable made in a function (sent by value: the worker imports no test module) that gives
    stage 1's tensors the wrong shape."""
    def wrong_shape(like: dict[str, Tensor]) -> dict[str, Tensor]:
        return {k: torch.zeros(3) if k.startswith("2.") else torch.zeros(v.shape) for k, v in like.items()}
    return wrong_shape


_wrong_shape = _made_here()


BAD = [  # (id, Pipe's arguments but the workers, given the files' directory; exception type; message pattern)
    ("another model's checkpoint", lambda d: dict(init=d / "other.safetensors"), ValueError,
     r"Error\(s\) in loading the stages from the safetensors file .*other\.safetensors:\n\tMissing key\(s\) in "
     r"state_dict: \"2\.weight\", \"2\.bias\"\.\n\tUnexpected key\(s\) in state_dict: \"1\.(weight|bias)\", "
     r"\"1\.(weight|bias)\"\.\n"),
    ("truncated shard", lambda d: dict(init=d / "shards"), ValueError,
     r"cannot read .*shards/b\.safetensors \(in the safetensors shards of .*model\.safetensors\.index\.json\)"),
    ("missing file", lambda d: dict(init=d / "nowhere.safetensors"), ValueError,
     r"init='.*nowhere\.safetensors': no such file or directory"),
    ("float16 checkpoint", lambda d: dict(init=d / "half.safetensors"), ValueError,
     r"dtype mismatch for 0\.weight: the checkpoint holds torch\.float16, the model torch\.float32"),
    ("another shape", lambda d: dict(init=d / "shape.pt"), ValueError,
     r"size mismatch for 2\.weight: copying a param with shape \[6, 8\] from checkpoint, the shape in current "
     r"model is \[8, 8\]"),
    ("a mapping without a key", lambda d: dict(init={k: v for k, v in mlp().state_dict().items() if k != "2.bias"}),
     ValueError, r"Missing key\(s\) in state_dict: \"2\.bias\"\.\nNothing was loaded"),
    ("init of another type", lambda d: dict(init=3), TypeError, "init= takes a path, a mapping of tensors"),
    ("no reset_parameters", lambda d: dict(module=with_layer(Scale)), ValueError,
     r"init=None: '1\.gain' is on the meta device and its module '1' \(Scale\) has no reset_parameters\(\)"),
    ("a meta non-persistent buffer", lambda d: dict(module=with_layer(Rotary), init=d / "other.safetensors"),
     ValueError, r"stage 0: \['1\.inv_freq'\] are on the meta device and not in the model's state_dict\(\)"),
    ("a callable's wrong shape", lambda d: dict(init=_wrong_shape), StageError,
     r"stage 1 on worker 'worker2' failed in create_stage: ValueError: stage 1: init=.*wrong_shape does not fit the "
     r"model: '2\.weight' has shape \[3\] in the source, \[8, 8\] in the model"),
    ("a callable's missing key", lambda d: dict(init=lambda like: {k: torch.zeros(v.shape) for k, v in like.items()
                                                                   if k != "0.bias"}), StageError,
     r"stage 0 on worker 'worker1' .*'0\.bias' is missing"),
    ("a callable that raises on stage 1", lambda d: dict(init=lambda like: 1 / 0 if "2.weight" in like else {
        k: torch.zeros(v.shape) for k, v in like.items()}), StageError,
     r"stage 1 on worker 'worker2' .*ZeroDivisionError"),
]


@pytest.mark.parametrize("name, arguments, error, message", BAD, ids=[b[0] for b in BAD])
def test_bad_init(cluster, bad_files, name, arguments, error, message):
    kwargs = {"module": meta_mlp(), **arguments(bad_files)}
    module = kwargs.pop("module")
    before = stages_on(cluster)
    with pytest.raises(error, match=message):
        Pipe(module, balance=[2, len(module) - 2], workers=cluster.names[:2], **kwargs)
    assert stages_on(cluster) == before  # nothing built, or what was torn down


def test_after_the_errors_the_next_pipe_builds(cluster, bad_files):
    before = stages_on(cluster)
    torch.manual_seed(10)
    plain = mlp()
    x = torch.randn(4, 4)
    with Pipe(meta_mlp(), chunks=2, balance=[2, 2], workers=cluster.names[:2], init=plain.state_dict()) as pipe:
        assert stages_on(cluster)["worker1"] == before["worker1"] + 1
        with torch.no_grad():
            torch.testing.assert_close(pipe(x).local_value(), plain(x))
    assert stages_on(cluster) == before


# -- the driver never holds a large model -----------------------------------------------------------------------
WIDTH, LAYERS = 4096, 16  # 16 Linear(4096, 4096), fp32: 1.07 GB


def memory(field: str) -> int:
    """This process's ``VmRSS`` or ``VmHWM`` (its peak since the last reset), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def write_layer_shards(where: Path) -> dict[str, str]:
    """Each layer's weight and bias in its own shard, one layer at a time (64 MB held at most), and the
    index; the weights are row rotations of one random matrix (cheap to make, no two layers alike)."""
    g = torch.Generator().manual_seed(11)
    base = torch.empty(WIDTH, WIDTH).uniform_(-WIDTH ** -0.5, WIDTH ** -0.5, generator=g)
    weight_map = {}
    for i in range(LAYERS):
        name = f"model-{i + 1:05d}-of-{LAYERS:05d}.safetensors"
        save_file({f"{i}.weight": base.roll(i * 97, 0), f"{i}.bias": torch.full((WIDTH,), (i - 8) / 100)},
                  str(where / name))
        weight_map[f"{i}.weight"] = weight_map[f"{i}.bias"] = name
    (where / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


@pytest.mark.timeout(60)
def test_a_1gb_model_from_shards_leaves_the_drivers_memory_alone(cluster, tmp_path):
    where = tmp_path / "big"
    where.mkdir()
    try:
        weight_map = write_layer_shards(where)
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert model_bytes > 10 ** 9
        try:  # the peak from here on (Linux: writing 5 to clear_refs resets VmHWM)
            Path("/proc/self/clear_refs").write_text("5")
            peak_reset = True
        except OSError:
            peak_reset = False
        before = memory("VmRSS")
        with Pipe(model, balance=[8, 8], workers=cluster.names[:2], init=where) as pipe:
            grown = memory("VmRSS") - before
            peak = memory("VmHWM") - before if peak_reset else grown
            assert grown < model_bytes / 10 and peak < model_bytes / 10, (grown, peak, model_bytes)
            x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(12))
            with torch.no_grad():
                out = pipe(x).local_value()
        expected = x
        for i in range(LAYERS):  # layer by layer from the files: one layer in memory at a time
            with safe_open(str(where / weight_map[f"{i}.weight"]), "pt") as f:
                expected = F.linear(expected, f.get_tensor(f"{i}.weight"), f.get_tensor(f"{i}.bias"))
        assert torch.isfinite(out).all() and out.abs().max() > 0.1  # the premise: not a vanishing output
        torch.testing.assert_close(out, expected)
    finally:
        shutil.rmtree(where)  # 1 GB: not left to pytest's kept temporary directories
