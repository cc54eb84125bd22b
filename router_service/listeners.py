"""The router's two listeners: the data plane (``host:port``) and the control plane with
``/metrics`` (``control_host:control_port``), bound before the server starts so that both
ports are known (0 picks a free one) and one uvicorn server serves both."""

from __future__ import annotations

import socket

from router_service.state import ServiceState

__all__ = ["bind", "bind_listeners"]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6), SO_REUSEADDR set."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def bind_listeners(state: ServiceState) -> tuple[socket.socket, socket.socket]:
    """(data, control) sockets for ``state.settings``; records the control port in
    ``state`` (the app tells the two listeners apart by the port a request came in on)."""
    settings = state.settings
    data = bind(settings.host, settings.port)
    try:
        control = bind(settings.control_host, settings.control_port_to_bind)
    except OSError:
        data.close()
        raise
    state.control_port = control.getsockname()[1]
    state.data_port = data.getsockname()[1]
    return data, control
