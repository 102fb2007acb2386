"""The Python client for omniloop's ZeroMQ protocol (see docs/zmq-protocol.md)."""

from omniloop.serve.client import AsyncClient, Client, StreamItem, speech_request

__all__ = ["AsyncClient", "Client", "StreamItem", "speech_request"]
