"""What a model is and where its weights live: configurations of every supported family, their gating, the decoder
as pure functions, the canonical and serving layouts (int8, experts split over devices), checkpoint formats
(Hugging Face, moejax), lazy weights and their placement, conversion. Imports only ``moejax.base``."""
