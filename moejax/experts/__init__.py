"""Which experts run and which stay resident: routing policies as data, THE router step, the expert cache
state and its evictions, the learned prior, routing traces and their replay. Imports ``base`` and
``models``."""
