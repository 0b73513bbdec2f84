"""Hugging Face ``transformers`` language models built from their default configs (only the sizes made small;
no download) through captured pipes on the session's workers are the plain models: GPT-2 cut between its
blocks into 2 and 3 stages, Llama, Qwen2 and BERT (a masked LM) into 2 or 3. For each: the output (the
model's ``ModelOutput`` class, not a bare tensor) and its logits, every parameter's gradient (an embedding
tied to the output head across the first and last stages: GPT-2, BERT), the state dict's keys, and the
parameters after a 1F1B ``train_step`` and an optimizer step; Qwen2 takes an attention mask too. The
configs keep ``use_cache=True``, the default: rrefpipe captures with ``use_cache=False`` and leaves the
model given to ``Pipe`` as it was; ``use_cache=True`` given explicitly is a CaptureError that says why.

Dropout draws other masks on the stage workers than in the plain model, so no two training runs could be
compared with it: each model's ``nn.Dropout`` modules get ``p=0`` after it is built (GPT-2 and BERT
default to 0.1; Llama and Qwen2 to 0). The config itself, which ``forward`` reads, stays default.

``transformers`` is in the ``test`` extras (it installs in about 12 s): without it this module fails.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer

import rrefpipe.optim
from rrefpipe import CaptureError, Pipe
from rrefpipe.capture import capture
from tests.distributed.probes import stage_gradients
from tests.distributed.test_train_step import assert_same_state

try:
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM)
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, CausalLMOutputWithPast, MaskedLMOutput
except ImportError as e:  # a failure, not a skip: the extras promise it
    raise ImportError("tests/test_any_model_hf.py needs transformers, part of the test extras: "
                      "pip install -e '.[test]'") from e

pytestmark = pytest.mark.timeout(120)

VOCAB, BATCH, LENGTH, CHUNKS = 128, 8, 8, 4
CACHE = {"cache", "past_key_values"}  # the output's cache field (named past_key_values before transformers 5)
SIZES = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=32)


class Case(NamedTuple):
    build: Callable[[], PreTrainedModel]
    split_points: list[str]
    output: type
    padded: bool = False  # an attention mask, padding the ends of some rows, as forward's second argument


def gpt2() -> PreTrainedModel:
    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32))


def llama() -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_key_value_heads=1, **SIZES))


def qwen2() -> PreTrainedModel:
    return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, num_key_value_heads=1, **SIZES))


def bert() -> PreTrainedModel:
    return BertForMaskedLM(BertConfig(num_hidden_layers=2, **SIZES))


CASES = {
    "gpt2-2stages": Case(gpt2, ["transformer.h.1"], CausalLMOutputWithCrossAttentions),
    "gpt2-3stages": Case(gpt2, ["transformer.h.1", "transformer.h.2"], CausalLMOutputWithCrossAttentions),
    "llama-2stages": Case(llama, ["model.layers.1"], CausalLMOutputWithPast),
    "qwen2-3stages": Case(qwen2, ["model.layers.1", "model.norm"], CausalLMOutputWithPast, padded=True),
    "bert-3stages": Case(bert, ["bert.encoder.layer.1", "cls"], MaskedLMOutput),  # the tied decoder: stage 2
}


def model(case: Case) -> PreTrainedModel:
    """The case's model, its dropout off (see the module's docstring)."""
    torch.manual_seed(0)
    built = case.build()
    for m in built.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return built


def lm_loss(out: Any, target: Tensor) -> Tensor:
    """Cross entropy of the model's whole output (a ModelOutput), as a user's loss_fn takes it."""
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def batch(case: Case, seed: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """The model's positional arguments (the tokens, and the attention mask where the case has one) and
    the target."""
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g) for _ in range(2))
    if not case.padded:
        return (x,), y
    mask = torch.ones_like(x)
    mask[1, LENGTH - 3:] = 0
    mask[seed % BATCH, 1:] = 0  # another row in each batch, padded after its first token
    return (x, mask), y


def one(args: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    """``args`` as ``train_step`` takes an input: a tensor, or a tuple of tensors."""
    return args[0] if len(args) == 1 else args


def snapshot(m: nn.Module) -> dict[str, Any]:
    """What building a pipe must leave as it was: each module's attributes (by identity: none replaced,
    added or removed, ``training`` and ``forward`` included), the config's values, and the parameters and
    buffers (the same tensors, with the same values)."""
    config = getattr(m, "config", None)
    return {"attributes": {path: {k: id(v) for k, v in vars(sub).items()} for path, sub in m.named_modules()},
            "training": {path: sub.training for path, sub in m.named_modules()},
            "config": config.to_dict() if config is not None else None,
            "tensors": {k: (id(v), v.detach().clone()) for k, v in m.state_dict(keep_vars=True).items()}}


class Built(NamedTuple):
    case: Case
    pipe: Pipe
    plain: PreTrainedModel  # stepped along with the pipe by the tests that step it
    given: PreTrainedModel  # the object given to Pipe
    before: dict[str, Any]  # its snapshot before


@pytest.fixture(scope="module", params=sorted(CASES))
def built(request: pytest.FixtureRequest, cluster: Any) -> Iterator[Built]:
    """A pipe of the case's model on the last session workers, the plain model it must stay equal to, and
    the object given to ``Pipe`` with its snapshot from before. Every case's last stage is on the same
    worker, which imports this module (and transformers with it) for ``lm_loss`` once, not once per case."""
    case = CASES[request.param]
    plain = model(case)
    given = copy.deepcopy(plain)
    before = snapshot(given)
    pipe = Pipe(given, chunks=CHUNKS, split_points=case.split_points, sample=batch(case, 0)[0], schedule="1F1B",
                workers=cluster.names[-len(case.split_points) - 1:])
    try:
        assert len(pipe.stages) == len(case.split_points) + 1
        yield Built(case, pipe, plain, given, before)
    finally:
        pipe.close()


def model_gradients(pipe: Pipe, grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """The stages' gradients (``'<j>.graph.<name>'``) under the plain model's keys; each copy of a tied
    parameter must carry the same (summed) gradient."""
    assert pipe._captured is not None
    out: dict[str, Tensor] = {}
    for j, names in enumerate(pipe._captured.state_keys):
        for name, keys in names.items():
            grad = grads.get(f"{j}.graph.{name}")
            for key in keys if grad is not None else ():
                if key in out:
                    torch.testing.assert_close(grad, out[key],
                                               msg=lambda m, key=key, j=j: f"copy of {key} on stage {j}: {m}")
                out[key] = grad
    return out


def assert_model_gradients(grads: dict[str, Tensor], plain: nn.Module) -> None:
    """Every key of a parameter of ``plain`` (both names of a tied one) has its gradient in ``grads``, and
    no more."""
    expected = {name: p.grad for name, p in plain.named_parameters(remove_duplicate=False)}
    assert all(g is not None for g in expected.values()), "the test's premise: every parameter gets a gradient"
    assert grads.keys() == expected.keys(), (sorted(grads), sorted(expected))
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, name=name: f"{name}: {m}")


def test_the_model_given_to_pipe_is_unchanged(built):
    after = snapshot(built.given)
    assert after["config"] == built.before["config"]
    assert after["attributes"] == built.before["attributes"]
    assert after["training"] == built.before["training"]
    assert after["tensors"].keys() == built.before["tensors"].keys()
    for key, (identity, value) in built.before["tensors"].items():
        assert after["tensors"][key][0] == identity, key
        torch.testing.assert_close(after["tensors"][key][1], value)
    assert built.given.config.use_cache is True  # the default, kept
    if CACHE & {f.name for f in dataclasses.fields(built.case.output)}:  # the causal LMs still return their cache
        with torch.no_grad():
            assert CACHE & built.given(*batch(built.case, 1)[0]).keys()


def test_output_is_the_models_model_output(built):
    pipe, plain = built.pipe, built.plain
    x, _ = batch(built.case, 1)
    with torch.no_grad():
        out, expected = pipe(*x).local_value(), plain(*x)
    assert type(out) is type(expected) is built.case.output
    assert out.keys() == expected.keys() - CACHE  # rrefpipe captures with use_cache=False: no cache
    torch.testing.assert_close(out.logits, expected.logits)
    assert pipe.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.filterwarnings("ignore:Pipe.schedule='1F1B'.. pipe.x. followed by pipe.backward:UserWarning")  # expected
def test_gradients_equal_the_plain_models(built):
    pipe, plain = built.pipe, built.plain
    x, y = batch(built.case, 2)
    plain.zero_grad()
    lm_loss(plain(*x), y).backward()
    with dist_autograd.context() as ctx:
        out = pipe(*x).local_value()
        loss = lm_loss(out, y)  # on the driver, from the rebuilt ModelOutput
        pipe.backward(ctx, loss)
        grads = model_gradients(pipe, stage_gradients(pipe, ctx))
    assert_model_gradients(grads, plain)


def test_train_step_and_optimizer_step_as_the_plain_model(built):
    pipe, plain = built.pipe, built.plain
    x, y = batch(built.case, 3)
    opt = DistributedOptimizer(rrefpipe.optim.SGD, pipe.parameter_rrefs(), lr=0.5)  # no TorchScript twin
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    plain_opt.zero_grad()
    plain_loss = lm_loss(plain(*x), y)
    plain_loss.backward()
    with dist_autograd.context() as ctx:
        loss = pipe.train_step(ctx, one(x), y, lm_loss)
        grads = model_gradients(pipe, stage_gradients(pipe, ctx))
        opt.step(ctx)
    plain_opt.step()
    torch.testing.assert_close(loss, plain_loss.detach())
    assert_model_gradients(grads, plain)
    assert_same_state(pipe.state_dict(), plain)  # the first copy of a tied weight...
    with torch.no_grad():  # ...and the last stage's, which computes the logits
        torch.testing.assert_close(pipe(*x).local_value().logits, plain(*x).logits)


def test_use_cache_true_given_is_a_capture_error_that_says_why():
    one_block = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32))
    x = batch(CASES["gpt2-2stages"], 0)[0][0]
    with pytest.raises(CaptureError, match=r"cannot capture GPT2LMHeadModel .*DynamicCache.* What to do: forward "
                                           r"returns a Hugging Face key/value cache, which serves generation .*"
                                           r"leave use_cache out of the call .*Pipe.from_factories"):
        capture(one_block, (x,), {"use_cache": True}, split_points=["transformer.h.0.mlp"])
