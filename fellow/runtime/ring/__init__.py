"""Pipelined serving across fellows: a ring of stages joined by compressed boundaries on NATS."""
