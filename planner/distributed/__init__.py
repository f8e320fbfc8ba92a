"""Distributed training: the FSDP2 (fully_shard) model of per-rank buffers, prefetch and communication."""
