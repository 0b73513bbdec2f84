"""Random numbers on stage workers: each stage seeds its worker from the driver's generator.

A stage worker is another process: the driver's ``torch.manual_seed`` does not reach its dropout or
its factory's initialisation, and under torchrun every rank ran the script's own ``manual_seed``, so
every stage would draw the same numbers. The driver reads its own generator's state (without drawing
from it) and gives stage ``j`` a seed derived from it and ``j``; the worker seeds itself with it when
the stage is built (``rrefpipe.stage_side.server``).
"""
from __future__ import annotations

import hashlib

import torch

__all__ = ["driver_seed", "stage_seed"]


#: Odd 64-bit constant (2^64 / golden ratio): consecutive stages' seeds land far apart.
_SEED_STEP = 0x9E3779B97F4A7C15


def stage_seed(base: int, index: int) -> int:
    """Stage ``index``'s seed from ``base`` (:func:`driver_seed`): a seeded run repeats itself, with
    different numbers on every stage."""
    return (base + _SEED_STEP * (index + 1)) % 2**64


def driver_seed() -> int:
    """64 bits of the driver's CPU generator state, read without drawing from it: the script's random
    numbers stay those of the plain model, and a pipe built after more draws (a second model, the next
    epoch's data) gets other seeds than one built right after ``torch.manual_seed``."""
    state = torch.get_rng_state().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little")
