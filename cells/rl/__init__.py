"""The RL maths, imported by both the trainer process and the cells' training ranks; it imports
neither (`tests/test_shape.py`).

    objectives    advantages, ratios, train/inference correction, PPO and its variants, KL, trees
    batch         trajectories (JSON) to padded token tensors
    plan          the coordinator's split of an update: advantages, minibatches, token shares
    update        one RL update on one rank (1 rank: the learner alone; n: a training group)
    guard         the trust-region guard: the update's KL to the policy it started from
    trees         tree rollouts: shared prefixes computed once
    tree_loss     the losses over a tree's tokens
    reduce        sums over the ranks: gradients on the union of touched vocabulary rows
    learner       parameters, optimizer, EWMA and reference copies; one process's update
    lr_schedule   the learning-rate schedule
    vocab_rows    the vocabulary rows a step touches
    packing       several sequences per forward, packed without padding
    precision     fp32 or bf16 compute and gradient sums over fp32 state
    shard         a cell's S ranks: the training state sharded S ways, cross-cell sums per step
    shard_state   one rank's slices as a flat buffer + JSON; re-sharding across S
    shard_ckpt    a sharded learner's snapshot and one-rank checkpoint format
    layer_gather  the compute weights gathered a layer at a time from a cell's slices
    layer_forward the loss's forwards over gathered layers
    shard_gathered  `GatheredLearner`: no compute copy (`trainer.shard_layout: gathered`)
    memory        per-rank memory as a formula (docs/TRAINING.md)
"""
