"""The bytes of a multimodal item (SPEC.md "Multimodal input"), read under the seed's security rules made exact.

* A local path, or a ``file://`` URI, only inside ``multimodalInputDir``: the file is opened first, then the path
  of what was opened (``/proc/self/fd``) must lie inside the folder's real path, so neither ``..``, a symlink nor
  a swap between check and open escapes it. Regular files only (no FIFO or device to hang on).
* ``data:`` URIs: base64 JPEG images only (the seed's "base64 jpg").
* ``http(s)`` only to a host listed in ``ALLOWED_MEDIA_DOMAINS_ENV``, never a wildcard-DNS name (nip.io ...).
  The host is resolved once, every address must be globally routable (loopback, private, link-local,
  multicast, reserved and unspecified are refused, IPv4 inside IPv6 included) and the connection goes to the
  address checked (:class:`_CheckedAddresses`): a second DNS answer cannot swap it. Each redirect is a new URL,
  checked the same way, for at most :data:`MAX_REDIRECTS` hops.
* Per-kind caps, enforced while reading (a lying Content-Length or an endless body is cut off), connect and read
  timeouts plus one for the whole fetch; the type is sniffed from the content (``filetype``), not the name.
* An image's width x height, read from its header (:func:`common.images.open_image`), at most
  ``maxImagePixels``: a few KB can declare a picture whose decoding would take gigabytes of a worker.

Every refusal is a :class:`MediaRefused` naming the item and the rule; adapters answer it as a validation error.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import socket
import ssl
import stat
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from urllib.parse import SplitResult, unquote, urljoin, urlsplit

import anyio
import filetype
import httpcore
from pydantic import BaseModel, ConfigDict

from common.images import ImageRefused, open_image
from common.protocol import MediaKind
from common.settings import Settings

MB = 1024 * 1024
MAX_REDIRECTS = 3
# Public services whose names resolve to any address written into them (127.0.0.1.nip.io -> 127.0.0.1).
WILDCARD_DNS_DOMAINS = ("nip.io", "sslip.io", "xip.io", "traefik.me", "localtest.me", "lvh.me", "vcap.me",
                        "lacolhost.com")
READ_CHUNK = 256 * 1024


@dataclass(frozen=True)
class MediaRule:
    """What a kind of media may be: its size cap and the content types (``filetype`` extensions) taken."""

    cap: int
    types: frozenset[str]

    @property
    def described(self) -> str:
        return f"{', '.join(sorted(self.types))} up to {self.cap // MB} MB"


RULES: Mapping[MediaKind, MediaRule] = MappingProxyType({
    "image": MediaRule(40 * MB, frozenset({"jpg", "png"})),
    "video": MediaRule(512 * MB, frozenset({"mp4", "avi", "wmv"})),
    "audio": MediaRule(40 * MB, frozenset({"mp3", "wav", "flac"})),
})


MAX_MEDIA_ITEMS = 8
"""Media items one request may hold (as vLLM's ``limit_mm_per_prompt``): with the caps, what bounds the bytes a
request holds in its pod and in Redis."""


class MediaSource(BaseModel):
    """A media item as a client named it: ``label`` names it in errors (e.g. ``inputs[1]``)."""

    model_config = ConfigDict(frozen=True)

    kind: MediaKind
    source: str
    label: str


class MediaData(BaseModel):
    """A media item read and checked, on its way to the job's Redis key."""

    kind: MediaKind
    data: bytes


class MediaRefused(Exception):
    """A media item that is not read; the message names the item and the rule."""


Resolver = Callable[[str, int], Awaitable[list[str]]]
Connector = Callable[[str, int, "float | None"], Awaitable[httpcore.AsyncNetworkStream]]


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver)."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def connect_address(address: str, port: int, timeout: float | None) -> httpcore.AsyncNetworkStream:
    return await httpcore.AnyIOBackend().connect_tcp(address, port, timeout=timeout)


def address_refusal(address: str) -> str | None:
    """Why a media host may not be reached at ``address`` (None: a globally routable unicast address)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):  # an IPv4 address carried inside IPv6 is judged as itself
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in ipaddress.IPv6Network("64:ff9b::/96"):  # NAT64
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            ip = embedded
    for label, flag in (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback),
                        ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                        ("reserved", ip.is_reserved), ("private", ip.is_private)):
        if flag:
            return f"a {label} address"
    return None if ip.is_global else "not a globally routable address"


class _CheckedAddresses(httpcore.AsyncNetworkBackend):
    """httpcore's network backend for one fetch: a host is connected to the address checked for it, and a
    host that was not checked is never connected to."""

    def __init__(self, addresses: Mapping[tuple[str, int], str], connect: Connector) -> None:
        self._addresses = addresses
        self._connect = connect

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[object] | None = None) -> httpcore.AsyncNetworkStream:
        address = self._addresses.get((host.strip("[]").rstrip(".").lower(), port))
        if address is None:
            raise httpcore.ConnectError(f"{host}:{port} was not checked")
        return await self._connect(address, port, timeout)

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)


def _sniffed(label: str, kind: MediaKind, data: bytes) -> bytes:
    """``data`` when its content is a type ``kind`` takes (whatever its name says)."""
    rule = RULES[kind]
    guess = filetype.guess(data[:8192])
    found = guess.extension if guess is not None else None
    if found not in rule.types:
        what = f"{found} data" if found else "not a recognised media file"
        raise MediaRefused(f"{label}: the content is {what}; {kind} items take {rule.described}")
    return data


def _too_big(label: str, kind: MediaKind) -> MediaRefused:
    return MediaRefused(f"{label}: the {kind} is larger than the {RULES[kind].cap // MB} MB {kind} items may be")


class MediaLoader:
    """Reads media items for one API pod, under its settings' rules. ``resolve`` and ``connect`` are the DNS
    and TCP seams (tests give their own to reach a local server under a public address)."""

    def __init__(self, settings: Settings, resolve: Resolver = resolve_host, connect: Connector = connect_address,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.settings = settings
        self._resolve = resolve
        self._connect = connect
        self._ssl_context = ssl_context or ssl.create_default_context()

    async def load_all(self, items: list[MediaSource]) -> list[MediaData]:
        """Every item read (one after another: a request's bytes stay bounded); raises :class:`MediaRefused`."""
        if len(items) > MAX_MEDIA_ITEMS:
            raise MediaRefused(f"a request may hold at most {MAX_MEDIA_ITEMS} media items. Given: {len(items)}")
        return [MediaData(kind=item.kind, data=await self.load(item.label, item.kind, item.source)) for item in items]

    async def load(self, label: str, kind: MediaKind, source: str) -> bytes:
        """The bytes of the item ``label``, checked for ``kind`` (an image's size too, from its header: nothing is
        decoded here); raises :class:`MediaRefused`."""
        data = await self._read(label, kind, source)
        if kind == "image":
            await anyio.to_thread.run_sync(self._check_image, label, data)
        return data

    def _check_image(self, label: str, data: bytes) -> None:
        try:
            open_image(data, self.settings.max_image_pixels).close()
        except ImageRefused as exc:
            raise MediaRefused(f"{label}: the item {exc}") from None

    async def _read(self, label: str, kind: MediaKind, source: str) -> bytes:
        scheme = urlsplit(source).scheme.lower() if "://" in source or source.startswith("data:") else ""
        if scheme == "data":
            return self._data_uri(label, kind, source)
        if scheme in ("http", "https"):
            return _sniffed(label, kind, await self._fetch(label, kind, source))
        if scheme == "file":
            parts = urlsplit(source)
            if parts.netloc not in ("", "localhost"):
                raise MediaRefused(f"{label}: a file:// URI names a file of this server (no host); given "
                                   f"host {parts.netloc!r}")
            return _sniffed(label, kind, await anyio.to_thread.run_sync(self._read_local, label, kind,
                                                                        unquote(parts.path)))
        if scheme:
            raise MediaRefused(f"{label}: the scheme {scheme}:// is not taken; give a path under the allowed "
                               "directory, a file://, http(s):// or (images) base64 data: URI")
        return _sniffed(label, kind, await anyio.to_thread.run_sync(self._read_local, label, kind, source))

    # -- local files -------------------------------------------------------------------------------

    def _read_local(self, label: str, kind: MediaKind, path_text: str) -> bytes:
        root = Path(os.path.realpath(self.settings.multimodal_input_dir))
        outside = MediaRefused(f"{label}: local media must lie inside the allowed directory {root} "
                               "(multimodalInputDir); this path resolves outside it")
        if not path_text or "\0" in path_text:
            raise MediaRefused(f"{label}: the path is empty or holds a NUL character")
        path = Path(path_text) if os.path.isabs(path_text) else root / path_text
        if not Path(os.path.realpath(path)).is_relative_to(root):
            raise outside
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise MediaRefused(f"{label}: cannot open {path_text}: {exc.strerror}") from None
        try:
            # What was opened, not what the name pointed to a moment before: a link swapped in between is seen.
            if not Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(root):
                raise outside
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise MediaRefused(f"{label}: {path_text} is not a regular file")
            if info.st_size > RULES[kind].cap:
                raise _too_big(label, kind)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as file:
            data = file.read(RULES[kind].cap + 1)
        if len(data) > RULES[kind].cap:
            raise _too_big(label, kind)
        return data

    # -- data: URIs --------------------------------------------------------------------------------

    @staticmethod
    def _data_uri(label: str, kind: MediaKind, source: str) -> bytes:
        header, sep, payload = source.partition(",")
        media_type = header.removeprefix("data:").split(";")
        if kind != "image" or not sep or media_type[0].lower() not in ("image/jpeg", "image/jpg") \
                or "base64" not in media_type[1:]:
            raise MediaRefused(f"{label}: a data: URI must be a base64 JPEG image (data:image/jpeg;base64,...)")
        if len(payload) > RULES[kind].cap * 4 // 3 + 4:
            raise _too_big(label, kind)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaRefused(f"{label}: the data: URI's payload is not valid base64") from None
        if filetype.guess_extension(_sniffed(label, kind, data)[:8192]) != "jpg":
            raise MediaRefused(f"{label}: a base64 data: image must be a JPEG")
        return data

    # -- http(s) -----------------------------------------------------------------------------------

    async def _fetch(self, label: str, kind: MediaKind, url: str) -> bytes:
        timeout = self.settings.media_timeout
        try:
            with anyio.fail_after(timeout):
                for _ in range(MAX_REDIRECTS + 1):
                    data, location = await self._get(label, kind, url)
                    if location is None:
                        return data
                    url = urljoin(url, location)
        except TimeoutError:
            raise MediaRefused(f"{label}: fetching the {kind} took longer than {timeout:g} s (mediaTimeout)") from None
        raise MediaRefused(f"{label}: more than {MAX_REDIRECTS} redirects")

    async def _checked_origin(self, label: str, url: str) -> tuple[SplitResult, str, int, str]:
        """The URL's parts, host, port and the one address it may be reached at."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise MediaRefused(f"{label}: a redirect to {scheme or 'a relative'}:// is not followed")
        host = (parts.hostname or "").rstrip(".")
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise MediaRefused(f"{label}: the URL's port is not valid") from None
        if not host:
            raise MediaRefused(f"{label}: the URL has no host")
        if any(host == name or host.endswith("." + name) for name in WILDCARD_DNS_DOMAINS):
            raise MediaRefused(f"{label}: {host} is a wildcard-DNS name (it resolves to any address written in it)")
        if host not in self.settings.allowed_media_domains:
            raise MediaRefused(f"{label}: the host {host} is not listed in ALLOWED_MEDIA_DOMAINS_ENV")
        try:
            addresses = await self._resolve(host, port)
        except OSError as exc:
            raise MediaRefused(f"{label}: the host {host} cannot be resolved: {exc}") from None
        if not addresses:
            raise MediaRefused(f"{label}: the host {host} resolves to no address")
        for address in addresses:
            if (why := address_refusal(address)) is not None:
                raise MediaRefused(f"{label}: the host {host} resolves to {address}, {why}")
        return parts, host, port, addresses[0]

    async def _get(self, label: str, kind: MediaKind, url: str) -> tuple[bytes, str | None]:
        """One GET: the body, or the Location of a redirect."""
        parts, host, port, address = await self._checked_origin(label, url)
        cap, timeout = RULES[kind].cap, self.settings.media_timeout
        backend = _CheckedAddresses({(host, port): address}, self._connect)
        name = f"[{host}]" if ":" in host else host  # an IPv6 literal
        host_header = name if parts.port is None else f"{name}:{port}"
        try:
            async with (
                httpcore.AsyncConnectionPool(ssl_context=self._ssl_context, network_backend=backend) as pool,
                pool.stream("GET", parts._replace(fragment="").geturl(),
                            headers=[("Host", host_header), ("Accept", "*/*")],
                            extensions={"timeout": {"connect": timeout, "read": timeout,
                                                    "write": timeout, "pool": timeout}}) as response,
            ):
                headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                           for name, value in response.headers}
                if response.status in (301, 302, 303, 307, 308) and "location" in headers:
                    return b"", headers["location"]
                if response.status != 200:
                    raise MediaRefused(f"{label}: {host} answered HTTP {response.status}")
                length = headers.get("content-length", "")
                if length.isdigit() and int(length) > cap:
                    raise _too_big(label, kind)
                data = bytearray()
                async for chunk in response.aiter_stream():
                    data += chunk
                    if len(data) > cap:
                        raise _too_big(label, kind)
                return bytes(data), None
        except httpcore.TimeoutException:
            raise MediaRefused(f"{label}: {host} did not answer within {timeout:g} s (mediaTimeout)") from None
        except (httpcore.NetworkError, httpcore.ProtocolError, ssl.SSLError) as exc:
            raise MediaRefused(f"{label}: fetching from {host} failed: {exc or type(exc).__name__}") from None
