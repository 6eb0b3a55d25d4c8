"""Errors returned to HTTP clients, in the OpenAI error shape."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from deployments.records import EngineFailure, WaitExpired

logger = logging.getLogger(__name__)


@dataclass
class APIError(Exception):
    """An error that becomes `{"error": {...}}` with an HTTP status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    # OpenAI's shape and wording; the offered key is never echoed.
    return APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def not_found(message: str, code: str = "not_found") -> APIError:
    return APIError(404, message, code=code)


def server_error(message: str, *, retriable: bool = False) -> APIError:
    if retriable:
        return APIError(503, message, type="service_unavailable", code="retry")
    return APIError(500, message, type="internal_error")


def too_many_requests(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="overloaded",
                    headers={"Retry-After": str(retry_after_s)})


@dataclass
class GatewayTimeout(APIError):
    """504: a bounded wait of the request path expired (`wait` names which)."""

    wait: str = ""


# What a client reads for an engine failure: never the failure's own text, which names
# exceptions, hosts and replicas (it goes to the ingress's log instead).
RETRY_MESSAGE = "the engine pool could not serve this request now; retry"
FAILED_MESSAGE = "the engine pool failed to serve this request"


def engine_error(failure: EngineFailure) -> APIError:
    """What the client gets for an engine failure: 400 for vLLM's engine-side validation (as
    its own server answers), 504 for an expired wait, else 503 (retriable) or 500."""
    if failure.invalid_request:
        return bad_request(failure.message, param=failure.param, code="invalid_value")
    if isinstance(failure, WaitExpired):
        return GatewayTimeout(504, failure.message, type="timeout_error", code=f"{failure.wait}_timeout",
                              wait=failure.wait)
    logger.warning("engine failure answered %s: %s", 503 if failure.retriable else 500, failure.message)
    return server_error(RETRY_MESSAGE if failure.retriable else FAILED_MESSAGE, retriable=failure.retriable)


def outcome_of(error: APIError) -> str:
    """The request's outcome label (monitoring.metrics.REQUESTS) for an error answer."""
    if error.status == 429:
        return "rejected"
    if isinstance(error, GatewayTimeout):
        return "timeout"
    return "client_error" if error.status < 500 else "server_error"
