"""Broker-to-broker transport (seed 003): routes lead a conversation's messages to the
broker that hosts its far service; the transmission queue keeps each until that broker
acknowledges it; a TCP endpoint per broker speaks the adjacent-broker protocol (signed
frames, fragments, piggy-backed acknowledgements, retransmission with backoff)."""

from scheduler_lib.broker.transport.endpoint import (
    TransportEndpoint,
    read_key,
    running,
    tls_contexts,
)
from scheduler_lib.broker.transport.links import ConnectionInfo

__all__ = ["ConnectionInfo", "TransportEndpoint", "read_key", "running", "tls_contexts"]
