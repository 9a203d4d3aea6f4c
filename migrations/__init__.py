"""Alembic environment and versions for the leader's SQL projections."""
