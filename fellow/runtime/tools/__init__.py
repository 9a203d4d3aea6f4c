"""Offline tools: export of a servable, the demo model, calibration, bottleneck fitting, chat tokenizer."""
