"""Bridges from agents people already use to a gitrun run (each an optional extra).

This layer sits above :mod:`gitrun.app` and below nothing but the CLI: it drives a run
through the same ``gitrun session`` protocol any other agent uses, as a subprocess.
"""
