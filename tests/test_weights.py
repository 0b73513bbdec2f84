"""Where a meta model's weights come from (``rrefpipe.weights``), checked in this process without stage
workers: each source ``Pipe(init=...)`` opens (a safetensors file, Hugging Face shards, a torch.save file
or a ``pytorch_model.bin`` directory, a DCP checkpoint, a mapping, a callable) says what it holds (its
catalog: keys, shapes, dtypes, read from headers) and reads exactly the keys asked of it; paths it cannot
use (missing, truncated, an empty directory, a broken index) are ValueErrors naming the file;
``meta_parameters()`` puts parameters, not buffers, on the meta device and always undoes its patch;
``init=None``'s reset is seeded by the module's path and reports a module without ``reset_parameters``;
``balance='size'`` measures a meta model as the real one and ``balance='time'`` refuses it; and in a world
of one (RPC with this process only) ``init=`` and meta models are a ValueError.

The multi-process tests (pipes built from these sources on stage workers) are in
tests/distributed/test_meta_init.py."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file, save_model
from torch import Tensor, nn

import rrefpipe
from rrefpipe.balance import balance_for_pipe
from rrefpipe.balance.profile import layer_sizes
from rrefpipe.weights import (DCPCheckpoint, InMemory, Initializer, Reset, SafetensorsFiles, TensorMeta, TorchFile,
                              open_source, reset_owners)
from tests.conftest import run_script


def mixed() -> nn.Sequential:
    """Layers of several kinds and sizes, with buffers (BatchNorm) and an int64 one (num_batches_tracked)."""
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 64), nn.Tanh(),
                         nn.Linear(64, 4))


@pytest.fixture(scope="module")
def real() -> nn.Sequential:
    torch.manual_seed(0)
    return mixed()


def catalog_of(state: dict[str, Tensor]) -> dict[str, TensorMeta]:
    return {k: TensorMeta(tuple(v.shape), v.dtype) for k, v in state.items()}


def write_shards(state: dict[str, Tensor], where: Path, per_file: int = 2) -> Path:
    """``state`` as Hugging Face shards (``per_file`` tensors each) with ``model.safetensors.index.json``."""
    where.mkdir(parents=True, exist_ok=True)
    keys = list(state)
    weight_map = {}
    for n, start in enumerate(range(0, len(keys), per_file)):
        name = f"model-{n:05d}.safetensors"
        save_file({k: state[k].contiguous() for k in keys[start:start + per_file]}, str(where / name))
        weight_map.update((k, name) for k in keys[start:start + per_file])
    (where / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return where


def assert_reads(source, state: dict[str, Tensor], keys: list[str]) -> None:
    """``source.read`` of ``keys`` (by the model's keys, stored under the same) gives exactly those values."""
    like = {k: torch.empty(state[k].shape, dtype=state[k].dtype, device="meta") for k in keys}
    got = source.read({k: k for k in keys}, like)
    assert sorted(got) == sorted(keys)
    for k in keys:
        assert got[k].device.type == "cpu"
        torch.testing.assert_close(got[k], state[k], msg=lambda m, k=k: f"{k}: {m}")


# -- each source: what it holds, and reading a part of it ------------------------------------------------------
def test_safetensors_file(real, tmp_path):
    path = tmp_path / "model.safetensors"
    save_model(real, str(path))
    state = real.state_dict()
    source = open_source(str(path))
    assert isinstance(source, SafetensorsFiles) and str(path) in source.describe()
    assert source.catalog() == catalog_of(state)  # num_batches_tracked: int64, a 0-d shape
    assert_reads(source, state, ["3.weight", "1.running_var", "1.num_batches_tracked"])
    assert isinstance(open_source(tmp_path), SafetensorsFiles)  # a directory holding model.safetensors


def test_hugging_face_shards(real, tmp_path):
    state = real.state_dict()
    where = write_shards(state, tmp_path / "shards")
    assert len(list(where.glob("*.safetensors"))) > 3  # the premise: several files
    for init in (where, where / "model.safetensors.index.json"):
        source = open_source(init)
        assert isinstance(source, SafetensorsFiles) and "shards" in source.describe()
        assert source.catalog() == catalog_of(state)
    assert_reads(source, state, ["0.weight", "5.bias", "1.running_mean"])  # from three files


def test_hugging_face_save_pretrained_shards(tmp_path):
    """What ``save_pretrained(max_shard_size=...)`` writes: an index and its shards, the tied head once."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32))
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    catalog = open_source(tmp_path).catalog()
    state = model.state_dict()
    assert set(catalog) < set(state) and set(state) - set(catalog) <= {"lm_head.weight", "transformer.wte.weight"}
    assert all(catalog[k] == TensorMeta(tuple(state[k].shape), state[k].dtype) for k in catalog)


def test_torch_save_file_and_pytorch_model_bin(real, tmp_path):
    state = real.state_dict()
    torch.save(state, tmp_path / "weights.pt")
    (tmp_path / "hf").mkdir()
    torch.save(state, tmp_path / "hf" / "pytorch_model.bin")
    for init in (tmp_path / "weights.pt", tmp_path / "hf"):
        source = open_source(init)
        assert isinstance(source, TorchFile)
        assert source.catalog() == catalog_of(state)
        assert_reads(source, state, ["0.bias", "1.running_mean", "5.weight"])


def test_dcp_checkpoint_under_model_and_at_the_top(real, tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {k: v.clone() for k, v in real.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled...": one process, as meant
        dcp.save({"model": state, "step": torch.tensor(3)}, checkpoint_id=str(tmp_path / "prefixed"), no_dist=True)
        dcp.save(state, checkpoint_id=str(tmp_path / "top"), no_dist=True)
    for where in ("prefixed", "top"):
        source = open_source(tmp_path / where)
        assert isinstance(source, DCPCheckpoint)
        assert source.catalog() == catalog_of(state), where  # "step", outside model., is not the model's
        assert_reads(source, state, ["3.weight", "1.running_var"])


def test_mapping_sends_each_stage_only_its_keys(real):
    state = real.state_dict()
    source = open_source(state)
    assert isinstance(source, InMemory) and source.catalog() == catalog_of(state)
    part = source.for_keys(["0.weight", "0.bias", "not-there"])
    assert isinstance(part, InMemory) and sorted(part.tensors) == ["0.bias", "0.weight"]
    assert_reads(part, state, ["0.weight"])


def test_callable_is_given_meta_tensors_of_the_wanted_shapes():
    seen = {}

    def init(like):
        seen.update(like)
        return {k: torch.full(v.shape, 2.0, dtype=v.dtype) for k, v in like.items()} | {"extra": torch.zeros(1)}

    source = open_source(init)
    assert isinstance(source, Initializer) and source.catalog() is None and "init" in source.describe()
    like = {"a.weight": torch.empty(3, 2, device="meta"), "a.bias": torch.empty(3, dtype=torch.float64, device="meta")}
    got = source.read({"a.weight": "a.weight", "a.bias": "a.bias"}, like)
    assert sorted(got) == ["a.bias", "a.weight"]  # the extra key is dropped
    assert all(t.is_meta for t in seen.values()) and {k: (v.shape, v.dtype) for k, v in seen.items()} == {
        "a.weight": (torch.Size([3, 2]), torch.float32), "a.bias": (torch.Size([3]), torch.float64)}
    assert torch.equal(got["a.weight"], torch.full((3, 2), 2.0))
    with pytest.raises(TypeError, match="returned a list, not a mapping"):
        Initializer(lambda like: [1]).read({"a.weight": "a.weight"}, like)


# -- paths that cannot be used ---------------------------------------------------------------------------------
def test_missing_path_empty_directory_and_wrong_type(tmp_path):
    with pytest.raises(ValueError, match=r"init='.*nowhere\.safetensors': no such file or directory"):
        open_source(str(tmp_path / "nowhere.safetensors"))
    with pytest.raises(ValueError, match="the directory holds no checkpoint rrefpipe reads"):
        open_source(tmp_path)
    with pytest.raises(TypeError, match="init= takes a path, a mapping of tensors, a callable or None, got int"):
        open_source(3)


def test_truncated_shard_is_named(real, tmp_path):
    where = write_shards(real.state_dict(), tmp_path / "shards")
    victim = where / "model-00001.safetensors"
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(ValueError, match=rf"cannot read {victim} \(in the safetensors shards of .*\): "):
        open_source(where).catalog()
    victim.write_bytes(b"")  # nothing at all
    with pytest.raises(ValueError, match=rf"cannot read {victim}"):
        open_source(where).catalog()


def test_truncated_single_file_and_torch_file(real, tmp_path):
    path = tmp_path / "model.safetensors"
    save_model(real, str(path))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"cannot read {path} \(in the safetensors file {path}\)"):
        open_source(path).catalog()
    pt = tmp_path / "weights.pt"
    torch.save(real.state_dict(), pt)
    pt.write_bytes(pt.read_bytes()[:200])
    with pytest.raises(ValueError, match=rf"cannot read {pt} \(in the torch.save file {pt}\)"):
        open_source(pt).catalog()


def test_broken_index(real, tmp_path):
    where = write_shards(real.state_dict(), tmp_path / "shards")
    index = where / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"]["ghost.weight"] = "model-00000.safetensors"  # a key its file does not hold
    index.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"names \['ghost.weight'\] in its index, which its files do not hold"):
        open_source(where).catalog()
    content["weight_map"]["ghost.weight"] = "model-09999.safetensors"  # a file that is not there
    index.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=r"cannot read .*model-09999\.safetensors"):
        open_source(where).catalog()
    index.write_text("{not json")
    with pytest.raises(ValueError, match=rf"cannot read the index {index}: JSONDecodeError"):
        open_source(where)


# -- meta_parameters -------------------------------------------------------------------------------------------
class WithRotary(nn.Module):
    """A non-persistent buffer computed in ``__init__`` (as a rotary embedding's ``inv_freq``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, 2).float() / 4), persistent=False)
        self.norm = nn.BatchNorm1d(4)


def test_meta_parameters_puts_parameters_on_meta_and_keeps_buffers_real():
    with rrefpipe.meta_parameters():
        model = WithRotary()
    assert all(p.is_meta and isinstance(p, nn.Parameter) for p in model.parameters())
    assert [n for n, _ in model.named_parameters()] == ["proj.weight", "proj.bias", "norm.weight", "norm.bias"]
    assert not any(b.is_meta for b in model.buffers())
    torch.testing.assert_close(model.inv_freq, torch.tensor([1.0, 0.01]))
    assert torch.equal(model.norm.running_var, torch.ones(4))
    assert not nn.Linear(2, 2).weight.is_meta  # undone after the block


def test_meta_parameters_keeps_requires_grad_and_ties():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight
            self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    with rrefpipe.meta_parameters():
        model = Tied()
    assert model.head.weight is model.emb.weight and model.emb.weight.is_meta
    assert model.frozen.is_meta and not model.frozen.requires_grad


def test_meta_parameters_is_undone_when_the_model_raises():
    register = nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="boom"), rrefpipe.meta_parameters():
        nn.Linear(2, 2)
        raise RuntimeError("boom")
    assert nn.Module.register_parameter is register
    assert not nn.Linear(2, 2).weight.is_meta


# -- init=None: reset_parameters on the worker -----------------------------------------------------------------
def test_reset_is_seeded_by_the_module_path_and_the_seed():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    keys = ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    like = dict(model.state_dict())

    def read(seed: int, paths=("0", "1", "2")) -> dict[str, Tensor]:
        owners = reset_owners(model, keys)
        assert sorted(owners) == ["0", "1", "2"] and all(not o._modules for o in owners.values())
        wanted = [k for k in keys if k.split(".")[0] in paths]
        return Reset(owners, seed).for_keys(wanted).read({k: k for k in wanted}, like)

    first, again, other = read(7), read(7), read(8)
    assert sorted(first) == sorted(keys)
    for k in keys:
        assert torch.equal(first[k], again[k]), k  # seeded runs repeat
    assert not torch.equal(first["0.weight"], other["0.weight"])  # another seed, other values
    assert not torch.equal(first["0.weight"], first["1.weight"])  # another path, other values (same shapes)
    assert torch.equal(read(7, paths=("1",))["1.weight"], first["1.weight"])  # one module read alone: the same
    bound = 1 / 8 ** 0.5  # nn.Linear's reset: kaiming-uniform, bound 1/sqrt(fan_in)
    assert 0 < first["0.weight"].abs().max() <= bound and first["0.weight"].std() > bound / 4
    assert torch.equal(first["2.weight"], torch.ones(8)) and torch.equal(first["2.bias"], torch.zeros(8))
    assert all(p.is_meta for p in model.parameters())  # the model itself is left on meta


def test_reset_names_a_module_without_reset_parameters():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(ValueError, match=r"init=None: '1.gain' is on the meta device and its module '1' \(Scale\) "
                                         r"has no reset_parameters\(\)"):
        reset_owners(model, ["0.weight", "1.gain"])


# -- balancing a meta model --------------------------------------------------------------------------------------
def test_balance_by_size_measures_a_meta_model_as_the_real_one(real):
    with torch.device("meta"):
        meta = mixed()
    x = torch.randn(16, 6)
    sizes = layer_sizes(meta, x, chunks=2)
    assert sizes == layer_sizes(real, x, chunks=2) and sum(sizes) > 0
    for stages in (2, 3):
        balance = balance_for_pipe("size", meta, x, chunks=2, workers=["a"] * stages, devices=None)
        assert balance == balance_for_pipe("size", real, x, chunks=2, workers=["a"] * stages, devices=None)
    assert balance_for_pipe("size", meta, x, chunks=2, workers=None, devices=["cpu", "cpu"]) == \
        balance_for_pipe("size", real, x, chunks=2, workers=None, devices=["cpu", "cpu"])
    assert all(p.is_meta for p in meta.parameters())


def test_balance_by_time_refuses_a_meta_model():
    with torch.device("meta"):
        meta = mixed()
    with pytest.raises(ValueError, match="balance='time' times each layer's forward and backward, which needs real "
                                         "weights, and this model is on the meta device"):
        balance_for_pipe("time", meta, torch.randn(8, 6), chunks=1, workers=["a", "b"], devices=None)


# -- a world of one ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_world_of_one_refuses_init_and_meta_models():
    """One process in its RPC group has no worker to build a stage on: ``init=`` (even with a real model) and
    a model on the meta device are ValueErrors that say so; the real model without ``init`` still runs."""
    proc = run_script("""
        import os, torch
        import torch.distributed.rpc as rpc
        from torch import nn
        from rrefpipe import Pipe
        from workers.launch import free_port
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        rpc.init_rpc("solo", rank=0, world_size=1)
        real = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        with torch.device("meta"):
            meta = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        for model, init in ((meta, None), (meta, real.state_dict()), (real, real.state_dict())):
            try:
                Pipe(model, balance=[1, 1], init=init)
            except ValueError as e:
                assert "this RPC group has only this process" in str(e), e
                print("refused")
        with Pipe(real, balance=[1, 1]) as pipe:
            print("runs", torch.equal(pipe(torch.ones(2, 4)).local_value(), real(torch.ones(2, 4))))
        rpc.shutdown()
    """)
    assert proc.stdout.split() == ["refused"] * 3 + ["runs", "True"], proc.stdout + proc.stderr
