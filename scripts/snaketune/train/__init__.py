"""The train job: the launcher (launch, agents, preflight), its attempts and segments across
SLURM requeues, and the workers it starts (worker, progress, health, network, outputs).
Imports every wing below it."""
