"""A prefill/decode (xPyD) proxy for vLLM instances that share a UCM store.

Each request goes first to a prefill instance (``kv_role: kv_producer``, or ``kv_both`` as in the seed guides) as a
copy with ``max_tokens: 1``, no streaming, and ``kv_transfer_params: {"do_remote_decode": true}``; UCMConnector
answers it only once the prompt's full blocks are in the store, and returns ``kv_transfer_params:
{"ucm_prefill_blocks": n}``. The proxy then sends the original request, with those ``kv_transfer_params``, to a
decode instance (``kv_role: kv_consumer`` or ``kv_both``), which loads the blocks from the store instead of
recomputing them, and passes its answer (streamed or not) back to the client. The instances never talk to each
other; only the store's directory is shared.

Run (the seed guides' flags; examples/pd/start_pd.sh starts this 2P2D on one machine)::

    python -m ucm.pd.proxy --port 7805 --host 127.0.0.1 \\
        --prefiller-hosts 127.0.0.1 127.0.0.1 --prefiller-ports 7800 7801 \\
        --decoder-hosts 127.0.0.1 127.0.0.1 --decoder-ports 7802 7803

One host per port, or one host for all ports.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI-compatible, streaming passed through),
``GET /v1/models`` (from a decode instance), ``GET /health`` (200 while at least one prefill and one decode instance
answer their ``/health``, else 503 naming the instances down), ``GET /status`` (JSON: each instance's health and
outstanding requests).

Routing: ``--policy round_robin`` (default) or ``least_outstanding`` (fewest requests in flight, ties in turn).
Instances are health-checked every ``--health-interval`` seconds; an instance that fails a check or a request is
skipped until it answers a check again. A request that cannot reach an instance (refused connection, reset, 5xx
before any byte of the answer) is retried on the next instance of the same kind; when none is left the client
gets a 502/503 JSON error naming every instance tried and why it failed. 4xx answers (bad requests) are passed
back unchanged, not retried. Binds 127.0.0.1 unless ``--host`` says otherwise.

Built on aiohttp (server and client).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from aiohttp import web

from ucm.logger import init_logger

logger = init_logger("ucm.pd.proxy")  # also when run as __main__

Policy = Literal["round_robin", "least_outstanding"]
POLICIES: tuple[Policy, ...] = ("round_robin", "least_outstanding")
DEFAULT_PORT = 8000
DEFAULT_HEALTH_INTERVAL_S = 5.0
DEFAULT_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 3.0
# Headers passed on to the instances (others, e.g. Host and Content-Length, belong to one hop).
_FORWARDED_HEADERS = ("Authorization", "X-Request-Id")


class ProxyConfigError(ValueError):
    """Bad proxy arguments (the message names the bad value and what is allowed)."""


@dataclass
class Instance:
    """One vLLM server behind the proxy.

    Attributes:
        kind: ``"prefill"`` or ``"decode"``.
        host / port: where its OpenAI API server listens.
        healthy: the last health check or request succeeded.
        outstanding: requests in flight to it (for ``least_outstanding``).
        last_error: why it was last marked down ("" when never).
    """

    kind: str
    host: str
    port: int
    healthy: bool = True
    outstanding: int = 0
    last_error: str = ""

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """``host:port``, as logs and errors name it."""
        return f"{self.host}:{self.port}"

    def mark_down(self, why: str) -> None:
        """Skip this instance until a health check succeeds."""
        if self.healthy:
            logger.warning("%s instance %s is down: %s", self.kind, self.name, why)
        self.healthy = False
        self.last_error = why

    def mark_up(self) -> None:
        """Route to this instance again."""
        if not self.healthy:
            logger.info("%s instance %s is back", self.kind, self.name)
        self.healthy = True


@dataclass
class Pool:
    """Instances of one kind and the policy choosing among them."""

    kind: str
    instances: list[Instance]
    policy: Policy
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def order(self) -> list[Instance]:
        """Instances in the order to try them: healthy ones by policy, then the others (a last resort: a health
        check can be stale)."""
        n = len(self.instances)
        start = next(self._turn) % n
        rotated = self.instances[start:] + self.instances[:start]
        if self.policy == "least_outstanding":
            rotated.sort(key=lambda i: i.outstanding)  # stable: ties keep the round-robin order
        return [i for i in rotated if i.healthy] + [i for i in rotated if not i.healthy]


def _instances(kind: str, hosts: Sequence[str], ports: Sequence[int]) -> list[Instance]:
    """Pair ``hosts`` with ``ports``; one host stands for all ports.

    Raises:
        ProxyConfigError: no ports, or host and port counts that do not pair.
    """
    opt = {"prefill": "--prefiller", "decode": "--decoder"}[kind]
    if not ports:
        raise ProxyConfigError(f"{opt}-ports names no port; give one or more ports")
    if len(hosts) == 1:
        hosts = list(hosts) * len(ports)
    if len(hosts) != len(ports):
        raise ProxyConfigError(
            f"{opt}-hosts has {len(hosts)} entries and {opt}-ports {len(ports)}; allowed: one host for "
            "all ports, or one host per port"
        )
    for port in ports:
        if not 0 < port < 65536:
            raise ProxyConfigError(f"{opt}-ports: {port} is not a TCP port; allowed: 1-65535")
    return [Instance(kind, h, p) for h, p in zip(hosts, ports, strict=True)]


class _Unreachable(Exception):
    """An instance could not give an answer (connection failed, or 5xx before any byte reached the client)."""


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class PDProxy:
    """The proxy's state and handlers (see the module docstring).

    Args:
        prefill / decode: the instances.
        policy: ``round_robin`` or ``least_outstanding``.
        health_interval_s: seconds between health checks (0: no background checks).
        timeout_s: longest wait for an instance's answer, seconds.

    Raises:
        ProxyConfigError: an unknown policy, or an empty instance list.
    """

    def __init__(
        self,
        prefill: list[Instance],
        decode: list[Instance],
        policy: str = "round_robin",
        health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if policy not in POLICIES:
            raise ProxyConfigError(f"--policy {policy!r} is not known; allowed: {', '.join(POLICIES)}")
        if not prefill or not decode:
            raise ProxyConfigError("the proxy needs at least one prefill and one decode instance")
        self.prefill = Pool("prefill", prefill, policy)
        self.decode = Pool("decode", decode, policy)
        self._health_interval_s = health_interval_s
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ app wiring
    def app(self) -> web.Application:
        """The aiohttp application (its start-up opens the client session and starts the health checks)."""
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self._handle_generate)
        app.router.add_post("/v1/chat/completions", self._handle_generate)
        app.router.add_get("/v1/models", self._handle_models)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/status", self._handle_status)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        await self.check_health()
        if self._health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop())

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------------ health
    async def _check_one(self, inst: Instance) -> None:
        assert self._session is not None
        try:
            async with self._session.get(
                f"{inst.url}/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            ) as resp:
                if resp.status == 200:
                    inst.mark_up()
                else:
                    inst.mark_down(f"/health answered {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            inst.mark_down(f"/health failed: {type(e).__name__}: {e}")

    async def check_health(self) -> None:
        """Check every instance's ``/health`` once (concurrently) and update its state."""
        await asyncio.gather(*(self._check_one(i) for i in self.prefill.instances + self.decode.instances))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            await self.check_health()

    def _status(self) -> dict[str, Any]:
        def one(i: Instance) -> dict[str, Any]:
            return {"instance": i.name, "healthy": i.healthy, "outstanding": i.outstanding, "last_error": i.last_error}

        return {
            "policy": self.prefill.policy,
            "prefill": [one(i) for i in self.prefill.instances],
            "decode": [one(i) for i in self.decode.instances],
        }

    async def _handle_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._status())

    async def _handle_health(self, request: web.Request) -> web.Response:
        ok = any(i.healthy for i in self.prefill.instances) and any(i.healthy for i in self.decode.instances)
        return web.json_response(self._status(), status=200 if ok else 503)

    async def _handle_models(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        failures: list[str] = []
        for inst in self.decode.order():
            try:
                async with self._session.get(f"{inst.url}/v1/models", headers=_forward_headers(request)) as resp:
                    body = await resp.read()
                    return web.Response(body=body, status=resp.status, content_type="application/json")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                inst.mark_down(f"{type(e).__name__}: {e}")
                failures.append(f"{inst.name} ({type(e).__name__}: {e})")
        return _error(503, f"no decode instance is reachable: {'; '.join(failures)}", "ServiceUnavailable")

    # ------------------------------------------------------------------ generation
    async def _handle_generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"request body is not JSON: {e}", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, f"request body must be a JSON object, got {type(body).__name__}", "BadRequestError")
        path = request.path
        headers = _forward_headers(request)
        headers.setdefault("X-Request-Id", uuid.uuid4().hex)
        t0 = time.perf_counter()

        prefill_body = _prefill_body(body, chat=path.endswith("/chat/completions"))
        status, prefill_answer, failures = await self._prefill(path, prefill_body, headers)
        if status is None:
            return _error(
                503 if not failures else 502,
                f"no prefill instance could answer: {'; '.join(failures)}",
                "ServiceUnavailable",
            )
        if status != 200:  # a client error (bad prompt, too long...): the decode instance would refuse it too
            return web.Response(body=prefill_answer, status=status, content_type="application/json")
        try:
            params = json.loads(prefill_answer).get("kv_transfer_params")
        except (json.JSONDecodeError, AttributeError):
            params = None
        decode_body = dict(body)
        if params:
            decode_body["kv_transfer_params"] = params
        else:
            logger.warning(
                "request %s: the prefill answer carries no kv_transfer_params (is the prefill instance running "
                "UCMConnector?); the decode instance computes the prompt itself",
                headers["X-Request-Id"],
            )
        t_prefill = time.perf_counter()
        response = await self._decode(request, path, decode_body, headers)
        logger.debug(
            "request %s: prefill %.1f ms, decode %.1f ms",
            headers["X-Request-Id"],
            (t_prefill - t0) * 1e3,
            (time.perf_counter() - t_prefill) * 1e3,
        )
        return response

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int | None, bytes, list[str]]:
        """POST ``body`` to prefill instances in turn until one answers; ``(status, body, failures)``, status
        ``None`` when none could."""
        assert self._session is not None
        failures: list[str] = []
        for inst in self.prefill.order():
            inst.outstanding += 1
            try:
                async with self._session.post(f"{inst.url}{path}", json=body, headers=headers) as resp:
                    data = await resp.read()
                    if resp.status >= 500:
                        raise _Unreachable(f"answered {resp.status}: {data[:200].decode(errors='replace')}")
                    return resp.status, data, failures
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, _Unreachable) as e:
                why = f"{type(e).__name__}: {e}" if not isinstance(e, _Unreachable) else str(e)
                inst.mark_down(why)
                failures.append(f"{inst.name} ({why})")
                logger.warning("prefill on %s failed (%s); trying the next prefill instance", inst.name, why)
            finally:
                inst.outstanding -= 1
        return None, b"", failures

    async def _decode(
        self, request: web.Request, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """POST ``body`` to a decode instance and pass its answer through (streamed as it arrives)."""
        assert self._session is not None
        failures: list[str] = []
        for inst in self.decode.order():
            inst.outstanding += 1
            out: web.StreamResponse | None = None
            try:
                async with self._session.post(f"{inst.url}{path}", json=body, headers=headers) as resp:
                    if resp.status >= 500:
                        data = await resp.read()
                        raise _Unreachable(f"answered {resp.status}: {data[:200].decode(errors='replace')}")
                    out = web.StreamResponse(status=resp.status)
                    out.content_type = resp.content_type
                    await out.prepare(request)
                    # From here bytes have reached the client: a failure can no longer be retried elsewhere.
                    async for chunk in resp.content.iter_any():
                        await out.write(chunk)
                    await out.write_eof()
                    return out
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, _Unreachable) as e:
                why = f"{type(e).__name__}: {e}" if not isinstance(e, _Unreachable) else str(e)
                inst.mark_down(why)
                if out is not None and out.prepared:
                    logger.warning("decode on %s failed mid-answer (%s); the answer is cut", inst.name, why)
                    return out
                failures.append(f"{inst.name} ({why})")
                logger.warning("decode on %s failed (%s); trying the next decode instance", inst.name, why)
            finally:
                inst.outstanding -= 1
        return _error(502, f"no decode instance could answer: {'; '.join(failures)}", "ServiceUnavailable")


def _forward_headers(request: web.Request) -> dict[str, str]:
    return {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}


def _prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill copy of a request: one output token, no streaming, and the P/D flag for UCMConnector."""
    out = dict(body)
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["n"] = 1  # the decode instance samples the n answers
    for key in ("stream_options", "min_tokens"):
        out.pop(key, None)
    params = dict(out.get("kv_transfer_params") or {})
    params["do_remote_decode"] = True
    out["kv_transfer_params"] = params
    return out


def build_arg_parser() -> argparse.ArgumentParser:
    """The command line (the seeds' shape: ``--prefiller-hosts/--prefiller-ports/--decoder-hosts/--decoder-ports``)."""
    p = argparse.ArgumentParser(prog="python -m ucm.pd.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT})")
    p.add_argument(
        "--prefiller-hosts", nargs="+", default=["127.0.0.1"], help="prefill hosts: one per port, or one for all"
    )
    p.add_argument("--prefiller-ports", nargs="+", type=int, required=True, help="prefill instances' ports")
    p.add_argument(
        "--decoder-hosts", nargs="+", default=["127.0.0.1"], help="decode hosts: one per port, or one for all"
    )
    p.add_argument("--decoder-ports", nargs="+", type=int, required=True, help="decode instances' ports")
    p.add_argument("--policy", default="round_robin", help=f"instance selection: {' or '.join(POLICIES)}")
    p.add_argument(
        "--health-interval",
        type=float,
        default=DEFAULT_HEALTH_INTERVAL_S,
        help=f"seconds between health checks (default {DEFAULT_HEALTH_INTERVAL_S}; 0: only at start)",
    )
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="longest wait for an instance's answer, seconds"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the proxy until interrupted. Returns the exit status (2 for bad arguments)."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        proxy = PDProxy(
            _instances("prefill", args.prefiller_hosts, args.prefiller_ports),
            _instances("decode", args.decoder_hosts, args.decoder_ports),
            policy=args.policy,
            health_interval_s=args.health_interval,
            timeout_s=args.timeout,
        )
    except ProxyConfigError as e:
        parser.error(str(e))
    logger.info(
        "PD proxy on http://%s:%d: prefill %s, decode %s, policy %s",
        args.host,
        args.port,
        [i.name for i in proxy.prefill.instances],
        [i.name for i in proxy.decode.instances],
        args.policy,
    )
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
