"""Torch-free logic shared by the leader and the fellows."""
