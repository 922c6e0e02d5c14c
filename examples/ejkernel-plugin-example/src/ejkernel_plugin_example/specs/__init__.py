"""Specs of the ops this plugin adds (one module per op)."""
