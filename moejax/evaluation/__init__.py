"""Measuring: perplexity, downstream tasks, resumable sweeps, the paper's studies, figures and the report.
Imports every layer below it (never ``training``)."""
