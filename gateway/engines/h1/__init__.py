"""The HTTP/1 engine: inspected HTTP/1.x served by the gateway itself (TLS or cleartext)."""
