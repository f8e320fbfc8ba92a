"""What one rank of a tensor-parallel job runs: the sharding plan and a per-rank trace on fake tensors."""
