"""Baselines GC-MoE is measured against: the SM90 Mega MoE port and the DeepGEMM Mega MoE adapters."""
