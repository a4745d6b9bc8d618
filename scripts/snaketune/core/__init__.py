"""The floor every other wing stands on: user errors, atomic file writes, secret masking,
the hand-off between launcher and workers, the run lock, heartbeats, collectives,
checkpoint marks, provenance, throughput figures, 4-bit settings, held-out settings.
Imports no other wing."""
