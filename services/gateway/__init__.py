"""The OpenAI-compatible HTTP gateway service."""
