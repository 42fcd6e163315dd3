"""Integrations of UCM with inference engines."""
