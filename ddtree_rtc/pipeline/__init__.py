"""Pipelines: a YAML file -> validated frozen dataclasses -> stage graph -> runner."""
