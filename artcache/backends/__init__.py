"""Capture backends: run the target and return captured hidden states per sample."""
