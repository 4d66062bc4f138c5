"""Trace replay: formats, the synthetic workload, the replay driver and its report."""
