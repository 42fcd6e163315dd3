"""Helpers for UCM's tests, demo and benchmarks: small local models and real offline text (nothing heavy here)."""
