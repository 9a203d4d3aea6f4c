"""Contracts between leader and fellows: every message, subject and stream, declared once."""
