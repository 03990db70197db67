"""Scheduler service: places requests on prefill/decode workers (see pdserve.scheduling)."""
