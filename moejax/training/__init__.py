"""Training: the model (``train``), the learned cache prior (``train_prior``) and their corpus data. Imports
every layer below it (never ``evaluation``)."""
