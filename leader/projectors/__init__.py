"""Projectors: each folds SWARM_EVENTS into the SQL tables it owns."""
