"""Graceful shutdown on SIGTERM (or Ctrl-C): drain, let in-flight work finish, then stop the jobs.

What happens, in order (NOTE [graceful shutdown]):

1. The signal reaches ``GracefulServer.handle_exit``: uvicorn stops accepting connections, ``/readyz`` answers
   503 from then on, and ``Drain`` is set.
2. Requests in flight (a kernel computing, an upload) run to completion and are answered, for at most
   ``NTK_SHUTDOWN_TIMEOUT_S``; past that uvicorn cancels them and their clients see the connection close (a clean
   failure: nothing half-written is recorded, kernels are not stored).
3. Streams that would never end by themselves (``GET /v1/jobs/{id}/events``) are ended at once: ``DrainMiddleware``
   tells them the client went away, the way Starlette ends a stream whose client disconnects. The client's
   ``wait()`` reconnects to the restarted server and keeps following the job.
4. The lifespan's shutdown stops the job manager: running tiles finish and are recorded, the rest stay pending and
   resume at the next start (a tile still running past the timeout is redone then); the Ray executor disconnects
   (a local Ray it started is shut down with it).
"""

from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["Drain", "DrainMiddleware", "GracefulServer"]


class Drain:
    """Set once the server is shutting down; safe to set from a signal handler."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def bind(self) -> None:
        """Remember the running event loop (call from it, e.g. in the lifespan) so ``set`` can reach it."""
        self._loop = asyncio.get_running_loop()

    def set(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._event.set)
        else:
            self._event.set()

    async def wait(self) -> None:
        await self._event.wait()


class DrainMiddleware:
    """Once ``drain`` is set, a request whose body has been read sees ``http.disconnect`` on its next ``receive``.

    Only a response that listens for the client going away (a stream) calls ``receive`` after the body, so ordinary
    requests finish untouched; streams end within one event-loop tick instead of holding shutdown for the timeout,
    and their body is then closed properly.
    """

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = drained_here = started = completed = False

        async def send_tracking(message: Message) -> None:
            nonlocal started, completed
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = True
            await send(message)

        async def receive_until_drain() -> Message:
            nonlocal body_done, drained_here
            if not body_done:
                message = await receive()
                body_done = message["type"] != "http.request" or not message.get("more_body", False)
                return message
            if self.drain.is_set:
                drained_here = True
                return {"type": "http.disconnect"}
            real = asyncio.ensure_future(receive())
            drained = asyncio.ensure_future(self.drain.wait())
            try:
                done, _ = await asyncio.wait({real, drained}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                drained.cancel()
            if real in done:
                return real.result()
            real.cancel()
            drained_here = True
            return {"type": "http.disconnect"}

        await self.app(scope, receive_until_drain, send_tracking)
        if drained_here and started and not completed:
            # The stream stopped because of the drain, not the client: end its body properly (the last chunk of a
            # chunked response), so the client reads a complete response instead of a broken connection.
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class GracefulServer(uvicorn.Server):
    """uvicorn's server, also setting ``drain`` when the exit signal arrives (before uvicorn's own shutdown)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.drain.set()
        super().handle_exit(sig, frame)
