"""Pipelines: a YAML file -> validated frozen dataclasses -> runner (backend, kernels, model, engine, workload)."""
