"""A Hugging Face ``transformers`` causal LM (GPT-2, built from its config: no download) through a captured
pipe, cut between its blocks into 2 and 3 stages on the session's workers, is the plain model: the output
(a ``CausalLMOutputWithCrossAttentions``, not a bare tensor) and its logits, every parameter's gradient
(the embedding ``transformer.wte`` tied to ``lm_head`` across the first and last stages), the state dict's
keys, and the parameters after a 1F1B ``train_step`` and an optimizer step.

``transformers`` is in the ``test`` extras (it installs in about 12 s): without it this module fails.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.optim import DistributedOptimizer

from rrefpipe import Pipe
from tests.distributed.probes import stage_gradients
from tests.distributed.test_train_step import assert_same_state

try:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
except ImportError as e:  # a failure, not a skip: the extras promise it
    raise ImportError("tests/test_any_model_hf.py needs transformers, part of the test extras: "
                      "pip install -e '.[test]'") from e

pytestmark = pytest.mark.timeout(120)

VOCAB, BATCH, LENGTH, CHUNKS = 100, 8, 8, 4
SPLITS = {2: ["transformer.h.1"], 3: ["transformer.h.1", "transformer.h.2"]}  # stages -> where they begin


def gpt2() -> GPT2LMHeadModel:
    """Three small blocks, no dropout (so the pipe's recomputation and micro-batches match the whole run)."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, use_cache=False,
                        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def lm_loss(out: Any, target: Tensor) -> Tensor:
    """Cross entropy of the model's whole output (a ModelOutput), as a user's loss_fn takes it."""
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def tokens(seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g), torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)


@pytest.fixture(scope="module", params=sorted(SPLITS), ids=lambda n: f"{n}stages")
def pipe_and_plain(request: pytest.FixtureRequest, cluster: Any) -> Iterator[tuple[Pipe, GPT2LMHeadModel]]:
    """A pipe of the model on the first n session workers, and the plain model it must stay equal to (a
    test that steps one steps the other)."""
    n = request.param
    model = gpt2()
    pipe = Pipe(copy.deepcopy(model), chunks=CHUNKS, split_points=SPLITS[n], sample=tokens(0)[0],
                schedule="1F1B", workers=cluster.names[:n])
    try:
        assert len(pipe.stages) == n
        yield pipe, model
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


def assert_model_gradients(grads: dict[str, Tensor], plain: GPT2LMHeadModel) -> None:
    """Every key of a parameter of ``plain`` (both tied names) has its gradient in ``grads``, and no more."""
    expected = {name: p.grad for name, p in plain.named_parameters(remove_duplicate=False)}
    assert all(g is not None for g in expected.values()), "the test's premise: every parameter gets a gradient"
    assert grads.keys() == expected.keys(), (sorted(grads), sorted(expected))
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, name=name: f"{name}: {m}")


def test_output_is_the_models_model_output(pipe_and_plain):
    pipe, plain = pipe_and_plain
    x, _ = tokens(1)
    with torch.no_grad():
        out, expected = pipe(x).local_value(), plain(x)
    assert type(out) is type(expected) is CausalLMOutputWithCrossAttentions
    assert out.keys() == expected.keys()
    torch.testing.assert_close(out.logits, expected.logits)
    assert pipe.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.filterwarnings("ignore:Pipe.schedule='1F1B'.. pipe.x. followed by pipe.backward:UserWarning")  # expected
def test_gradients_equal_the_plain_models(pipe_and_plain):
    pipe, plain = pipe_and_plain
    x, y = tokens(2)
    plain.zero_grad()
    lm_loss(plain(x), y).backward()
    with dist_autograd.context() as ctx:
        out = pipe(x).local_value()
        loss = lm_loss(out, y)  # on the driver, from the rebuilt ModelOutput
        pipe.backward(ctx, loss)
        grads = model_gradients(pipe, stage_gradients(pipe, ctx))
    assert_model_gradients(grads, plain)


def test_train_step_and_optimizer_step_as_the_plain_model(pipe_and_plain):
    pipe, plain = pipe_and_plain
    x, y = tokens(3)
    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    plain_opt.zero_grad()
    plain_loss = lm_loss(plain(x), y)
    plain_loss.backward()
    with dist_autograd.context() as ctx:
        loss = pipe.train_step(ctx, x, y, lm_loss)
        grads = model_gradients(pipe, stage_gradients(pipe, ctx))
        opt.step(ctx)
    plain_opt.step()
    torch.testing.assert_close(loss, plain_loss.detach())
    assert_model_gradients(grads, plain)
    assert_same_state(pipe.state_dict(), plain)  # the first copy of the tied weight...
    with torch.no_grad():  # ...and the last stage's, which computes the logits
        torch.testing.assert_close(pipe(x).local_value().logits, plain(x).logits)
