"""Tensor parallelism inside one model: the rank's group, its config shard and its checkpoint slices."""
