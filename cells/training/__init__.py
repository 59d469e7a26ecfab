"""Training on the cells in the training role: the RL update (cells/rl/) as data parallelism
over the step's group of training cells, the trainer process as its coordinator.

    wire          the training state as tensors + JSON metadata; its checksum
    coordinator   the trainer side of a step: assign, rendezvous, state to joiners, result back
    worker        the cell side: wait for an assignment, join, compute, report
    protocol      the step's assignment, spec and share keys
    bare          bare ranks for tests and benches
    sharded       a step attempt on a cell of S ranks (`cells.train_ranks`): groups, slices, reports
    cell_ranks    a cell's ranks 1..S-1 as processes (`followers`: rank 0 starts and stops them)
    shard_files   a sharded cell's checkpoint: one state directory per rank, an index naming them
    supervised    the supervised warm-up on a rank
    shard_ranks   bare sharded ranks (a cell as S ranks, cells/rl/shard.py) over gloo, for tests and benches
"""
