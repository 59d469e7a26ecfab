"""The training side of a cell: the RL objective (`objectives`) and, around it, the trainer."""
