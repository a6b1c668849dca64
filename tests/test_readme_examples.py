"""Every client example of the README, run against a served stack, so the README cannot drift from the server.

Examples are read from README.md at collection time: each ``curl`` command of a ``sh`` block (continuation
lines and multi-line quoted bodies joined as a shell joins them) is sent with httpx as curl would send it, and
each ``python`` block is executed. The README's ``localhost:8080`` / ``127.0.0.1:8080`` and model name
``tiny-llama`` are replaced by the test stack's. A curl example answers 200 unless its comments say otherwise
(``HTTP 422``, ``(404)``); when the comment after it is a complete JSON document, the response must equal it.

The stack serves the tiny model as ``make serve`` does, given the tests' chat template through CHAT_TEMPLATE
(``--chat-template``) so the chat examples run whether or not the tiny model carries its own. The one
HTTPS example needs the certificates it names; ``tests/test_tls_auth.py`` serves HTTPS.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from transformers import AutoTokenizer

from tests.helpers import Stack, sample, scrape, start_stack, stop_stack, wait_for
from worker.tiny_model import CHAT_TEMPLATE, make_tiny_lora

pytestmark = pytest.mark.integration  # every test here serves a stack of API and worker processes

README = Path(__file__).resolve().parent.parent / "README.md"
README_HOSTS = ("localhost:8080", "127.0.0.1:8080")
README_MODEL = "tiny-llama"
README_ADAPTER = "/models/tiny-lora"  # the LoRA examples' adapter folder: one the stack's fixture makes
STATUS_IN_COMMENT = re.compile(r"HTTP (\d{3})\b|\((\d{3})\)")
# The KServe section's statement of the prompt its examples' token ids encode.
KSERVE_PROMPT = re.compile(r"The examples send `([^`]*)` as the\s+tiny model's tokenizer encodes it: `(\[[\d, ]*\])`")
CURL_FLAGS = {"-s", "-S", "-N", "-i", "-si", "-sN", "-sS", "-sSN"}  # output options: nothing to send


@dataclass
class CurlExample:
    """One curl command of the README and what its comments say it answers."""

    command: str
    line: int
    heading: str = ""  # the comment lines right above it
    comment: str = ""  # its trailing comment, or the comment lines right below it

    @property
    def expected_status(self) -> int:
        for text in (self.comment, self.heading):
            found = STATUS_IN_COMMENT.search(text)
            if found:
                return int(found.group(1) or found.group(2))
        return 200

    @property
    def expected_json(self) -> object | None:
        """The comment's JSON document, when it is a complete one (nothing left out as ``...``)."""
        if "..." in self.comment:
            return None
        try:
            document, _ = json.JSONDecoder().raw_decode(self.comment)
        except json.JSONDecodeError:
            return None
        return document if isinstance(document, (dict, list)) else None  # "200 while ..." is prose


@dataclass
class Examples:
    curl: list[CurlExample] = field(default_factory=list)
    python: list[tuple[int, str]] = field(default_factory=list)  # (first line, source)


def _unquoted(text: str) -> Iterator[tuple[int, str]]:
    """The characters of ``text`` outside shell quotes, with their positions (the last one tells whether a
    quote is still open: see :func:`_open_quote`)."""
    quote = None
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        else:
            yield i, char
    if quote:
        yield len(text), quote


def _open_quote(text: str) -> bool:
    return any(i == len(text) for i, _ in _unquoted(text))


def _split_comment(text: str) -> tuple[str, str]:
    """(command, trailing comment): the first ``#`` outside quotes after whitespace starts the comment."""
    for i, char in _unquoted(text):
        if char == "#" and i < len(text) and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip(), text[i + 1 :].strip()
    return text.rstrip(), ""


def parse_readme(text: str) -> Examples:
    """The README's curl commands (of ``sh`` blocks) and ``python`` blocks. A command runs on while a line
    ends with a backslash (removed, as the shell does) or a quote is open (the newline kept); comment lines
    right below a command without a trailing comment are its output, other comment lines head the next."""
    examples = Examples()
    language: str | None = None
    heading: list[str] = []
    command: str | None = None
    output_of: CurlExample | None = None
    python: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            if language == "python":
                examples.python.append((number - len(python), "\n".join(python)))
            language = None if language is not None else line[3:].strip()
            heading, command, output_of, python = [], None, None, []
        elif language == "python":
            python.append(line)
        elif language != "sh":
            continue
        elif command is not None or line.startswith("curl "):
            if command is None:
                command = line
            else:
                command = command[:-1] + line if command.endswith("\\") else f"{command}\n{line}"
            if command.endswith("\\") or _open_quote(command):
                continue
            text_part, comment = _split_comment(command)
            example = CurlExample(text_part, number, " ".join(heading), comment)
            examples.curl.append(example)
            command, heading, output_of = None, [], None if comment else example
        elif line.startswith("#") and output_of is not None:
            output_of.comment = f"{output_of.comment} {line[1:].strip()}".strip()
        elif line.startswith("#"):
            heading.append(line[1:].strip())
        else:
            heading, output_of = [], None
    return examples


EXAMPLES = parse_readme(README.read_text())


def _curl_params() -> list[object]:
    params = []
    for example in EXAMPLES.curl:
        marks = []
        if "https://" in example.command:
            marks.append(pytest.mark.skip(reason="needs the example's TLS certificates; tests/test_tls_auth.py "
                                                 "covers HTTPS"))
        params.append(pytest.param(example, id=f"L{example.line}", marks=marks))
    return params


def test_the_readme_has_examples() -> None:
    """The parser finds every example (a README change that hides them from it fails here)."""
    assert len(EXAMPLES.curl) >= 20 and len(EXAMPLES.python) >= 3
    assert all(example.command.count("curl ") == 1 for example in EXAMPLES.curl)


def test_the_kserve_examples_ids_are_the_stated_prompt(tiny_model_path: Path) -> None:
    """The ids the KServe examples send are the tiny model's encoding of the prompt the README says they are
    (so the answers shown are the model's real continuation of that text), in the curl and the Python example."""
    text = README.read_text()
    stated = KSERVE_PROMPT.search(text)
    assert stated is not None, "the KServe section states which prompt its examples' ids encode"
    prompt, ids = stated.group(1), json.loads(stated.group(2))
    assert AutoTokenizer.from_pretrained(tiny_model_path)(prompt).input_ids == ids
    infers = [example for example in EXAMPLES.curl if re.search(r"/v2/models/[^/ ]+/infer\b", example.command)
              and '"data"' in example.command]
    assert infers
    for example in infers:
        words = shlex.split(example.command)
        body = json.loads(words[words.index("-d") + 1])
        assert [tensor["data"] for tensor in body["inputs"]] == [ids], example.line
        assert example.expected_json is None or example.expected_json["outputs"][0]["data"][:len(ids)] == ids
    tritons = [source for _, source in EXAMPLES.python if "set_data_from_numpy" in source]
    assert tritons and all(f"np.array([{ids}]" in source for source in tritons)


@pytest.fixture(scope="module")
def readme_stack(redis_url: str, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("stack-readme")
    template = log_dir / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    running = start_stack(redis_url, tiny_model_path, log_dir,
                          {"CHAT_TEMPLATE": str(template), "LORA_ADAPTER_ROOTS": str(log_dir)})  # README_ADAPTER's
    running.env[README_ADAPTER] = str(make_tiny_lora(tiny_model_path, log_dir / "tiny-lora"))
    yield running
    stop_stack(running)


def _for_stack(text: str, stack: Stack) -> str:
    """The README's host, model name and adapter folder replaced by the stack's."""
    host = urlsplit(stack.base_url).netloc
    for readme_host in README_HOSTS:
        text = text.replace(f"http://{readme_host}", stack.base_url).replace(readme_host, host)
    return text.replace(README_MODEL, stack.model_name).replace(README_ADAPTER, stack.env[README_ADAPTER])


def curl_request(command: str) -> httpx.Request:
    """The request curl would send for ``command`` (the options the README uses)."""
    words = shlex.split(command)
    assert words[0] == "curl"
    method, url, data = None, None, None
    headers: dict[str, str] = {}
    rest = iter(words[1:])
    for word in rest:
        if word in CURL_FLAGS:
            continue
        if word == "-H":
            name, _, value = next(rest).partition(":")
            headers[name.strip().lower()] = value.strip()
        elif word == "-d":
            data = next(rest)
        elif word == "-X":
            method = next(rest)
        elif word.startswith("-"):
            raise AssertionError(f"a curl option this test does not know: {word}")
        else:
            url = word if "://" in word else f"http://{word}"
    assert url is not None, command
    if data is not None:
        headers.setdefault("content-type", "application/x-www-form-urlencoded")  # curl -d's default
    return httpx.Request(method or ("POST" if data is not None else "GET"), url, headers=headers,
                         content=None if data is None else data.encode())


@pytest.mark.parametrize("example", _curl_params())
def test_curl_example(readme_stack: Stack, example: CurlExample) -> None:
    request = curl_request(_for_stack(example.command, readme_stack))
    with httpx.Client(timeout=120) as client:
        response = client.send(request)
    assert response.status_code == example.expected_status, (example.command, response.text)
    expected = example.expected_json
    if expected is not None:
        assert response.json() == json.loads(_for_stack(json.dumps(expected), readme_stack))


@pytest.mark.parametrize(("line", "source"), [pytest.param(*block, id=f"L{block[0]}") for block in EXAMPLES.python])
def test_python_example(readme_stack: Stack, line: int, source: str) -> None:
    """The example runs, and every request it sent was answered: the pod counted them all successful."""

    def counted(name: str) -> float:
        return sample(scrape(readme_stack.base_url), name, model=readme_stack.model_name) or 0.0

    sent, answered = counted("tgi_request_count_total"), counted("tgi_request_success_total")
    code = compile(_for_stack(source, readme_stack), f"README.md, python block at line {line}", "exec")
    exec(code, {"__name__": "readme_example"})
    requests = counted("tgi_request_count_total") - sent
    assert requests > 0
    wait_for(lambda: counted("tgi_request_success_total") - answered == requests, 10, "the example's answers")
