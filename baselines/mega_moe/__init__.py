"""Mega MoE baselines: DeepGEMM's kernels behind one interface (``deepgemm``, docs/baselines.md) and the SM90
reference port."""
