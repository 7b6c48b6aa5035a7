"""Transports: the only client code that talks to the network (HTTP via httpx, gRPC)."""

from r3_client._transports._base import AsyncTransport, Transport
from r3_client._transports._grpc import AsyncGrpcTransport, GrpcTransport
from r3_client._transports._http import AsyncHTTPTransport, HTTPTransport

__all__ = [
    "AsyncGrpcTransport",
    "AsyncHTTPTransport",
    "AsyncTransport",
    "GrpcTransport",
    "HTTPTransport",
    "Transport",
]
