"""The stage side: modules whose code runs in the process that holds a stage.

That process is a stage worker (``python -m workers``, or a serving rank of a ``torchrun`` group), or,
for a pipe in a world of one process (``init_rpc(world_size=1)``), the driver itself, which then runs
its stages through :mod:`rrefpipe.driver_side.local`. The driver names these modules' functions in its
RPCs (``rpc.rpc_async(worker, server.create_stage, ...)``), and they run where the stage is: building
it, the data path, a schedule's forwards and backwards, a stream's weight versions, the stage's
gradients, optimizer and checkpointing.

The one import rule: no module here imports :mod:`rrefpipe.driver_side`, at any depth and lazily
neither (``tests/test_imports.py``). The stage side reaches the driver only through functions the
driver hands it, as ``server.connect`` takes ``deliver`` and ``keep_phony``, which the last stage calls
over RPC. The top level of ``rrefpipe`` (what both sides use) is imported freely.
"""
