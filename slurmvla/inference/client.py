"""openpi's websocket protocol from the client's side, for the closed loop where openpi's own client
(``openpi_client``, which pins numpy < 2 and so is installed apart: ``scripts/install.sh sim``) is not installed.

What it does is what ``openpi_client.WebsocketClientPolicy`` does: connect (with ``Authorization: Api-Key ...``
where a key is given), read the server's metadata, then per call send the observation and read the answer, each a
msgpack frame in openpi's numpy encoding (:mod:`slurmvla.inference.wire`); a text frame is the server's error.
tests/sim/test_sim.py runs the same episodes through both clients and compares them."""

from __future__ import annotations

from typing import Any


class WebsocketClient:
    """One connection to a policy server at ``ws://host:port``."""

    def __init__(self, host: str, port: int, api_key: str | None = None):
        from websockets.sync.client import connect

        from slurmvla.inference.wire import unpackb

        headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
        self._ws = connect(f"ws://{host}:{port}", compression=None, max_size=None, additional_headers=headers)
        self._metadata = unpackb(self._ws.recv())

    def get_server_metadata(self) -> dict:
        return self._metadata

    def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        from slurmvla.inference.wire import packb, unpackb

        self._ws.send(packb(obs))
        answer = self._ws.recv()
        if isinstance(answer, str):
            raise RuntimeError(f"Error in inference server:\n{answer}")
        return unpackb(answer)

    def close(self) -> None:
        self._ws.close()
