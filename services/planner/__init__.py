"""Planner service: moves mixed workers between prefill and decode duty."""
