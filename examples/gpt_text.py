"""Train the GPT-style model of examples/tiny_gpt.py on a small text, character by character, through a
pipe cut at named blocks, and check it against the same training in plain PyTorch.

    python examples/gpt_text.py --steps 30 --chunks 4 --split-points blocks.1 blocks.3
    python examples/gpt_text.py --steps 300      # the continuation begins to show words ("she", "the")

The model is a plain ``nn.Module`` (embeddings, blocks in an ``nn.ModuleList``, a head tied to the token
embedding, a long skip), not an ``nn.Sequential``: ``Pipe(model, chunks, split_points=[...], sample=x,
schedule="1F1B")`` captures it with ``torch.export`` and starts one local stage worker per stage, each
stage beginning at the first operation of a named submodule. It trains with ``pipe.train_step`` and
``DistributedOptimizer`` (AdamW) while a copy of the same weights trains on the same batches in this
process; every loss of the first ``--compare-steps`` steps and the parameters after them must match
(``head.weight`` and ``tok.weight`` included: the pipe sums the gradients of the tied copies). Later
steps are not compared: the pipe adds up each batch's gradients in another order, and such rounding
differences grow over a few dozen AdamW steps, as between any two ways of computing the same batch.
After training, the pipe switches to eval mode (its eval-mode graphs) and continues a prompt, drawing
each character from its predicted distribution with a seeded generator; the plain model loaded with
the pipe's ``state_dict()`` must give the same logits and draw the same characters. Exits with status 1
on a mismatch.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.optim import DistributedOptimizer

from tiny_gpt import GPT  # examples/, next to this script (the stage workers need no model code)

from rrefpipe import Pipe
from rrefpipe.__main__ import CHECKPOINT_HELP

# The opening of Lewis Carroll's "Alice's Adventures in Wonderland" (1865, public domain).
TEXT = """\
Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do:
once or twice she had peeped into the book her sister was reading, but it had no pictures or
conversations in it, "and what is the use of a book," thought Alice "without pictures or conversations?"
So she was considering in her own mind (as well as she could, for the hot day made her feel very sleepy
and stupid), whether the pleasure of making a daisy-chain would be worth the trouble of getting up and
picking the daisies, when suddenly a White Rabbit with pink eyes ran close by her.
There was nothing so very remarkable in that; nor did Alice think it so very much out of the way to hear
the Rabbit say to itself, "Oh dear! Oh dear! I shall be late!" (when she thought it over afterwards, it
occurred to her that she ought to have wondered at this, but at the time it all seemed quite natural);
but when the Rabbit actually took a watch out of its waistcoat-pocket, and looked at it, and then
hurried on, Alice started to her feet, for it flashed across her mind that she had never before seen a
rabbit with either a waistcoat-pocket, or a watch to take out of it, and burning with curiosity, she ran
across the field after it, and fortunately was just in time to see it pop down a large rabbit-hole under
the hedge.
"""

Batches = list[tuple[Tensor, Tensor]]


class Chars:
    """The text's characters as token ids, and back."""

    def __init__(self, text: str) -> None:
        self.alphabet = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.alphabet)}

    def encode(self, text: str) -> Tensor:
        return torch.tensor([self.index[c] for c in text])

    def decode(self, ids: Tensor) -> str:
        return "".join(self.alphabet[i] for i in ids.tolist())


def batches(data: Tensor, steps: int, batch_size: int, context: int, seed: int = 0) -> Batches:
    """Random windows of the text: each target is its input shifted by one character."""
    g = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=g)
        windows = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
        result.append((windows[:, :-1], windows[:, 1:]))
    return result


def make_model(vocab: int, args: argparse.Namespace) -> GPT:
    """GPT-2's small initial embeddings: the tied head then starts near uniform predictions."""
    torch.manual_seed(0)
    model = GPT(vocab=vocab, d=args.width, heads=args.heads, layers=args.layers, context=args.context)
    for embedding in (model.tok, model.pos):
        nn.init.normal_(embedding.weight, std=0.02)
    return model


def next_char_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def train_pipe(pipe: Pipe, data: Batches, adamw: dict[str, Any], log_every: int, snapshot_after: int
               ) -> tuple[list[Tensor], dict[str, Tensor]]:
    """The losses, and the pipe's state dict after ``snapshot_after`` steps."""
    opt = DistributedOptimizer(torch.optim.AdamW, pipe.parameter_rrefs(), **adamw)
    losses = []
    snapshot: dict[str, Tensor] = {}
    for step, (x, y) in enumerate(data, 1):
        with dist_autograd.context() as ctx:
            loss = pipe.train_step(ctx, x, y, next_char_loss)  # 1F1B over the micro-batches; tied grads summed
            opt.step(ctx)
        losses.append(loss.detach())
        if step == snapshot_after:
            snapshot = pipe.state_dict()  # the model's keys: tok.weight and head.weight hold one tensor
        if step % log_every == 0 or step == 1:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    return losses, snapshot


def train_plain(model: nn.Module, data: Batches, adamw: dict[str, Any]) -> list[Tensor]:
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = next_char_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def logits_of(model: nn.Module | Pipe, ids: Tensor) -> Tensor:
    out = model(ids)
    return out.local_value() if isinstance(model, Pipe) else out


def continue_text(model: nn.Module | Pipe, prompt: Tensor, length: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A continuation of each prompt, sampled with a seeded generator (so that equal models draw alike),
    and the logits of the prompts themselves. The capture fixed the sequence length to the sample's, so
    every call takes the last ``context`` characters."""
    g = torch.Generator().manual_seed(seed)
    context = prompt.shape[1]
    with torch.no_grad():
        first = logits = logits_of(model, prompt)
        ids = prompt
        for _ in range(length):
            drawn = torch.multinomial(logits[:, -1].softmax(-1), 1, generator=g)
            ids = torch.cat([ids, drawn], dim=1)
            logits = logits_of(model, ids[:, -context:])
    return ids[:, context:], first


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="training steps (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="text windows per mini-batch (default: %(default)s)")
    p.add_argument("--context", type=int, default=32, help="characters per window (default: %(default)s)")
    p.add_argument("--width", type=int, default=32, help="model width (default: %(default)s)")
    p.add_argument("--heads", type=int, default=2, help="attention heads (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="blocks (default: %(default)s)")
    p.add_argument("--split-points", nargs="+", default=["blocks.1", "blocks.3"], metavar="PATH",
                   help="submodules where a stage begins, in forward order (default: %(default)s)")
    p.add_argument("--schedule", default="1F1B", choices=["GPipe", "1F1B"],
                   help="train_step's order of forwards and backwards (default: %(default)s)")
    p.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"],
                   help=CHECKPOINT_HELP)
    p.add_argument("--compare-steps", type=int, default=30,
                   help="steps compared with plain PyTorch, losses and parameters (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--generate", type=int, default=40,
                   help="characters to continue the prompt with after training (default: %(default)s)")
    return p


def _prefixed(what: str) -> Callable[[str], str]:
    return lambda message: f"{what}: {message}"


def check(losses: list[Tensor], state: Mapping[str, Tensor], plain_losses: list[Tensor], plain: nn.Module,
          continued: tuple[Tensor, Tensor], twin_continued: tuple[Tensor, Tensor]) -> None:
    """Raise AssertionError where the pipe and plain PyTorch differ."""
    torch.testing.assert_close(torch.stack(losses[:len(plain_losses)]), torch.stack(plain_losses))
    reference = plain.state_dict()
    assert list(state) == list(reference), f"state-dict keys differ: {list(state)} != {list(reference)}"
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, msg=_prefixed(key))
    # The pipe's head uses stage 2's copy of the tied weight; the twin got stage 0's through the state dict.
    torch.testing.assert_close(continued[1], twin_continued[1], msg=_prefixed("eval-mode logits"))
    assert torch.equal(continued[0], twin_continued[0]), "the pipe in eval mode continues the prompt unlike the plain one"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    started = time.perf_counter()
    # The plain reference is tiny: one thread here, as two intra-op threads stall at every barrier once
    # another process (a stage worker, other work) takes a core, and ran 40 times slower on 2 busy cores.
    torch.set_num_threads(1)
    chars = Chars(TEXT)
    encoded = chars.encode(TEXT)
    mini_batches = batches(encoded, args.steps, args.batch_size, args.context)
    compared = min(args.steps, args.compare_steps)
    model = make_model(len(chars.alphabet), args)
    plain = copy.deepcopy(model)  # the pipe trains copies on its workers; this one trains here
    # eps: the keys' bias gets no gradient (softmax ignores a shift), only rounding noise, which Adam
    # with a tiny eps would turn into full steps that differ between any two summation orders.
    adamw: dict[str, Any] = {"lr": args.lr, "eps": 1e-6, "weight_decay": 0.01}
    print(f"text: {len(TEXT)} characters, {len(chars.alphabet)} distinct; model: "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")

    with Pipe(model, chunks=args.chunks, split_points=args.split_points, sample=mini_batches[0][0],
              checkpoint=args.checkpoint, schedule=args.schedule) as pipe:
        print(f"captured, cut and placed on {len(pipe.stages)} stage workers in {time.perf_counter() - started:.1f}s:")
        for stage in pipe.stages:
            print(f"  {stage}")
        trained = time.perf_counter()
        losses, state = train_pipe(pipe, mini_batches, adamw, max(1, args.steps // 5), snapshot_after=compared)
        trained = time.perf_counter() - trained
        pipe.eval()  # the eval-mode graphs from now on
        prompt = encoded[:args.context].unsqueeze(0)
        continued = continue_text(pipe, prompt, args.generate)
        twin = make_model(len(chars.alphabet), args)
        twin.load_state_dict(pipe.state_dict())

    plain_started = time.perf_counter()
    plain_losses = train_plain(plain, mini_batches[:compared], adamw)
    plain_seconds = time.perf_counter() - plain_started
    twin.eval()
    twin_continued = continue_text(twin, prompt, args.generate)
    print(f"pipeline: {args.steps} steps in {trained:.2f}s, loss {losses[0].item():.4f} -> {losses[-1].item():.4f}; "
          f"plain PyTorch, {compared} steps in {plain_seconds:.2f}s: {plain_losses[0].item():.4f} -> "
          f"{plain_losses[-1].item():.4f}")
    print(f"prompt:              {chars.decode(prompt[0])!r}")
    print(f"pipe (eval):         {chars.decode(continued[0][0])!r}")
    print(f"plain, pipe weights: {chars.decode(twin_continued[0][0])!r}")
    try:
        check(losses, state, plain_losses, plain, continued, twin_continued)
    except AssertionError as e:
        print(f"the pipe differs from plain PyTorch: {e}", file=sys.stderr)
        return 1
    largest = max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    print(f"{compared} steps' losses and parameters match plain PyTorch (largest parameter difference "
          f"{largest:.2g}); total {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
