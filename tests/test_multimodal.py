"""The multimodal list form end to end (separate API and worker processes, real Redis) on the tiny VLM.

Ground truth is the same folder loaded in the test process with transformers' own LLaVA classes and
processor: ``generate`` on the processor's expansion of the same prompt and image. The pixel bound
(maxImagePixels) is also checked in process: the API app over fakeredis, the worker's processor alone.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import httpx
import PIL.Image
import pytest
import redis
import torch
from fastapi.testclient import TestClient
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration

from api.app import create_app
from common import keys
from common.images import ImageRefused, open_image
from common.protocol import Job, MediaRef, SamplingParams
from common.settings import Settings
from openai import BadRequestError, OpenAI
from tests.helpers import Stack, start_stack, stop_stack
from tests.sse import sse_data
from worker.engine import RequestRefused
from worker.media import MediaProcessor
from worker.tiny_model import IMAGE_TOKEN, VLM_IMAGE_TOKENS

TEXT = "My name is Olivier and I"
# The seed's multimodal example (text-stream-infer-api, 多模态模型), its parameters as given.
SEED_PARAMETERS = {
    "decoder_input_details": True, "details": True, "do_sample": True, "max_new_tokens": 20,
    "repetition_penalty": 1.03, "return_full_text": False, "seed": None, "temperature": 0.5, "top_k": 10,
    "top_p": 0.95, "truncate": None, "typical_p": 0.5, "watermark": False, "stop": ["stop1", "stop2"],
    "adapter_id": "None",
}


def picture(color: tuple[int, int, int], size: tuple[int, int] = (48, 40), fmt: str = "PNG") -> bytes:
    image = PIL.Image.new("RGB", size, color)
    for x in range(0, size[0], 4):  # some structure, so that two pictures' features differ
        image.putpixel((x, x % size[1]), (255 - color[0], color[1], 255 - color[2]))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


RED, BLUE = picture((220, 20, 20)), picture((20, 20, 220))
JPEG = picture((20, 200, 20), fmt="JPEG")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("multimodal_inputs")
    (folder / "test.png").write_bytes(RED)
    (folder / "blue.png").write_bytes(BLUE)
    (folder / "broken.png").write_bytes(RED[:40])  # a PNG signature and IHDR, then nothing Pillow can open
    (folder / "truncated.png").write_bytes(RED[:100])  # a header Pillow opens, its pixels cut short
    return folder


@pytest.fixture(scope="module")
def vlm_stack(redis_url: str, tiny_vlm_path: Path, media_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(redis_url, tiny_vlm_path, tmp_path_factory.mktemp("vlm-stack"),
                          {"MULTIMODAL_INPUT_DIR": str(media_dir)})
    yield running
    stop_stack(running)


@pytest.fixture(scope="module")
def reference(tiny_vlm_path: Path):
    processor = AutoProcessor.from_pretrained(tiny_vlm_path)
    model = LlavaForConditionalGeneration.from_pretrained(tiny_vlm_path).eval()

    def greedy(text: str, images: list[bytes], max_new_tokens: int,
               add_special_tokens: bool = True) -> tuple[list[int], int]:
        """The generated ids and the expanded prompt's length."""
        pictures = [PIL.Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        inputs = processor(text=text, images=pictures or None, add_special_tokens=add_special_tokens,
                           return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        return out[0, inputs["input_ids"].shape[1]:].tolist(), inputs["input_ids"].shape[1]

    return greedy


def items(text: str, *images: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": text}, *({"type": "image_url", "image_url": image} for image in images)]


def generate(stack: Stack, inputs: object, **parameters: object) -> httpx.Response:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 8, "details": True, **parameters}}
    # json.dumps escapes as ASCII, so a lone surrogate travels as a client may send it (\ud800)
    return httpx.post(f"{stack.base_url}/generate", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})


def test_the_seed_example_is_served(vlm_stack: Stack, media_dir: Path, reference) -> None:
    body = {"inputs": items(TEXT, str(media_dir / "test.png")), "parameters": SEED_PARAMETERS, "stream": False}
    resp = httpx.post(f"{vlm_stack.base_url}/", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    [answer] = resp.json()
    details = answer["details"]
    _, prompt_len = reference(TEXT + IMAGE_TOKEN, [RED], 1)
    assert details["prompt_tokens"] == prompt_len  # the image's features count as prompt tokens
    assert len(details["prefill"]) == prompt_len
    assert sum(token["text"] == IMAGE_TOKEN for token in details["prefill"]) == VLM_IMAGE_TOKENS
    assert 1 <= details["generated_tokens"] <= 20 and isinstance(answer["generated_text"], str)


def test_greedy_output_equals_transformers_generate(vlm_stack: Stack, media_dir: Path, reference) -> None:
    expected, prompt_len = reference(TEXT + IMAGE_TOKEN, [RED], 8)
    resp = generate(vlm_stack, items(TEXT, "test.png"))
    assert resp.status_code == 200, resp.text
    details = resp.json()["details"]
    assert [token["id"] for token in details["tokens"]] == expected
    assert details["prompt_tokens"] == prompt_len


def test_the_image_changes_the_output(vlm_stack: Stack, reference) -> None:
    red, _ = reference(TEXT + IMAGE_TOKEN, [RED], 8)
    blue, _ = reference(TEXT + IMAGE_TOKEN, [BLUE], 8)
    assert red != blue  # else the tests above would not show that the image reaches the model
    resp = generate(vlm_stack, items(TEXT, "blue.png"))
    assert [token["id"] for token in resp.json()["details"]["tokens"]] == blue


def test_a_base64_jpeg_and_two_images_in_one_prompt(vlm_stack: Stack, media_dir: Path, reference) -> None:
    data_uri = "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()
    expected, _ = reference(TEXT + IMAGE_TOKEN, [JPEG], 8)
    resp = generate(vlm_stack, items(TEXT, data_uri))
    assert resp.status_code == 200, resp.text
    assert [token["id"] for token in resp.json()["details"]["tokens"]] == expected
    inputs = [{"type": "image_url", "image_url": "test.png"}, {"type": "text", "text": " and "},
              {"type": "image_url", "image_url": f"file://{media_dir}/blue.png"}, {"type": "text", "text": TEXT}]
    expected, prompt_len = reference(f"{IMAGE_TOKEN} and {IMAGE_TOKEN}{TEXT}", [RED, BLUE], 8)
    resp = generate(vlm_stack, inputs)
    assert resp.status_code == 200, resp.text
    assert [token["id"] for token in resp.json()["details"]["tokens"]] == expected
    assert resp.json()["details"]["prompt_tokens"] == prompt_len


def test_an_image_url_object_is_the_same_item(vlm_stack: Stack) -> None:
    """OpenAI's ``{"url": ...}`` form of an item's source is taken as the seed's plain string."""
    plain = generate(vlm_stack, items(TEXT, "test.png"))
    wrapped = generate(vlm_stack, [{"type": "text", "text": TEXT},
                                   {"type": "image_url", "image_url": {"url": "test.png"}}])
    assert plain.status_code == wrapped.status_code == 200, wrapped.text
    assert plain.json()["generated_text"] == wrapped.json()["generated_text"]


def test_streaming_with_an_image(vlm_stack: Stack, reference) -> None:
    expected, _ = reference(TEXT + IMAGE_TOKEN, [RED], 8)
    body = {"inputs": items(TEXT, "test.png"), "parameters": {"max_new_tokens": 8, "details": True}}
    with httpx.stream("POST", f"{vlm_stack.base_url}/generate_stream", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = sse_data(resp.read().decode())
    assert [event["token"]["id"] for event in events] == expected
    assert events[-1]["details"]["finish_reason"] == "length"


def test_a_mixed_batch_equals_each_request_alone(vlm_stack: Stack, reference) -> None:
    """Text-only and image requests at once: they share the worker's batches and each gets its solo output."""
    cases = [(items(TEXT, "test.png"), TEXT + IMAGE_TOKEN, [RED]), ([{"type": "text", "text": TEXT}], TEXT, []),
             (TEXT, TEXT, []), (items("A picture:", "blue.png"), "A picture:" + IMAGE_TOKEN, [BLUE])] * 3
    expected = [reference(text, images, 8)[0] for _, text, images in cases]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=vlm_stack.base_url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/generate", json={
                "inputs": inputs, "parameters": {"max_new_tokens": 8, "details": True}}) for inputs, _, _ in cases))

    for resp, want in zip(asyncio.run(run()), expected, strict=True):
        assert resp.status_code == 200, resp.text
        assert [token["id"] for token in resp.json()["details"]["tokens"]] == want


def test_chat_takes_image_parts(vlm_stack: Stack, tiny_vlm_path: Path, reference) -> None:
    """The OpenAI client's image content parts: the message's parts, joined with newlines as its texts are,
    through the chat template, each image as the model's placeholder; greedy output equals transformers'."""
    client = OpenAI(base_url=f"{vlm_stack.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    data_uri = "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()
    content = [{"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": "test.png"}},
               {"type": "image_url", "image_url": {"url": data_uri, "detail": "low"}}]
    completion = client.chat.completions.create(model=vlm_stack.model_name, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": content}])
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm_path)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{TEXT}\n{IMAGE_TOKEN}\n{IMAGE_TOKEN}"}], tokenize=False,
        add_generation_prompt=True)
    expected, prompt_len = reference(rendered, [RED, JPEG], 8, add_special_tokens=False)
    assert completion.usage.prompt_tokens == prompt_len
    assert completion.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    with pytest.raises(BadRequestError, match=r"`messages\[0\].content\[1\]` \(image_url\): local media must lie"):
        client.chat.completions.create(model=vlm_stack.model_name, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}])


def test_media_leave_redis_with_their_request(vlm_stack: Stack) -> None:
    assert generate(vlm_stack, items(TEXT, "test.png")).status_code == 200
    client = redis.Redis.from_url(vlm_stack.redis_url)
    try:
        assert list(client.scan_iter(match=f"ferry:{{{vlm_stack.model_name}}}:media:*")) == []
    finally:
        client.close()


@pytest.mark.parametrize(("inputs", "rule"), [
    (items(TEXT, "../../etc/passwd"), "`inputs[1]` (image_url): local media must lie inside the allowed directory"),
    (items(TEXT, "/etc/passwd"), "`inputs[1]` (image_url): local media must lie inside"),
    (items(TEXT, "http://169.254.169.254/latest"), "`inputs[1]` (image_url): the host 169.254.169.254 is not listed"),
    (items(TEXT, "http://127.0.0.1.nip.io/x.png"), "wildcard-DNS name"),
    ([{"type": "video_url", "video_url": "clip.mp4"}], "`inputs[0]` (video_url): the model `"),
    ([{"type": "audio_url", "audio_url": "a.wav"}], "takes no audio input"),
    (items(f"two {IMAGE_TOKEN} placeholders", "test.png"), "holds 2 image placeholder tokens (<image>) for 1"),
    (items(TEXT, "broken.png"), "`inputs[1]` (image_url): the item cannot be decoded as an image"),
    (items(TEXT, "truncated.png"), "media item 0 cannot be decoded as an image"),  # the worker's refusal
    ([{"type": "image_url", "image_url": "test.png", "detail": "high"}],
     "`inputs.0.image_url.detail` is not a supported"),
    ([{"type": "picture", "url": "test.png"}], "does not match any of the expected tags"),
    ([], "`inputs`: List should have at least 1 item"),
    ([{"type": "text", "text": "a\ud800"}], "unable to parse raw data as a unicode string"),
])
def test_refusals_are_422_naming_the_item_and_rule(vlm_stack: Stack, inputs: object, rule: str) -> None:
    resp = generate(vlm_stack, inputs)
    assert resp.status_code == 422, resp.text
    assert rule in resp.json()["error"] and resp.json()["error_type"] == "validation", resp.text


def test_truncate_may_not_cut_an_image(vlm_stack: Stack) -> None:
    resp = generate(vlm_stack, [{"type": "image_url", "image_url": "test.png"}, {"type": "text", "text": TEXT}],
                    truncate=3)
    assert resp.status_code == 422 and "nor `truncate` cut an item" in resp.json()["error"], resp.text


def test_a_text_only_model_takes_the_text_items_and_refuses_media(stack: Stack) -> None:
    resp = generate(stack, [{"type": "text", "text": "def "}, {"type": "text", "text": "main("}])
    assert resp.status_code == 200, resp.text
    assert generate(stack, "def main(").json()["generated_text"] == resp.json()["generated_text"]
    resp = generate(stack, items(TEXT, "test.png"))
    assert resp.status_code == 422, resp.text
    assert "`inputs[1]` (image_url): the model `" in resp.json()["error"]
    assert "takes no image input" in resp.json()["error"]


# -- maxImagePixels: a few KB that would decode to gigabytes ----------------------------------------

def encoded(image: PIL.Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    """12000 x 12000 (144 M pixels) black images: the PNG of the issue (17 KB) and a JPEG."""
    return {"png": encoded(PIL.Image.new("1", (12000, 12000)), "PNG"),
            "jpeg": encoded(PIL.Image.new("L", (12000, 12000)), "JPEG", quality=1)}


@pytest.fixture(scope="module")
def vlm_app(tiny_vlm_path: Path, bombs: dict[str, bytes],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, fakeredis.FakeServer]]:
    """The API app serving the tiny VLM over fakeredis (no worker: nothing queued may be answered)."""
    folder = tmp_path_factory.mktemp("bomb-media")
    (folder / "huge.png").write_bytes(bombs["png"])
    server = fakeredis.FakeServer()
    settings = Settings(model_path=tiny_vlm_path, multimodal_input_dir=folder, e2e_timeout=5)
    with TestClient(create_app(settings, redis=fakeredis.FakeAsyncRedis(server=server))) as client:
        yield client, server


def test_the_default_pixel_bound_takes_phone_pictures_and_refuses_the_issue_s_image() -> None:
    bound = Settings(model_path=Path("unused")).max_image_pixels
    assert 9248 * 6936 <= bound < 12000 * 12000  # a 64 MP phone's full-size picture; the 144 M pixel PNG


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # refused all the same
def test_an_image_too_large_is_refused_from_its_header_before_anything_is_queued(
        vlm_app: tuple[TestClient, fakeredis.FakeServer], bombs: dict[str, bytes]) -> None:
    """The issue's 17 KB PNG as a file item (TGI: 422) and a 12000 x 12000 JPEG as a base64 data: URI (OpenAI
    chat: 400): each refused with the limit named, and neither a job nor a media item reaches Redis."""
    client, server = vlm_app
    rule = "is an image of 12000 x 12000 = 144,000,000 pixels, more than the 67,108,864 pixels an image may have " \
           "(maxImagePixels)"
    resp = client.post("/generate", json={"inputs": items(TEXT, "huge.png"), "parameters": {"max_new_tokens": 2}})
    assert resp.status_code == 422 and resp.json()["error_type"] == "validation", resp.text
    assert f"`inputs[1]` (image_url): the item {rule}" in resp.json()["error"]
    data_uri = "data:image/jpeg;base64," + base64.b64encode(bombs["jpeg"]).decode()
    model = client.app.state.ctx.model.model_id
    resp = client.post("/v1/chat/completions", json={"model": model, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": TEXT},
                                     {"type": "image_url", "image_url": {"url": data_uri}}]}]})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", resp.text
    assert rule in resp.json()["error"]["message"]
    queue = fakeredis.FakeRedis(server=server)
    assert [queue.xlen(stream) for stream in keys.job_streams(model)] == [0] * len(keys.job_streams(model))
    assert list(queue.scan_iter(match="*:media:*")) == []


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # refused all the same
def test_a_worker_refuses_an_image_too_large_before_decoding_it(bombs: dict[str, bytes]) -> None:
    """Defense in depth (a pod of other settings, a job written to Redis by hand): the worker's processor
    checks the header too, and never reaches the model's processor."""
    processor = MediaProcessor(None, {"image": (7, IMAGE_TOKEN)}, max_pixels=2**26)
    job = Job(request_id="r", model="m", reply_channel="c", input_ids=[1, 7],
              params=SamplingParams(seed=1, max_new_tokens=2),
              media=[MediaRef(kind="image", key="k", size=len(bombs["png"]))], enqueued_at=0.0)
    with pytest.raises(RequestRefused, match=r"media item 0 is an image of 12000 x 12000 = 144,000,000 pixels"):
        processor.expand(job, [bombs["png"]])


def test_open_image_bounds_width_times_height() -> None:
    picture_100x100 = encoded(PIL.Image.new("RGB", (100, 100)), "PNG")
    with open_image(picture_100x100, 10_000) as image:
        assert image.size == (100, 100)
    with pytest.raises(ImageRefused, match=r"100 x 100 = 10,000 pixels, more than the 9,999 pixels"):
        open_image(picture_100x100, 9_999)
