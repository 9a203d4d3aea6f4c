"""The torch-free leader: gateway, projectors, placement."""
