"""Solver: per-block options, the CP-SAT model, baseline strategies, plan construction."""
