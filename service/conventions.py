"""The ecosystem's conventions the telemetry follows, where they need code of their own.

The OpenTelemetry resource comes from the SDK's environment detection, with our defaults
only where the environment is silent; ``/metrics`` is rendered in the format the scraper
negotiates, by ``prometheus_client``. Names and choices: docs/decisions.md, "Conventions".
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.resources import (
    SERVICE_NAME,
    SERVICE_VERSION,
    OTELResourceDetector,
    Resource,
)


def version() -> str:
    """The installed relay's version (``pyproject.toml``), or ``unknown`` from a bare tree."""
    from importlib import metadata

    try:
        return metadata.version("reminder-relay")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_resource(default_service_name: str) -> Resource:
    """The SDK's resource from the environment, with our defaults only where it is silent.

    ``Resource.create`` runs the SDK's detectors (``OTEL_RESOURCE_ATTRIBUTES``,
    ``OTEL_SERVICE_NAME``, ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS``); ``service.name`` falls
    back to ``default_service_name`` only when neither variable names one, and
    ``service.version`` to the package's version.
    """
    detected = Resource.create()
    from_env = OTELResourceDetector().detect().attributes
    defaults: dict[str, str] = {}
    if not from_env.get(SERVICE_NAME):
        defaults[SERVICE_NAME] = default_service_name
    if not from_env.get(SERVICE_VERSION):
        defaults[SERVICE_VERSION] = version()
    return detected.merge(Resource(defaults)) if defaults else detected


def render_prometheus(registry: Any, accept: str | None) -> tuple[bytes, str]:
    """``/metrics`` body and Content-Type, negotiated by ``prometheus_client`` on Accept.

    The text format (0.0.4) by default, OpenMetrics when the scraper asks for it.
    """
    from prometheus_client import exposition

    encoder, content_type = exposition.choose_encoder(accept or "")
    return encoder(registry), content_type
