"""Parallelism and memory schemes, one module each (issue 19 moves the others here one by one):

* :mod:`planner.schemes.recompute`: activation recomputation of repeated layers.
"""
