"""Serve a trained policy to robots over openpi's websocket protocol.

    python -m slurmvla.serve SOURCE [--host H] [--port 8000] [--max-request-mb MB] [--max-connections N]
                                [--max-pending N] [overrides ...]

``SOURCE``: a file written by ``python -m slurmvla.export``, a checkpoint folder, a run directory
or a LeRobot pi0 / pi0.5 checkpoint directory (its weights, statistics and config). Overrides change the run's config (``serve.cameras=[...]``, ``policy.num_inference_steps=5``).

The wire protocol is that of openpi's ``openpi-client`` package: on connect the server sends one
msgpack frame of metadata; each request is a msgpack observation dict whose numpy arrays are maps
``{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str, b"shape": shape}``; each reply
is a msgpack dict with ``actions`` (float32 ``[action_horizon, action_dim]``, raw dataset units)
and ``server_timing``. A request the server cannot use gets a text frame naming the key and what was
expected, and that connection closes (as openpi's server does); other connections go on. ``GET
/healthz`` answers 200, with or without a key. No pickle: arrays are rebuilt from raw bytes with numeric
dtypes only.

Bounded: a request larger than ``serve.max_request_mb`` (``--max-request-mb``) is refused as soon as its
frame header announces the size, before any of it is buffered: the connection closes with code 1009
(message too big), the server logs one line naming the limit and the option, other connections go on.
The default limit is derived from the policy (:func:`default_max_request_bytes`): 4 x one observation
(each camera the client sends counted at the policy's image size or as a 1280 x 720 RGB uint8 frame,
whichever is larger, plus the state as float64 and 64 KiB of prompt), plus 16 MiB. At most
``MAX_QUEUE`` frames wait per connection while the policy runs (openpi's protocol is one request, one
reply; a client that pipelines is held back by TCP flow control).

Overload gets an answer, never an unbounded backlog: at most ``serve.max_connections``
(``--max-connections``, default 64) connections are served at once; one more is refused at the HTTP
handshake with 503 and a body naming the limit and the option. At most ``serve.max_pending``
(``--max-pending``, default 32) requests, over all connections, are being answered or waiting for the
policy at once; one more gets a text frame naming the limit and the option (openpi's client raises it),
and its connection closes with code 1013 (try again later). A request admitted waits behind at most
max_pending - 1 others.

Closed to strangers: with an API key (``serve.api_key_env``, default ``$SLURMVLA_API_KEY``, and/or
``serve.api_key_file``) a connection must send ``Authorization: Api-Key <key>`` (what openpi's
``WebsocketClientPolicy(host, port, api_key=...)`` sends); one without it, or with another key, is
refused with HTTP 401 / 403 before the websocket opens. The key is never logged, never sent back and
never part of the config. The default host is 0.0.0.0 (every interface: robots connect from other
machines, and ``sbatch/serve.sh`` prints the node's address for them), so the server needs a key: listening
beyond this machine without one refuses to start (one ``error:`` line) unless ``--host 127.0.0.1``
(``serve.host``: this machine only) or ``serve.allow_unauthenticated=true`` (then it warns at start-up).

Observations map to the policy's inputs through ``serve.*`` (:class:`slurmvla.config.serve.ServeConfig`),
and are prepared by the functions training uses (:mod:`slurmvla.data.prepare`).
"""


from __future__ import annotations

import argparse
import asyncio
import logging

from slurmvla import garbage_collector
from slurmvla.cli import ArgumentParser, program
from slurmvla.errors import Failure, boundary


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=program("slurmvla.serve"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="an exported .safetensors file, a checkpoint folder, a run directory or a "
                                           "LeRobot pi0 / pi0.5 checkpoint directory")
    parser.add_argument("--host", help="address to listen on (serve.host, default 0.0.0.0: every interface, which needs "
                                       "an API key, see above; 127.0.0.1: this machine only, no key needed)")
    parser.add_argument("--port", type=int, help="port to listen on (serve.port, default 8000; 0: a free one)")
    parser.add_argument("--max-request-mb", help="largest request accepted, in MiB (serve.max_request_mb; default: "
                                                 "derived from the policy's observation size, see above)")
    parser.add_argument("--max-connections", type=int, help="connections served at once; one more gets HTTP 503 "
                                                            "(serve.max_connections, default 64)")
    parser.add_argument("--max-pending", type=int, help="requests answered or waiting at once, over all connections; "
                                                        "one more gets an error frame and close code 1013 "
                                                        "(serve.max_pending, default 32)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. serve.cameras=[...] policy.num_inference_steps=5")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides)
    overrides += [f"serve.host={args.host}"] if args.host is not None else []
    overrides += [f"serve.port={args.port}"] if args.port is not None else []
    limits = {k: v for k, v in (("max_connections", args.max_connections), ("max_pending", args.max_pending))
              if v is not None}
    overrides += [f"serve.{k}={v}" for k, v in limits.items()]
    with boundary():
        from slurmvla.config.serve import ServeConfig

        ServeConfig(**limits)  # the admission flags, by their options' one rule, before anything is read
        if args.max_request_mb is not None:
            try:
                float(args.max_request_mb)
            except ValueError:
                raise ValueError(f"--max-request-mb {args.max_request_mb!r} is not a number of MiB (e.g. 64)") from None
            overrides.append(f"serve.max_request_mb={args.max_request_mb}")
        try:
            import msgpack  # noqa: F401
            import websockets  # noqa: F401
        except ImportError as e:
            raise ValueError(f"the server needs websockets and msgpack ({e}); pip install -e '.[serve]'") from None
        # The policy loaded without the garbage collector walking torch's objects, then frozen: the collections
        # while serving walk only what the requests make (slurmvla.garbage_collector).
        with garbage_collector.paused():
            # torch: after the arguments, so --help is instant
            from slurmvla.inference.build import build_server

            server = build_server(args.source, overrides)
    with boundary(mistakes=()):
        try:
            asyncio.run(server.run())
        except OSError as e:  # the port is taken, the address is not this machine's
            raise Failure(f"cannot listen on {server.host}:{server.port}: {e}") from None

if __name__ == "__main__":
    main()
