"""The batches of the one-rank NN step tests (test_nn_step.py, test_tasks.py): their dense width
and their slots' embedding shapes."""

NUM_DENSE = 3
SHAPES = [(4,), (4,), (3, 4)]  # two pooled slots and a sequence slot of max_len 3
