"""OTLP response messages: export responses with partial success, and the
`google.rpc.Status` bodies that carry refusals."""

from __future__ import annotations

import math

from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from .errors import BadRequest, Overloaded, Refused, wire_status
from .pipeline import Result

_MAX_ERROR_CHARS = 4096


def export_response(signal: str, result: Result):
    msg = _text(result.message)
    if signal == "traces":
        resp = ExportTraceServiceResponse()
        if result.rejected or msg:
            resp.partial_success.rejected_spans = result.rejected
            resp.partial_success.error_message = msg
    elif signal == "logs":
        resp = ExportLogsServiceResponse()
        if result.rejected or msg:
            resp.partial_success.rejected_log_records = result.rejected
            resp.partial_success.error_message = msg
    else:
        resp = ExportMetricsServiceResponse()
    return resp


def retry_info(error: Overloaded) -> error_details_pb2.RetryInfo:
    secs = max(0.0, error.retry_after)
    return error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=int(secs), nanos=int((secs - int(secs)) * 1e9))
    )


def _text(s: str) -> str:
    """Messages echo what the client sent; a lone surrogate in them cannot be put on
    the wire as UTF-8, so it is written as an escape instead."""
    s = s[:_MAX_ERROR_CHARS]
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def status(error: Refused) -> status_pb2.Status:
    st = status_pb2.Status(code=wire_status(error).grpc.value[0], message=_text(error.message))
    if isinstance(error, Overloaded):
        d = any_pb2.Any()
        d.Pack(retry_info(error))
        st.details.append(d)
    elif isinstance(error, BadRequest) and error.violations:
        d = any_pb2.Any()
        d.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=_text(f), description=_text(why)) for f, why in error.violations
        ]))
        st.details.append(d)
    return st


def retry_after_header(error: Overloaded) -> str:
    return str(max(1, math.ceil(error.retry_after)))
