"""Communication between the ranks of a tensor-parallel group beyond what torch.distributed gives:
peer memory (regions every rank maps) and the all-reduce that chooses between a custom kernel over
it and NCCL."""
