"""Which instrumentation package made a span, told from its scope, and the switch
that turns its message content on.

A user who sees "content missing" needs the one variable of the package they
installed, not a list of every package's: the convention a call is read with does
not say it (OpenLLMetry 0.6x writes the same GenAI attributes as OpenTelemetry's
own packages, and the switches differ). The scope name and version do. Names and
switches were read off real runs of each package (tests/fixtures/).
"""

from __future__ import annotations

from dataclasses import dataclass

from .calls import CAPTURE_HINTS

_OI_HIDE = ("OPENINFERENCE_HIDE_INPUTS / OPENINFERENCE_HIDE_OUTPUTS (and the _INPUT_MESSAGES / _OUTPUT_MESSAGES "
            "variants): unset them or set them to false")
_OTEL_SPAN_ONLY = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY"


@dataclass(frozen=True)
class Instrumentation:
    package: str  # what the user installed, as pip names it
    content_switch: str  # the exact setting that records message content


def identify(scope: str | None, version: str | None = None, convention: str | None = None) -> Instrumentation:
    """The package behind a span's scope (best effort; the scope itself when unknown)."""
    s, v = scope or "", version or ""
    at = f" {v}" if v else ""
    if s.startswith("opentelemetry.util.genai"):
        # openai-v2 2.4+ (and the other GenAI instrumentations on util-genai) write
        # through util-genai's handler, and only its own values turn content on.
        return Instrumentation(f"opentelemetry-util-genai{at} (OpenTelemetry's GenAI instrumentations: openai-v2 2.4+)",
                               f"{_OTEL_SPAN_ONLY} (or EVENT_ONLY, SPAN_AND_EVENT; `true` records nothing here)")
    if s == "opentelemetry.instrumentation.openai_v2":
        return Instrumentation(f"opentelemetry-instrumentation-openai-v2{at}",
                               "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true")
    if s.startswith("openinference.instrumentation."):
        name = s.split(".")[2].lstrip("_").replace("_", "-")
        return Instrumentation(f"openinference-instrumentation-{name}{at}", _OI_HIDE)
    if s.startswith("opentelemetry.instrumentation.") and v and "b" not in v and v.startswith("0."):
        # OpenLLMetry (traceloop) releases its packages under OpenTelemetry's names with
        # plain versions (0.62.4); OpenTelemetry's own contrib packages are betas (0.66b1).
        name = s.split(".")[2].replace("_", "-")
        return Instrumentation(f"OpenLLMetry opentelemetry-instrumentation-{name}{at} (traceloop)",
                               "TRACELOOP_TRACE_CONTENT=true")
    if s.startswith("openlit"):
        return Instrumentation(f"OpenLIT{at}", "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true "
                                               "(openlit.init(capture_message_content=True))")
    if s == "pydantic-ai" or s.startswith("pydantic_ai"):
        return Instrumentation(f"pydantic-ai{at} (built in)",
                               "Agent.instrument_all(InstrumentationSettings(include_content=True))")
    return Instrumentation(f"{s or '(no scope)'}{at}", CAPTURE_HINTS.get(convention or "unknown", CAPTURE_HINTS["unknown"]))
