"""Partitioner: profiling, planning and simulation of pipeline stages."""
