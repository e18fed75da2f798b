"""Helpers the tests share (imported as ``support.X``; pytest puts ``tests/`` on the path): a local stand-in for
the Hugging Face hub, a file-size limit for a child process, the plain-Python reference cache, the scatter-bounds
check, and a tiny training corpus."""
