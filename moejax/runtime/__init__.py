"""Running a model: the simulated expert cache around the decoder, the decode loop, real offloading and
paging, ``moejax.load`` / ``Model``, the command-line options, ``generate`` and the server. Imports
``base``, ``models`` and ``experts``."""
