"""api/media.py: where a multimodal item's bytes may come from, each rule with its refusal.

URL fetches reach a real HTTP server on loopback. Loopback is refused by design, so the tests give the loader
the two seams it has for this: a resolver that answers the listed test host names with addresses the test
picks (a public one for the positive paths, private or link-local ones for the refusals), and a connector
that dials the local server whenever the loader connects to the public test address. Everything between
(the listed-host rule, the check of every resolved address, redirects, caps, timeouts) runs as in production.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpcore
import PIL.Image
import pytest

from api.media import MB, RULES, MediaLoader, MediaRefused, MediaSource, address_refusal, connect_address
from common.settings import Settings

PUBLIC = "93.184.215.14"  # any globally routable address: the connector below sends it to the local server
LISTED = ["media.example", "private.example", "elsewhere.example", "127.0.0.1.nip.io", "169.254.169.254", "::1"]


def image_bytes(fmt: str) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


PNG, JPEG = image_bytes("PNG"), image_bytes("JPEG")


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "multimodal_inputs"
    folder.mkdir()
    (folder / "cat.png").write_bytes(PNG)
    (folder / "sub").mkdir()
    (folder / "sub" / "dog.jpg").write_bytes(JPEG)
    (tmp_path / "secret.png").write_bytes(PNG)
    return folder


class Handler(BaseHTTPRequestHandler):
    """The test's media host: /cat.png, redirects, an endless body, a slow body and a lying length."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        routes = {
            "/cat.png": lambda: self._send(PNG),
            "/to-cat": lambda: self._redirect("http://media.example/cat.png"),
            "/to-private": lambda: self._redirect("http://private.example/cat.png"),
            "/to-unlisted": lambda: self._redirect("http://unlisted.example/cat.png"),
            "/to-ftp": lambda: self._redirect("ftp://media.example/cat.png"),
            "/loop": lambda: self._redirect("/loop"),
            "/missing": lambda: self.send_error(404),
            "/endless": self._endless,
            "/slow": self._slow,
            "/lying": self._lying,
            "/claims-big": self._claims_big,
            "/text.png": lambda: self._send(b"this is not an image at all"),
        }
        routes.get(self.path, lambda: self.send_error(404))()

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _endless(self) -> None:
        self.send_response(200)
        self.end_headers()  # no length: the body runs until the connection closes
        chunk = PNG + bytes(MB)
        try:
            while True:
                self.wfile.write(chunk)
        except OSError:
            pass

    def _slow(self) -> None:
        self.send_response(200)
        self.end_headers()
        try:
            self.wfile.write(PNG[:16])
            while True:
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    def _lying(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100")  # then sends more than 40 MB
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(PNG + bytes(41 * MB))

    def _claims_big(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(41 * MB))
        self.end_headers()
        self.wfile.write(PNG)


@pytest.fixture(scope="module")
def media_server() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture
def loader(media_dir: Path, media_server: int) -> MediaLoader:
    answers = {"media.example": [PUBLIC], "private.example": ["10.1.2.3"], "elsewhere.example": [PUBLIC, "192.168.0.7"],
               "127.0.0.1.nip.io": ["127.0.0.1"], "unlisted.example": [PUBLIC]}

    async def resolve(host: str, port: int) -> list[str]:
        if host in answers:
            return answers[host]
        return [host]  # an address literal

    async def connect(address: str, port: int, timeout: float | None) -> httpcore.AsyncNetworkStream:
        assert address == PUBLIC, f"the loader connected to {address}, which it should have refused"
        return await connect_address("127.0.0.1", media_server, timeout)

    settings = Settings(multimodal_input_dir=media_dir, allowed_media_domains=LISTED, media_timeout=2)
    return MediaLoader(settings, resolve=resolve, connect=connect)


async def load(loader: MediaLoader, source: str, kind: str = "image") -> bytes:
    return await loader.load("`inputs[1]` (image_url)", kind, source)  # type: ignore[arg-type]


async def refused(loader: MediaLoader, source: str, kind: str = "image") -> str:
    with pytest.raises(MediaRefused) as info:
        await load(loader, source, kind)
    message = str(info.value)
    assert message.startswith("`inputs[1]` (image_url): "), message
    return message


# -- local files ---------------------------------------------------------------------------------------


async def test_files_inside_the_allowed_directory_are_read(loader: MediaLoader, media_dir: Path) -> None:
    assert await load(loader, str(media_dir / "cat.png")) == PNG
    assert await load(loader, "sub/dog.jpg") == JPEG  # relative to the allowed directory
    assert await load(loader, f"file://{media_dir}/sub/dog.jpg") == JPEG
    assert await load(loader, f"file://localhost{media_dir}/cat.png") == PNG


@pytest.mark.parametrize("source", ["../secret.png", "sub/../../secret.png", "/etc/passwd", "file:///etc/passwd",
                                    "{dir}/../secret.png", "file://{dir}/../secret.png"])
async def test_paths_that_leave_the_allowed_directory_are_refused(loader: MediaLoader, media_dir: Path,
                                                                  source: str) -> None:
    message = await refused(loader, source.format(dir=media_dir))
    assert "must lie inside the allowed directory" in message


async def test_a_symlink_out_of_the_allowed_directory_is_refused(loader: MediaLoader, media_dir: Path) -> None:
    (media_dir / "link.png").symlink_to(media_dir.parent / "secret.png")
    (media_dir / "linkdir").symlink_to(media_dir.parent)
    assert "must lie inside" in await refused(loader, str(media_dir / "link.png"))
    assert "must lie inside" in await refused(loader, "linkdir/secret.png")


async def test_a_symlink_inside_the_allowed_directory_is_followed(loader: MediaLoader, media_dir: Path) -> None:
    (media_dir / "alias.png").symlink_to(media_dir / "cat.png")
    assert await load(loader, "alias.png") == PNG


async def test_a_file_swapped_for_a_link_after_the_check_is_caught(loader: MediaLoader, media_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The path passes the name check, then becomes a link out before it is opened: the opened file's own path
    is what counts."""
    target = media_dir / "swap.png"
    target.write_bytes(PNG)
    real_open = os.open

    def swapping_open(path: object, *args: object) -> int:
        if str(path) == str(target):
            target.unlink()
            target.symlink_to(media_dir.parent / "secret.png")
        return real_open(path, *args)

    monkeypatch.setattr(os, "open", swapping_open)
    assert "must lie inside" in await refused(loader, str(target))


async def test_a_non_image_named_png_is_refused(loader: MediaLoader, media_dir: Path) -> None:
    (media_dir / "fake.png").write_text("#!/bin/sh\necho not an image\n")
    assert "not a recognised media file" in await refused(loader, "fake.png")
    (media_dir / "clip.png").write_bytes(b"\0\0\0\x18ftypmp42" + bytes(64))  # an MP4 named .png
    assert "the content is mp4 data" in await refused(loader, "clip.png")


async def test_an_oversized_file_is_refused_without_reading_it(loader: MediaLoader, media_dir: Path) -> None:
    big = media_dir / "big.png"
    with big.open("wb") as file:
        file.write(PNG)
        file.truncate(RULES["image"].cap + 1)  # sparse: the size is what is checked
    assert "larger than the 40 MB image items may be" in await refused(loader, "big.png")


async def test_special_and_missing_files_are_refused(loader: MediaLoader, media_dir: Path) -> None:
    os.mkfifo(media_dir / "pipe.png")  # opening a FIFO would block a reader: it is refused at once
    assert "is not a regular file" in await refused(loader, "pipe.png")
    assert "is not a regular file" in await refused(loader, "sub")
    assert "cannot open" in await refused(loader, "absent.png")
    assert "NUL" in await refused(loader, "cat.png\0.txt")


async def test_the_media_kind_decides_the_types_and_caps(loader: MediaLoader, media_dir: Path) -> None:
    (media_dir / "song.wav").write_bytes(b"RIFF\x24\0\0\0WAVEfmt " + bytes(64))
    assert (await load(loader, "song.wav", "audio")).startswith(b"RIFF")
    assert "audio items take flac, mp3, wav" in await refused(loader, "cat.png", "audio")
    assert "video items take avi, mp4, wmv up to 512 MB" in await refused(loader, "song.wav", "video")


# -- data: URIs ------------------------------------------------------------------------------------------


async def test_a_base64_jpeg_is_read(loader: MediaLoader) -> None:
    assert await load(loader, "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()) == JPEG


@pytest.mark.parametrize(("source", "rule"), [
    ("data:image/png;base64," + base64.b64encode(PNG).decode(), "base64 JPEG"),
    ("data:image/jpeg;base64,@@not base64@@", "not valid base64"),
    ("data:image/jpeg," + "x" * 10, "base64 JPEG"),
    ("data:text/plain;base64,aGVsbG8=", "base64 JPEG"),
    ("data:image/jpeg;base64," + base64.b64encode(PNG).decode(), "must be a JPEG"),
    ("data:image/jpeg;base64," + base64.b64encode(b"plain text").decode(), "not a recognised media file"),
])
async def test_other_data_uris_are_refused(loader: MediaLoader, source: str, rule: str) -> None:
    assert rule in await refused(loader, source)


async def test_data_uris_carry_images_only(loader: MediaLoader) -> None:
    assert "base64 JPEG" in await refused(loader, "data:image/jpeg;base64," + base64.b64encode(JPEG).decode(), "video")


# -- http(s) ---------------------------------------------------------------------------------------------


async def test_a_listed_public_host_is_fetched_from_the_address_checked(loader: MediaLoader) -> None:
    assert await load(loader, "http://media.example/cat.png") == PNG
    assert await load(loader, "http://MEDIA.example./cat.png") == PNG  # names compare case-insensitively
    assert await load(loader, "http://media.example/to-cat") == PNG  # a redirect to a listed public host


@pytest.mark.parametrize(("url", "rule"), [
    ("http://unlisted.example/cat.png", "not listed in ALLOWED_MEDIA_DOMAINS_ENV"),
    ("http://127.0.0.1.nip.io/cat.png", "wildcard-DNS name"),
    ("http://x.sslip.io/cat.png", "wildcard-DNS name"),
    ("http://169.254.169.254/latest/meta-data", "a link-local address"),
    ("http://[::1]/cat.png", "a loopback address"),
    ("http://private.example/cat.png", "resolves to 10.1.2.3, a private address"),
    ("http://elsewhere.example/cat.png", "resolves to 192.168.0.7, a private address"),  # one bad answer of two
    ("http://media.example/to-private", "resolves to 10.1.2.3, a private address"),
    ("http://media.example/to-unlisted", "unlisted.example is not listed"),
    ("http://media.example/to-ftp", "a redirect to ftp:// is not followed"),
    ("http://media.example/loop", "more than 3 redirects"),
    ("http://media.example/missing", "answered HTTP 404"),
    ("http://media.example/text.png", "not a recognised media file"),
    ("http://media.example/endless", "larger than the 40 MB"),
    ("http://media.example/claims-big", "larger than the 40 MB"),  # refused on the header, nothing read
    ("http://media.example/slow", "took longer than 2 s (mediaTimeout)"),
    ("http://media.example:99999/cat.png", "port is not valid"),
    ("gopher://media.example/cat.png", "the scheme gopher:// is not taken"),
    ("file://media.example/cat.png", "a file:// URI names a file of this server"),
])
async def test_url_rules(loader: MediaLoader, url: str, rule: str) -> None:
    started = time.monotonic()
    assert rule in await refused(loader, url)
    assert time.monotonic() - started < 10  # never a hang


async def test_a_body_past_its_content_length_is_never_read(loader: MediaLoader) -> None:
    assert await load(loader, "http://media.example/lying") == (PNG + bytes(100))[:100]


@pytest.mark.parametrize(("address", "why"), [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"), ("10.0.0.1", "private"),
    ("172.16.5.4", "private"), ("192.168.1.1", "private"), ("fd00::1", "private"), ("169.254.169.254", "link-local"),
    ("fe80::1%eth0", "link-local"), ("224.0.0.1", "multicast"), ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"),
    ("::", "unspecified"), ("240.0.0.1", "reserved"), ("100.64.0.1", "not a globally routable"),
    ("::ffff:10.0.0.1", "private"), ("2002:7f00:1::", "loopback"), ("64:ff9b::a00:1", "private"),
])
def test_addresses_a_media_host_may_not_have(address: str, why: str) -> None:
    assert why in (address_refusal(address) or "")


@pytest.mark.parametrize("address", ["93.184.215.14", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_pass(address: str) -> None:
    assert address_refusal(address) is None


async def test_a_request_holds_at_most_eight_media_items(loader: MediaLoader) -> None:
    items = [MediaSource(kind="image", source="cat.png", label=f"`inputs[{i}]`") for i in range(9)]
    with pytest.raises(MediaRefused, match="at most 8 media items. Given: 9"):
        await loader.load_all(items)
    assert [item.data for item in await loader.load_all(items[:8])] == [PNG] * 8
