"""pdserve: a Prefill/Decode-disaggregated LLM inference server.

The package is the shared library (engine, KV hand-off, scheduling, telemetry, client,
config); the gRPC services under ``services/`` only wire it together.
"""

__version__ = "0.1.0"
