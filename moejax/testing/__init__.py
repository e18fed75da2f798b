"""Tools for testing and benchmarking at real shapes without the real weights (``random_checkpoint``)."""
