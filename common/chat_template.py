"""Chat templates as transformers renders them, for the settings (a template given at start-up is checked
there) and the API pods (which render them without transformers, :mod:`api.tokenizer`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser


class GenerationBlock(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` block (it marks the assistant's text for training
    masks), so that templates using it parse and render here as they do in transformers: like its
    ``AssistantTracker``, the body is a call block (a ``set`` inside stays inside) that renders in place."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        block = jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body)
        block.set_lineno(lineno)
        return block

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


# The Jinja extensions of transformers' chat-template environment (transformers/utils/chat_template_utils.py).
CHAT_TEMPLATE_EXTENSIONS: tuple[str | type[jinja2.ext.Extension], ...] = ("jinja2.ext.loopcontrols", GenerationBlock)


def load_chat_template(value: str) -> str:
    """The text of a chat template given as a file path or inline (vLLM's ``--chat-template`` rule: a value that
    names no file but holds ``{`` is the template itself), checked to be valid Jinja, so that a broken template
    stops the pod at start-up instead of failing every chat request."""
    try:
        text = Path(value).expanduser().read_text()
    except (OSError, ValueError) as exc:  # ValueError: not a possible path (a NUL character)
        if "{" not in value:
            reason = getattr(exc, "strerror", None) or exc
            raise ValueError(f"cannot read the chat template file {value}: {reason}") from None
        text = value
    try:
        jinja2.Environment(extensions=CHAT_TEMPLATE_EXTENSIONS).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template is not valid Jinja: {exc.message} (line {exc.lineno})") from None
    return text
