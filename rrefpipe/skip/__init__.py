"""Skip connections: tensors that jump from one layer to a later one, stage worker to stage worker."""
from .namespace import Namespace
from .skippable import Skippable, pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Namespace", "Skippable"]
