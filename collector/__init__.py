"""The collector: a sidecar OTLP receiver that makes every span durable before it
answers, and writes span and log datasets as Parquet.

receiver (grpc_server, http_server) -> decode -> pipeline (validate, redact)
-> wal (the ack point) -> flusher (its own process, or a thread: collector.flusher) -> convert -> datasets.
"""
