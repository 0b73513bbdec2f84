"""The driver side: modules whose code runs only in the driver, the process that builds a ``Pipe`` and
calls it.

Where stages go (``placement``), feeding stage 0 and collecting outputs (``remote.RemoteDriver``; in a
world of one process ``local.LocalDriver``, which holds the stages itself), the one message per worker
that starts a training step or a stream (``training``, ``streaming``), naming a failure (``diagnosis``,
``contexts``), and the driver's part of optimizers, clipping and loss scaling (``pipe_optimizer``,
``clip``, ``grad_scaler``), and the RRef that ``Pipe.forward`` returns (``output``).

The one import rule, seen from here: these modules may import :mod:`rrefpipe.stage_side`, to name its
functions in RPCs (they run on the stage's worker) or, in a world of one process, to call them; the
stage side never imports a module of this package (``tests/test_imports.py``).
"""
