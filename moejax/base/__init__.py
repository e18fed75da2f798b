"""Plumbing every layer may use: errors and exit statuses, signals, temporary folders, text helpers,
repository paths, and JAX's multi-device / multi-host runtime. Imports nothing else of moejax."""
