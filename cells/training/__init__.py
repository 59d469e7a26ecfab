"""Training on the cells in the training role: the RL update as data parallelism over the step's
group of training cells, the trainer process as its coordinator.

    batch         trajectories (JSON) to padded token tensors
    plan          the coordinator's split of an update: advantages, minibatches, token shares
    update        one RL update on one rank (1 rank: the learner alone; n: a training group)
    reduce        sums over the ranks: gradients on the union of touched vocabulary rows
    wire          the training state as tensors + JSON metadata; its checksum
    coordinator   the trainer side of a step: assign, rendezvous, state to joiners, result back
    worker        the cell side: wait for an assignment, join, compute, report
"""
