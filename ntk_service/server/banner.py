"""What the server says when it is ready: where its console, its API reference and its API are, and the
``NTK_URL`` that points the client and the CLI at it.

    >>> print(startup_lines("127.0.0.1", 9000))
    console:   http://127.0.0.1:9000/
    API docs:  http://127.0.0.1:9000/docs
    clients:   export NTK_URL=http://127.0.0.1:9000   (the Python client and the ntk-service CLI read it)
"""

from __future__ import annotations

__all__ = ["startup_lines"]

_EVERY_INTERFACE = frozenset({"", "0.0.0.0", "::", "[::]"})


def _url(host: str, port: int) -> str:
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{host}:{port}"


def startup_lines(host: str, port: int, *, hostname: str | None = None) -> str:
    """The console, docs and ``NTK_URL`` lines of the start-up log.

    Args:
        host (str): the interface the server binds (``NTK_HOST``).
        port (int): its port (``NTK_PORT``).
        hostname (str | None): this machine's name, shown for a server bound to every interface (other machines
            reach it by that name). Default: none.

    Returns:
        str: three lines (four when bound to every interface: the address other machines use).
    """
    local = _url("127.0.0.1" if host in _EVERY_INTERFACE else host, port)
    lines = [
        f"console:   {local}/",
        f"API docs:  {local}/docs",
        f"clients:   export NTK_URL={local}   (the Python client and the ntk-service CLI read it)",
    ]
    if host in _EVERY_INTERFACE and hostname:
        lines.append(f"elsewhere: export NTK_URL={_url(hostname, port)}   (from other machines on the network)")
    return "\n".join(lines)
