"""OTLP/gRPC: the Trace, Logs and Metrics `Export` services.

Handlers take the raw request bytes (no deserializer) so an unchanged protobuf
request is written to the WAL as received, without re-serializing it.
"""

from __future__ import annotations

import hmac
import logging
import time
from concurrent import futures

import grpc

from . import decode, listen
from .errors import Overloaded, Refused, TooLarge, Unauthenticated, wire_status
from .fairness import peer_host
from .pipeline import Pipeline
from .responses import export_response, retry_info, status

log = logging.getLogger("nightshift.collector.grpc")

SERVICES = {
    "traces": "opentelemetry.proto.collector.trace.v1.TraceService",
    "logs": "opentelemetry.proto.collector.logs.v1.LogsService",
    "metrics": "opentelemetry.proto.collector.metrics.v1.MetricsService",
}


def make_export(signal: str, pipeline: Pipeline, token: str, limit: int):
    """`export(request_bytes, context) -> response_bytes`, aborting the call with
    the mapped status on a refusal; the fuzzing campaigns call it directly."""
    expected = f"Bearer {token}".encode() if token else b""
    metrics = pipeline.metrics

    def export(request: bytes, context: grpc.ServicerContext) -> bytes:
        t0 = time.perf_counter()
        try:
            if expected:
                got = dict(context.invocation_metadata()).get("authorization", "")
                if not hmac.compare_digest(got.encode() if isinstance(got, str) else got, expected):
                    raise Unauthenticated("missing or wrong bearer token (metadata `authorization: Bearer <token>`)")
            if len(request) > limit:
                raise TooLarge(f"request is {len(request)} bytes, over the {limit}-byte limit")
            with pipeline.admit(peer_host(context.peer()), len(request), signal) as slot:
                slot.charge(len(request))
                result = pipeline.export(signal, decode.parse(signal, request, decode.PROTOBUF))
            return export_response(signal, result).SerializeToString()
        except Refused as e:
            metrics.refused.labels(signal, e.reason).inc()
            st = status(e)
            trailers = [("grpc-status-details-bin", st.SerializeToString())]
            if isinstance(e, Overloaded):
                trailers.append(("google.rpc.retryinfo-bin", retry_info(e).SerializeToString()))
            context.set_trailing_metadata(tuple(trailers))
            context.abort(wire_status(e).grpc, e.message)
        except Exception:  # a bug: INTERNAL, logged, instead of grpc's bare UNKNOWN
            log.exception("unexpected error handling %s Export", signal)
            context.abort(grpc.StatusCode.INTERNAL, "internal error")
        finally:
            metrics.request_seconds.labels("grpc", signal).observe(time.perf_counter() - t0)

    return export


def bind(address: str, pipeline: Pipeline, *, token: str, limit: int, workers: int,
         tls: tuple[bytes, bytes] | None) -> tuple[grpc.Server, int]:
    """The server bound to `address`, not yet started; CannotListen says why it
    cannot be (tried with a plain socket first: gRPC's own error has no reason)."""
    listen.try_bind(address)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", 4 << 20),
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(svc, {"Export": grpc.unary_unary_rpc_method_handler(make_export(sig, pipeline, token, limit))}) for sig, svc in SERVICES.items()]
    )
    try:
        if tls:
            cert, key = tls
            port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # taken since try_bind, a moment ago
        port = 0
    if port == 0:
        server.stop(None)
        raise listen.CannotListen(address, "gRPC could not bind it (taken a moment ago?)")
    return server, port
