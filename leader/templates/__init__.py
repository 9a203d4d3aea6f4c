"""Jinja templates of the web pages (shipped as package data)."""
