"""Scheduling and decoding: the scheduler, the engines' step, sessions, sampling, detokenizing, the serving loop."""
