"""Decode service: continues prefilled requests from their KV; with --role mixed also serves
colocated generation (the Mixed service)."""
